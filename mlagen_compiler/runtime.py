"""Runtime of the generated modules: the host-side Python that is the same for every spec.

A generated module (templates/module.py.jinja) holds its spec's kernels and what differs per spec (constants,
launch tables, wrappers that read them); it imports from here the argument checks, the launch machinery
(Triton's dispatch, the direct launch of a compiled kernel, prepared launches and the raw launch through
Triton 3.6's compiled C launcher), validation of index values and the device queries. Ordinary package
source, tested as Python (tests/test_prepared_launch.py, tests/test_bad_input.py, ...).

The on/off environment variables (launch_policy.ENV_KNOBS) are read once, when this module is first imported.
"""

import os
import re

import torch
import triton

from .launch_policy import env_knob

#: the installed Triton release as (major, minor); (0, 0) where its version string is not a release
_release = re.match(r"(\d+)\.(\d+)", triton.__version__)
TRITON_VERSION = (int(_release.group(1)), int(_release.group(2))) if _release else (0, 0)

#: SM count assumed under the interpreter, so CPU runs still split the cache into several runs
INTERPRETER_SM_COUNT = 2

# Under Triton's CPU interpreter bf16 dots are wrong, so operands are upcast there; the GPU path is not.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _env_switch(name):
    """An on/off environment variable (ENV_KNOBS: "1" or "0", unset: its default); anything else is an error
    naming it, rather than silently one of the two."""
    return env_knob(name, os.environ.get(name)) == "1"


# Tests set this so that a kernel reading a workspace element nobody wrote yields NaN, not stale memory.
_POISON_WORKSPACE = _env_switch("MLAGEN_POISON_WORKSPACE")
# Check every index value against what it indexes (see _validating); the tests and `mlagen verify` set it.
_VALIDATE_ALWAYS = _env_switch("MLAGEN_VALIDATE")
# Launch compiled kernels directly once Triton has dispatched an argument key (see _launch); 0 turns it off.
_DIRECT_LAUNCH = _env_switch("MLAGEN_DIRECT_LAUNCH")


# ---- the device ---------------------------------------------------------------------------------------

_SM_COUNT = {}


def _sm_count(device):
    if _INTERPRET or device.type != "cuda":
        return INTERPRETER_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


_GPU_CAPABILITY = {}
_GPU_KEY = {}


def _gpu_capability(device):
    """(major, minor) compute capability of a CUDA device, read once; None under the interpreter, for other
    devices and with a torch built without CUDA."""
    if _INTERPRET or device.type != "cuda":
        return None
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _GPU_CAPABILITY:
            _GPU_CAPABILITY[index] = tuple(torch.cuda.get_device_capability(index))
    except (AssertionError, RuntimeError):  # a torch without CUDA: no capability to read
        return None
    return _GPU_CAPABILITY[index]


def _gpu_key(device):
    """(arch, device name) that tuned configurations are recorded under: ("sm90", "NVIDIA H100 80GB HBM3")."""
    capability = _gpu_capability(device)
    if capability is None:
        return ("interpreter", "interpreter")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _GPU_KEY:
        _GPU_KEY[index] = (f"sm{capability[0]}{capability[1]}", torch.cuda.get_device_name(index))
    return _GPU_KEY[index]


# ---- argument checks --------------------------------------------------------------------------------


def _check(condition, name, message):
    if not condition:
        raise ValueError(f"{name}: {message}")


def _check_tensor(tensor, name, *, ndim, dtype, device=None, last_dim=None):
    # one boolean test on the path every call takes; messages are formatted only for a tensor that fails it
    if (
        isinstance(tensor, torch.Tensor)
        and tensor.dim() == ndim
        and tensor.dtype == dtype
        and (device is None or tensor.device == device)
        and (last_dim is None or tensor.shape[-1] == last_dim)
        and tensor.stride(-1) == 1
    ):
        return
    _check(isinstance(tensor, torch.Tensor), name, f"expected a torch.Tensor, got {type(tensor).__name__}")
    _check(tensor.dim() == ndim, name, f"expected {ndim} dimensions, got shape {tuple(tensor.shape)}")
    _check(tensor.dtype == dtype, name, f"expected dtype {dtype}, got {tensor.dtype}")
    if device is not None:
        _check(tensor.device == device, name, f"expected device {device}, got {tensor.device}")
    if last_dim is not None:
        _check(
            tensor.shape[-1] == last_dim, name, f"expected last dimension {last_dim}, got shape {tuple(tensor.shape)}"
        )
    _check(tensor.stride(-1) == 1, name, "the last dimension must be contiguous")


def _check_flag(value, name):
    _check(value is True or value is False, name, f"expected True or False, got {value!r}")


def _check_host_int(value, name, minimum=0):
    _check(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        name,
        f"must be an int >= {minimum}, got {value!r}",
    )


def _check_device(device, name):
    """A device the kernels can run on: a meta tensor holds no data (the wrappers read index values)."""
    _check(
        device.type != "meta",
        name,
        "a meta tensor holds no data: the kernels need CUDA tensors (or CPU "
        "tensors under TRITON_INTERPRET=1); torch.compile's fake tensors go through the module's ops",
    )


def _check_per_sequence(tensor, name, batch, device, *, ndim):
    """An int32 block table ([B, max_pages]) or per-sequence lengths ([B]) for a batch of `batch`."""
    _check_tensor(tensor, name, ndim=ndim, dtype=torch.int32, device=device)
    _check(tensor.shape[0] == batch, name, f"batch size {tensor.shape[0]} disagrees with {batch}")


# ---- launching -------------------------------------------------------------------------------------

#: per kernel: launch key -> the compiled kernel Triton's dispatch chose for it
_COMPILED = {}


def _launch_key(kernel, values, options):
    """Everything Triton specialises a compiled kernel on: tensors by dtype and 16-byte alignment, TMA
    descriptors by their base, shape, strides and box, runtime floats by type (the one float constexpr,
    _LN2, is a module constant), runtime ints by what Triton reads of them (width, equality to 1,
    divisibility by 16: a token count that changes every call does not miss), and constexprs, bools,
    None and layouts by value; plus the launch options."""
    key = []
    for value, param in zip(values, kernel.params, strict=False):
        if isinstance(value, torch.Tensor):
            key.append((value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, float):
            key.append(float)
        elif type(value) is int and not param.is_constexpr:
            key.append((int, value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value < 2**63))
        elif hasattr(value, "block_shape"):  # a host TMA descriptor (Triton's or Gluon's)
            key.append(
                (
                    type(value),
                    value.base.dtype,
                    value.base.data_ptr() % 16 == 0,
                    tuple(value.shape),
                    tuple(value.strides),
                    tuple(value.block_shape),
                    getattr(value, "layout", None),
                )
            )
        else:
            key.append(value)
    return tuple(key), options


def _ordered_values(kernel, args, constexprs):
    """Every argument in the kernel's order (keyword ones too: KV_SCALE is a tensor passed by name)."""
    return args + tuple(constexprs[name] for name in kernel.arg_names[len(args) :])


def _launch_options(num_warps, num_stages, launch_pdl=False):
    options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    if launch_pdl:  # a programmatic dependent launch (compiled into the kernel's launcher; never interpreted)
        options["launch_pdl"] = True
    return options


def _launch_compiled(compiled, grid, values, device=None):
    """Launch a kernel Triton compiled, on the current device's current stream (as Triton does), through
    its launcher alone: not its dispatch, nor `CompiledKernel[grid]`'s per-launch closure and hook
    metadata, where no launch hook (e.g. Proton's) is installed. Same call in Triton 3.6 through 3.9.
    device: the current device's index, where the caller has it."""
    if _launch_hooks():
        compiled[grid](*values)
        return
    if device is None:
        device = triton.runtime.driver.active.get_current_device()
    stream = triton.runtime.driver.active.get_current_stream(device)
    compiled.run(
        grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *values
    )


def _current_stream(device):
    """The raw handle of `device`'s current CUDA stream: Triton's reading of it (torch.cuda.current_stream
    makes a Stream object per call: slower); torch's under the interpreter, which has no GPU driver."""
    if _INTERPRET:
        return torch.cuda.current_stream(device).cuda_stream
    return triton.runtime.driver.active.get_current_stream(device.index)


def _grid3(grid):
    return tuple(grid) + (1,) * (3 - len(grid))


def _dispatch(kernel, grid, args, options):
    """kernel[grid](*args, **options): Triton's dispatch, which compiles on a new key and returns the kernel.
    Triton serialises a kernel's constexprs to JSON for its compile hooks (knobs.runtime.jit_cache_hook and
    jit_post_compile_hook; vLLM installs one to watch for compiles while serving), and a Gluon layout is not
    JSON: with a hook installed every Gluon compile would raise TypeError. The hooks are set aside while a
    Gluon kernel is dispatched, and only then."""
    runtime = triton.knobs.runtime
    is_gluon = getattr(kernel, "is_gluon", None)  # the interpreter's kernels have none (nor compile hooks)
    if not (is_gluon and is_gluon() and (runtime.jit_cache_hook or runtime.jit_post_compile_hook)):
        return kernel[grid](*args, **options)
    hooks = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    runtime.jit_cache_hook = runtime.jit_post_compile_hook = None
    try:
        return kernel[grid](*args, **options)
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = hooks


def _launch(kernel, grid, *args, num_warps, num_stages=None, **constexprs):
    """kernel[grid](*args, **constexprs) at a fraction of its host cost.

    Triton's dispatch binds and specialises all arguments and looks the compiled kernel up on every
    launch (tens of microseconds of Python); here it runs on the first launch of each key (_launch_key:
    the specialisation's inputs) and later launches go to that compiled kernel through its launcher
    (_launch_compiled). The interpreter, and MLAGEN_DIRECT_LAUNCH=0, always take the dispatch. Launches
    repeated with tensors of one layout (decode) skip even this through a _PreparedLaunch.
    """
    options = _launch_options(num_warps, num_stages)
    if _INTERPRET or not _DIRECT_LAUNCH:
        _dispatch(kernel, grid, args, {**options, **constexprs})
        return
    values = _ordered_values(kernel, args, constexprs)
    key = _launch_key(kernel, values, tuple(options.items()))
    compiled_for = _COMPILED.setdefault(kernel, {})
    compiled = compiled_for.get(key)
    if compiled is None:
        if len(compiled_for) >= 256:  # keys that never repeat (e.g. fresh buffers of odd alignment): bounded
            compiled_for.clear()
        compiled_for[key] = _dispatch(kernel, grid, args, {**options, **constexprs})
        return
    _launch_compiled(compiled, _grid3(grid), values)


def _shares_memory(a, b):
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _byte_span(tensor):
    """[first, last + 1) bytes of the memory a tensor's elements occupy (empty for a tensor of no element)."""
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=False))
    return start, start + (last + 1) * tensor.element_size()


def _overlaps_itself(tensor):
    """Whether two elements of a tensor may share memory (a stride of 0, expand(), as_strided): its dimensions
    of more than one element, by stride, must each step past everything the smaller ones span."""
    reach = 0
    for stride, size in sorted(
        (stride, size) for stride, size in zip(tensor.stride(), tensor.shape, strict=False) if size > 1
    ):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _check_no_overlap(outputs, inputs):
    """((name, tensor or None), ...) a call writes and ((name, tensor or None), ...) it reads: no output may
    overlap itself, another output or an input in memory (the kernels would read what they wrote, or two
    results would land on the same bytes). Ranges are compared, so disjoint views of one buffer are fine."""
    for name, tensor in outputs:
        _check(
            tensor is None or not _overlaps_itself(tensor),
            name,
            "its elements overlap one another in memory (a stride of 0, expand()): give it memory of its own",
        )
    spans = [(name, tensor.device, _byte_span(tensor)) for name, tensor in (*outputs, *inputs) if tensor is not None]
    for i, (name, device, (start, end)) in enumerate(spans[: sum(t is not None for _, t in outputs)]):
        for other, other_device, (other_start, other_end) in spans[i + 1 :]:
            if device == other_device and start < other_end and other_start < end:
                raise ValueError(f"{name}: overlaps {other} in memory: give {name} memory of its own")


class _PreparedLaunch:
    """One launch with every argument resolved except the call's own tensors, for calls whose tensors have
    the layout (shape, strides, dtype, device, 16-byte alignment) of the call that prepared it.

    `inputs` are the call's tensors (None where absent): where one appears among the arguments, a later call
    puts its own there; a host TMA descriptor made from a view of one is remade for the later call's tensor
    by copying the descriptor (its checks depend on the layout only) onto the same view of it. Every other
    tensor argument must outlive the launch's owner (`owned`: a schedule's workspace). Anything else (e.g. a
    descriptor of a copy made for this call) leaves the launch not `reusable`. The first launch on a device
    goes through Triton's dispatch (which compiles or finds the kernel); later ones below it: through the
    compiled C launcher with the arguments expanded once (_RawLaunch) where the Triton release's launcher is
    one that was verified, else through the compiled kernel's launcher (_launch_compiled); never under the
    interpreter. MLAGEN_DIRECT_LAUNCH=0: never reusable, always Triton's dispatch.
    """

    __slots__ = (
        "kernel",
        "grid",
        "options",
        "values",
        "tensor_slots",
        "descriptor_slots",
        "reusable",
        "compiled",
        "device_index",
        "raw",
    )

    def __init__(self, kernel, grid, inputs, owned, args, constexprs, num_warps, num_stages=None, launch_pdl=False):
        self.kernel = kernel
        self.grid = _grid3(grid)
        self.options = _launch_options(num_warps, num_stages, launch_pdl)
        values = list(_ordered_values(kernel, args, constexprs))
        self.tensor_slots, self.descriptor_slots, self.reusable = [], [], _DIRECT_LAUNCH
        for position, value in enumerate(values if self.reusable else ()):
            if isinstance(value, torch.Tensor):
                index = next((i for i, tensor in enumerate(inputs) if tensor is value), None)
                if index is not None:
                    self.tensor_slots.append((position, index))
                    values[position] = None  # a template keeps no call's tensor alive
                elif not any(value is tensor for tensor in owned):
                    self.reusable = False
            elif hasattr(value, "block_shape"):  # a host TMA descriptor (Triton's or Gluon's)
                base = value.base
                sources = [
                    i
                    for i, tensor in enumerate(inputs)
                    if isinstance(tensor, torch.Tensor) and _shares_memory(tensor, base)
                ]
                if len(sources) != 1:  # a copy, or inputs sharing memory (later calls' might not): ambiguous
                    self.reusable = False
                    continue
                index = sources[0]
                source = inputs[index]
                offset = base.storage_offset() - source.storage_offset()
                template = object.__new__(type(value))
                template.__dict__.update(value.__dict__)
                template.base = None
                self.descriptor_slots.append((position, index, template, tuple(base.shape), base.stride(), offset))
        self.values = tuple(values)
        self.compiled = None
        self.device_index = None
        self.raw = None

    def arguments(self, inputs):
        """Every argument of the launch with `inputs` (tensors of the preparing call's layout, in its order)."""
        values = list(self.values)
        for position, index in self.tensor_slots:
            values[position] = inputs[index]
        for position, index, template, shape, strides, offset in self.descriptor_slots:
            source = inputs[index]
            descriptor = object.__new__(type(template))
            descriptor.__dict__.update(template.__dict__)
            descriptor.base = source.as_strided(shape, strides, source.storage_offset() + offset)
            values[position] = descriptor
        return values

    def launch(self, inputs):
        """Launch with `inputs` (tensors of the preparing call's layout, in its order)."""
        raw = self.raw
        if raw is not None and raw.get_device() == raw.device and not _launch_hooks():
            raw.launch_at(
                [None if tensor is None else tensor.data_ptr() for tensor in inputs], raw.get_stream(raw.device)
            )
            return
        if _INTERPRET or not _DIRECT_LAUNCH:
            _dispatch(self.kernel, self.grid, self.arguments(inputs), self.options)
            return
        device = triton.runtime.driver.active.get_current_device()
        if self.compiled is not None and device == self.device_index:
            _launch_compiled(self.compiled, self.grid, self.arguments(inputs), device)
            return
        # the compiled kernel is loaded per device: the first launch on each goes through the dispatch
        values = self.arguments(inputs)
        self.compiled = _dispatch(self.kernel, self.grid, values, self.options)
        self.device_index = device
        self.raw = _RawLaunch.prepare(self, values, inputs, device) if _RAW_LAUNCH and self.reusable else None


def _launch_hooks():
    """Whether a launch hook (e.g. Proton's) is installed: launches then go through Triton's launcher."""
    runtime = triton.knobs.runtime
    return bool(runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls)


def _launch_prepared(launches, inputs, addresses):
    """Issue a call's prepared launches in order (inputs: the call's tensors, addresses: their data_ptr()).
    Where they have raw launches on the current device and no launch hook is installed, the device, the hooks
    and the stream are read once for all of them; else each launch goes its own way (_PreparedLaunch.launch).
    """
    raw = launches[0].raw
    if raw is not None:
        device = raw.get_device()
        if device == raw.device and not _launch_hooks():
            stream = raw.get_stream(device)
            for launch in launches:
                raw = launch.raw
                if raw is not None and raw.device == device:
                    raw.launch_at(addresses, stream)
                else:
                    launch.launch(inputs)
            return
    for launch in launches:
        launch.launch(inputs)


# ---- launching below Triton's launcher ---------------------------------------------------------------

#: Triton releases whose CUDA launcher the raw launch (_RawLaunch) was written against, read in their source
#: (triton/backends/nvidia/driver.py): a CompiledKernel's `run` is a CudaLauncher whose `launch` is the C
#: function of the compiled launcher module, wrapped (where a descriptor argument is) by
#: wrap_handle_tensordesc's `inner`, which expands each descriptor (make_tensordesc_arg: a cuTensorMapEncodeTiled
#: at every launch) after the 13 base arguments. Triton 3.9's launcher is another structure (one generic C
#: function taking annotated arguments): it, and every release not listed, takes _launch_compiled.
#: MLAGEN_RAW_LAUNCH=0 turns it off.
_RAW_LAUNCH_RELEASES = ((3, 6),)
# (the switch is read first, so a wrong value is an error under every Triton release)
_RAW_LAUNCH = _env_switch("MLAGEN_RAW_LAUNCH") and _DIRECT_LAUNCH and TRITON_VERSION in _RAW_LAUNCH_RELEASES
_RAW_BASE_ARGUMENTS = (
    13  # grid x/y/z, stream, function, cooperative, pdl, 2 scratch, metadata, launch metadata, 2 hooks
)
#: encoded descriptors kept per descriptor argument, by address (e.g. each layer's cache, the calls' queries)
_RAW_DESCRIPTORS_MAX = 256


def _cuda_launcher_parts(compiled):
    """(C launch function, launcher, {argument position: descriptor metadata}, make_tensordesc_arg) of a kernel
    compiled by the CUDA backend of a release in _RAW_LAUNCH_RELEASES, read off its launcher; None where it
    is not that structure, or a launch needs more than the C function (scratch memory allocated per launch)."""
    launcher = compiled.run
    cls = type(launcher)
    if cls.__name__ != "CudaLauncher" or cls.__module__ != "triton.backends.nvidia.driver":
        return None
    if launcher.global_scratch_size or launcher.profile_scratch_size:
        return None
    namespace = cls.__init__.__globals__  # the driver module's: 3.6's names its base argument count
    if namespace.get("_BASE_ARGS_FORMAT_LEN") != _RAW_BASE_ARGUMENTS or "make_tensordesc_arg" not in namespace:
        return None
    wrapped = launcher.launch
    code = getattr(wrapped, "__code__", None)
    if code is None:  # no descriptor argument: the C function itself
        return (wrapped, launcher, {}, None) if callable(wrapped) else None
    names = ("launcher", "tensordesc_indices", "tensordesc_meta")
    if code.co_name != "inner" or not set(names) <= set(code.co_freevars) or wrapped.__globals__ is not namespace:
        return None
    cells = {name: cell.cell_contents for name, cell in zip(code.co_freevars, wrapped.__closure__, strict=False)}
    c_launch, indices, metas = (cells[name] for name in names)
    if not callable(c_launch):
        return None
    # `inner` gives the k-th descriptor argument (in argument order) the k-th metadata entry
    descriptors = {position: metas[k] for k, position in enumerate(sorted(indices))}
    return c_launch, launcher, descriptors, namespace["make_tensordesc_arg"]


class _DeviceAddress:
    """Stands in for a descriptor's base tensor where Triton's expansion reads only its address."""

    __slots__ = ("address",)

    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


class _TensorMaps(dict):
    """The encoded tensor maps of one descriptor argument of a raw launch, by address: a hit is a dict
    lookup; a miss encodes the argument's descriptor at that address by Triton's own expansion
    (make_tensordesc_arg) and keeps it, the oldest going first past _RAW_DESCRIPTORS_MAX."""

    __slots__ = ("template", "metadata", "make_tensordesc_arg")

    def __missing__(self, address):
        descriptor = object.__new__(type(self.template))
        descriptor.__dict__.update(self.template.__dict__)
        descriptor.base = _DeviceAddress(address)
        tensor_map = self.make_tensordesc_arg(descriptor, self.metadata)[0]
        if len(self) >= _RAW_DESCRIPTORS_MAX:
            del self[next(iter(self))]
        self[address] = tensor_map
        return tensor_map


class _RawLaunch:
    """A prepared launch (_PreparedLaunch) issued through the compiled C launcher with the final argument
    list built once: what Triton's CudaLauncher and its descriptor wrapper (`inner`) would expand at every
    launch (base arguments, descriptors as encoded tensor maps followed by their shape and strides) is laid
    out when the launch is prepared; a call puts in only the current stream, its tensors' addresses and its
    descriptors' tensor maps. A tensor map depends on the address alone once the slot fixes shape, strides,
    box and swizzle, so maps are encoded once per address (_TensorMaps) and kept: the cache and persistent
    buffers hit every call; a call's new address costs one encoding. Pointers go in as integers (the C
    launcher takes them as such); owned tensors (the schedule's workspace) are resolved once. Equivalent to
    Triton's launch for the releases in _RAW_LAUNCH_RELEASES, tested against its `inner`.
    """

    __slots__ = ("c_launch", "arguments", "pointer_slots", "map_slots", "get_stream", "get_device", "device")

    @staticmethod
    def prepare(prepared, values, inputs, device):
        """The raw launch of `prepared` (values: its first launch's arguments, with `inputs`), or None where the
        compiled kernel's launcher is not the verified structure."""
        try:
            parts = _cuda_launcher_parts(prepared.compiled)
            return None if parts is None else _RawLaunch(prepared, values, inputs, device, *parts)
        except (AttributeError, KeyError, TypeError, ValueError):  # unexpected structure: Triton's launcher stays
            return None

    def __init__(self, prepared, values, inputs, device, c_launch, launcher, descriptors, make_tensordesc_arg):
        compiled = prepared.compiled
        self.c_launch = c_launch
        driver = triton.runtime.driver.active
        self.get_stream = driver.get_current_stream
        # Triton 3.6 reads the device through torch.cuda.current_device (lazy CUDA initialisation, then this):
        # the launch was prepared on an initialised device, so the reading alone
        get_device = driver.get_current_device
        if get_device is torch.cuda.current_device and callable(getattr(torch._C, "_cuda_getDevice", None)):
            get_device = torch._C._cuda_getDevice
        self.get_device = get_device
        self.device = device
        grid = prepared.grid
        arguments = [
            grid[0],
            grid[1],
            grid[2],
            None,
            compiled.function,
            launcher.launch_cooperative_grid,
            launcher.launch_pdl,
            None,
            None,
            compiled.packed_metadata,
            None,
            None,
            None,
        ]
        inputs_at = dict(prepared.tensor_slots)
        descriptors_at = {slot[0]: slot for slot in prepared.descriptor_slots}
        if len(descriptors_at) != len(descriptors) or not descriptors_at.keys() <= descriptors.keys():
            raise ValueError("the launcher's descriptor arguments are not the prepared descriptors")
        self.pointer_slots, self.map_slots = [], []  # (argument position, input index, byte offset[, maps])
        for position, value in enumerate(values):
            if position in descriptors_at:
                _, index, template, _, _, _ = descriptors_at[position]
                metadata = descriptors[position]
                expanded = make_tensordesc_arg(value, metadata)
                address = value.base.data_ptr()
                offset = address - inputs[index].data_ptr()
                if metadata is None:  # lowered to a pointer: base, shape, strides, padding, shape, strides
                    self.pointer_slots.append((len(arguments), index, offset))
                else:  # the encoded tensor map, shape, strides
                    maps = _TensorMaps({address: expanded[0]})
                    maps.template, maps.metadata, maps.make_tensordesc_arg = template, metadata, make_tensordesc_arg
                    self.map_slots.append((len(arguments), index, offset, maps))
                arguments.append(None)
                arguments.extend(expanded[1:])
            elif position in inputs_at:
                self.pointer_slots.append((len(arguments), inputs_at[position], 0))
                arguments.append(None)
            elif isinstance(value, torch.Tensor):  # owned (the schedule's workspace): outlives the launch
                arguments.append(value.data_ptr())
            else:
                arguments.append(value)
        self.arguments = arguments

    def launch_at(self, addresses, stream):
        """Launch on `stream` with the call's tensors at `addresses` (data_ptr() of each input, in order)."""
        arguments = self.arguments.copy()
        arguments[3] = stream
        for position, index, offset in self.pointer_slots:
            arguments[position] = addresses[index] + offset
        for position, index, offset, maps in self.map_slots:
            arguments[position] = maps[addresses[index] + offset]
        self.c_launch(*arguments)


def _layout(tensor):
    """What a prepared launch depends on of a tensor besides its address (see _PreparedLaunch)."""
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.data_ptr() % 16 == 0


# ---- validation of index values (one device synchronisation: opt-in on the GPU) -----------------------


def _validating(validate, device):
    """validate=None: on for CPU tensors (nothing to synchronise) or when MLAGEN_VALIDATE=1, else off: then
    every index value is the caller's contract, as in FlashMLA and vLLM. True / False force it."""
    if validate is not None:
        if validate is True or validate is False:
            return validate
        raise ValueError(f"validate: expected None, True or False, got {validate!r}")
    return _VALIDATE_ALWAYS or device.type != "cuda"


def _first(bad):
    """The position of the first True of a bool tensor, or None."""
    return tuple(int(i) for i in bad.nonzero()[0]) if bool(bad.any()) else None


def _validate_range(tensor, name, low, high, what, used=None):
    """Every element of `tensor` (where `used`) is in [low, high], else a ValueError naming position and value."""
    bad = (tensor < low) | (tensor > high)
    position = _first(bad & used if used is not None else bad)
    if position is not None:
        index = ", ".join(map(str, position))
        raise ValueError(f"{name}[{index}] = {int(tensor[position])}: {what} must be in [{low}, {high}]")


def _validate_cu_seqlens(cu_seqlens, num_tokens, max_seqlen):
    """cu_seqlens starts at 0, never decreases, ends at the token count; max_seqlen covers the longest."""
    cu = cu_seqlens.long()
    _check(int(cu[0]) == 0, "cu_seqlens", f"must start at 0, got cu_seqlens[0] = {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    position = _first(lengths < 0)
    if position is not None:
        b = position[0]
        raise ValueError(
            f"cu_seqlens: must not decrease, got cu_seqlens[{b}] = {int(cu[b])} > "
            f"cu_seqlens[{b + 1}] = {int(cu[b + 1])}"
        )
    _check(
        int(cu[-1]) == num_tokens,
        "cu_seqlens",
        f"must end at the number of tokens ({num_tokens}), got cu_seqlens[-1] = {int(cu[-1])}",
    )
    longest = int(lengths.max())
    _check(max_seqlen >= longest, "max_seqlen", f"{max_seqlen} is less than the longest sequence ({longest} tokens)")


def _validate_pages(block_table, lengths, lengths_name, num_pages, page_size):
    """Each sequence's length fits its block-table row, and the pages it uses are pages of the cache."""
    capacity = block_table.shape[1] * page_size
    _validate_range(lengths, lengths_name, 0, capacity, f"a length (block_table rows hold {capacity} tokens)")
    pages_used = (lengths.long() + page_size - 1) // page_size
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_used[:, None]
    _validate_range(block_table, "block_table", 0, num_pages - 1, "a page used by its sequence", used)
