"""Runtime of the generated modules: the host-side Python that is the same for every spec.

A generated module (templates/module.py.jinja) holds its spec's kernels and what differs per spec (constants,
launch tables, tuned configurations, Gluon layouts); it imports from here the argument checks (those that read
its constants too), the launch machinery (Triton's dispatch, the direct launch of a compiled kernel, prepared
launches and the raw launch through Triton 3.6's compiled C launcher), validation of index values, device
queries, and the wrappers of its entry points: decode planning (DecodeSchedule, get_decode_schedule), the
first, fully checked decode call and the per-call path of later ones (mla_decode_prepared), the launches of
both backends (the Gluon ones' descriptors and producer choice included), prefill, chunked prefill, the
attention-state merge, the cache write, and its torch.library custom ops (register_ops).

Those wrappers take the module as their first argument, `m`, a ModuleView of its globals (the module binds
them: `bind`), and read its constants through it (m.NUM_HEADS, m.PAGE_SIZE, its kernels, ...): one body for
every spec, and a value the module holds (or a test patches into it) is the one they see. The module's own
mla_decode calls mla_decode_prepared directly, not through a bound wrapper: it is the per-call hot path.

Only torch, triton and the standard library (and launch_policy, options). The switches (`MLAGEN_*`) are
`options.options()`: the environment is read when this module is first imported (a wrong value fails the
import), and a wrapper reads the options in force when it plans or prepares a launch. Ordinary package source, tested
as Python (tests/test_prepared_launch.py, tests/test_runtime.py, and every test through the generated modules).
"""

import functools
import inspect
import itertools
import math
import os
import re
import types
import typing
import weakref

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .launch_policy import (
    DECODE_GLUON_BUCKET,
    cdiv,
    check_decode_config,
    check_prefill_config,
    combine_step_runs_for_warps,
    combine_tile,
    combine_warps,
    decode_bucket,
    decode_keep_partials,
    decode_merge,
    decode_min_blocks_per_part,
    decode_num_parts,
    decode_partials_in_dtype,
    decode_pdl,
    decode_row_block,
    decode_sequence_runs,
    decode_tile_loads,
    fp8_dots_in_float16,
    gluon_blocks,
    gluon_narrow_limit,
    gluon_narrow_rows,
    gluon_small_batch_schedule,
    next_pow2,
    select_decode_backend,
    select_prefill_backend,
    tuned_config,
)
from .options import options as _options


def triton_release():
    """The installed Triton release as (major, minor); (0, 0) where its version string is not a release."""
    release = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return (int(release.group(1)), int(release.group(2))) if release else (0, 0)


#: the installed Triton release as (major, minor), read when this module is imported
TRITON_VERSION = triton_release()

#: SM count assumed under the interpreter, so CPU runs still split the cache into several runs
INTERPRETER_SM_COUNT = 2
#: L2 cache assumed under the interpreter (an H100's)
INTERPRETER_L2_BYTES = 50 * 2**20

#: log2(e): kernels work in base 2 (qk_scale = softmax scale * log2(e))
LOG2E = 1.4426950408889634

# Under Triton's CPU interpreter bf16 dots are wrong, so operands are upcast there; the GPU path is not.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# The switches, read from the environment now: a wrong value is an error at import. Among them:
# poison_workspace (tests: a kernel reading a workspace element nobody wrote yields NaN, not stale memory),
# validate (check every index value against what it indexes, see _validating; the tests and `mlagen verify`
# set it), direct_launch (launch compiled kernels directly once Triton has dispatched an argument key, see
# _launch), raw_launch (see _raw_launch).
_options()


# ---- the device ---------------------------------------------------------------------------------------

#: (property name, device index) -> value, read once a device
_DEVICE_PROPERTIES = {}


def _device_property(device, name, interpreted):
    """torch.cuda.get_device_properties(device).<name>, read once a device; `interpreted` under the interpreter
    and off CUDA."""
    if _INTERPRET or device.type != "cuda":
        return interpreted
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (name, index)
    if key not in _DEVICE_PROPERTIES:
        _DEVICE_PROPERTIES[key] = getattr(torch.cuda.get_device_properties(index), name)
    return _DEVICE_PROPERTIES[key]


def gluon_unsupported_here(kernel, eligible, ineligible_reason, triton_versions):
    """'' when a module's Gluon `kernel` ("decode" or "prefill") can be defined under the installed Triton: its
    geometry is the plan's and this Triton is a release the kernel was verified with; else why not. The module
    defines its Gluon kernels only where this is '', so it imports anywhere."""
    if not eligible:
        return f"geometry not taken by the Gluon {kernel}: {ineligible_reason}"
    if triton_release() not in triton_versions:
        verified = ", ".join(f"{major}.{minor}" for major, minor in triton_versions)
        return f"triton {triton.__version__} is not a release the Gluon {kernel} was verified with ({verified})"
    return ""


def _device_or_default(device):
    """`device` as a torch.device; None: the current CUDA device where there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def l2_cache_bytes(device):
    """The L2 cache of a CUDA device, bytes (INTERPRETER_L2_BYTES under the interpreter)."""
    return _device_property(device, "L2_cache_size", INTERPRETER_L2_BYTES)


def _sm_count(device):
    return _device_property(device, "multi_processor_count", INTERPRETER_SM_COUNT)


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


def _check_device(device, name, *, tensors=True):
    """A device the kernels can run on: a meta tensor holds no data (the wrappers read index values); tensors
    (False: a device named for a schedule, which reads none) must be CUDA tensors unless Triton interprets the
    kernels (compiled kernels cannot read host memory)."""
    _check(
        device.type != "meta",
        name,
        "a meta tensor holds no data: the kernels need CUDA tensors (or CPU "
        "tensors under TRITON_INTERPRET=1); torch.compile's fake tensors go through the module's ops",
    )
    _check(
        not tensors or _INTERPRET or device.type == "cuda",
        name,
        f"a {device.type} tensor: the compiled kernels read CUDA tensors (CPU tensors run only under "
        "TRITON_INTERPRET=1, Triton's interpreter)",
    )


def _check_per_sequence(tensor, name, batch, device, *, ndim):
    """An int32 block table ([B, max_pages]) or per-sequence lengths ([B]) for a batch of `batch`."""
    _check_tensor(tensor, name, ndim=ndim, dtype=torch.int32, device=device)
    _check(tensor.shape[0] == batch, name, f"batch size {tensor.shape[0]} disagrees with {batch}")


_FLOAT32 = torch.finfo(torch.float32)


# ---- the checks that read a module's constants (m: see ModuleView) ---------------------------------------


def resolve_softmax_scale(m, value):
    """The module's scale (SOFTMAX_SCALE) for None, or a number given at the call with |scale| <=
    SOFTMAX_SCALE_MAX (inf / NaN, or a finite scale whose float32 multiples in the kernels overflow, would only
    make NaN outputs)."""
    if value is None:
        return m.SOFTMAX_SCALE
    _check(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        "softmax_scale",
        f"must be a finite number, got {value!r}",
    )
    _check(
        abs(value) <= m.SOFTMAX_SCALE_MAX,
        "softmax_scale",
        f"must be within [-2**64, 2**64] (the kernels' float32 scales stay finite), got {value!r}",
    )
    return float(value)


def check_paged_cache(m, kv_cache, device):
    """kv_cache [num_pages, PAGE_SIZE, 1, Dc+Dr] in the module's cache dtype (CACHE_DTYPE) on `device`."""
    width, dtype, page_size = m.KV_LORA_RANK + m.QK_ROPE_HEAD_DIM, m.CACHE_DTYPE, m.PAGE_SIZE
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype != dtype:
        raise ValueError(f"kv_cache: expected dtype {dtype} (this module's cache_dtype), got {kv_cache.dtype}")
    _check_tensor(kv_cache, "kv_cache", ndim=4, dtype=dtype, device=device, last_dim=width)
    _check(
        kv_cache.shape[1] == page_size and kv_cache.shape[2] == 1,
        "kv_cache",
        f"expected [num_pages, {page_size}, 1, {width}], got shape {tuple(kv_cache.shape)}",
    )
    _check(kv_cache.shape[0] >= 1, "kv_cache", f"expected at least one page, got shape {tuple(kv_cache.shape)}")


def _kv_scale_number(kv_scale, device):
    """An fp8 cache's kv_scale given as a number, checked (finite, > 0, within float32's normal range), as a float32
    tensor of one element on `device`."""
    if not (
        isinstance(kv_scale, (int, float))
        and not isinstance(kv_scale, bool)
        and _FLOAT32.tiny <= kv_scale <= _FLOAT32.max
    ):
        raise ValueError(
            f"kv_scale: must be a finite number > 0 within float32's normal range, or a float32 tensor of one "
            f"element, got {kv_scale!r}"
        )
    return torch.full((1,), float(kv_scale), dtype=torch.float32, device=device)


def resolve_kv_scale(m, kv_scale, device, validate=None):
    """The cache's scale as the module's kernels take it: None for a 16-bit cache (kv_scale must be None); for an
    fp8 cache (CACHE_FORMAT.scaled) a float32 tensor of one element on `device` (latent = stored * kv_scale).

    The kernels always take a pointer and load the scale on the device: one compiled kernel for every
    value and both forms, and a tensor scale never goes back to the host, so such a call can be captured
    in a CUDA graph. A number is turned into a tensor once per (device, value) (the module's
    _KV_SCALE_TENSORS). A tensor's value is checked (finite, > 0) only when validating (it costs a
    synchronisation); a number's always. Messages are formatted only on failure: this runs on every call.
    """
    if not m.CACHE_FORMAT.scaled:
        if kv_scale is not None:
            raise ValueError(
                f"kv_scale: this module's cache is {m.CACHE_DTYPE}, not scaled: kv_scale is for "
                f"float8_e4m3fn caches only, got {kv_scale!r}"
            )
        return None
    if isinstance(kv_scale, torch.Tensor):
        if not (kv_scale.dtype == torch.float32 and kv_scale.numel() == 1 and kv_scale.device == device):
            raise ValueError(
                f"kv_scale: expected a number or a float32 tensor of one element on {device}, got a "
                f"{kv_scale.dtype} tensor of shape {tuple(kv_scale.shape)} on {kv_scale.device}"
            )
        if _validating(validate, device):
            value = float(kv_scale)
            _check(
                _FLOAT32.tiny <= value <= _FLOAT32.max,
                "kv_scale",
                f"must be a finite float32 > 0 (a normal number), got {value!r}",
            )
        return kv_scale
    tensors = m._KV_SCALE_TENSORS
    tensor = tensors.get((device, kv_scale)) if type(kv_scale) is float else None
    if tensor is not None:
        return tensor
    if kv_scale is None:
        raise ValueError(
            f"kv_scale: required: this module's cache is {m.CACHE_DTYPE}, stored as fp8(latent / "
            "kv_scale); pass the layer's scale as a number or a float32 tensor of one element"
        )
    tensor = _kv_scale_number(kv_scale, device)
    # a tensor made while a CUDA graph is captured holds its value only once the graph replays: not kept
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        if len(tensors) >= m._KV_SCALE_TENSORS_MAX:
            tensors.clear()
        tensors[(device, float(kv_scale))] = tensor
    return tensor


# ---- launching -------------------------------------------------------------------------------------

#: per kernel: launch key -> the compiled kernel Triton's dispatch chose for it
_COMPILED = {}


def _int_class(value, specialized=True):
    """What Triton reads of a runtime int: equality to 1, divisibility by 16, width (i32, i64, u64); of a
    do_not_specialize one (specialized False), its width alone."""
    width = -(2**31) <= value < 2**31, value < 2**63
    return (value == 1, value % 16 == 0, *width) if specialized else width


def _launch_key(kernel, values, options):
    """Everything Triton specialises a compiled kernel on, or more (a key finer than Triton's only costs a
    dispatch more, which returns the same compiled kernel; a coarser one would launch the wrong kernel):
    tensors by dtype and 16-byte alignment; TMA descriptors (Triton's or Gluon's) by their base's dtype and
    alignment, box and shared layout (what Triton 3.6 specialises them on, with the dtype) and the sizes and
    strides of the matrix they view by what Triton reads of a runtime int (so a token count that changes every
    call does not miss); runtime floats by type; runtime ints by what Triton reads of them (_int_class; a
    do_not_specialize one by its width alone); constexprs (floats included), bools, None and layouts by value;
    plus the launch options."""
    key = []
    for value, param in zip(values, kernel.params, strict=False):
        if param.is_constexpr:  # (first: a constexpr int would otherwise reach hasattr, which raises inside)
            key.append(value)
        elif isinstance(value, torch.Tensor):
            key.append((value.dtype, value.data_ptr() % 16 == 0))
        elif type(value) is int:  # (do_not_specialize: Triton reads its width only)
            key.append((int, *_int_class(value, not param.do_not_specialize)))
        elif isinstance(value, float):
            key.append(float)
        elif hasattr(value, "block_shape"):  # a host TMA descriptor (Triton's or Gluon's)
            key.append(
                (
                    type(value),
                    value.base.dtype,
                    value.base.data_ptr() % 16 == 0,
                    tuple(map(_int_class, value.shape)),
                    tuple(map(_int_class, value.strides)),
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


def _launch(kernel, grid, *args, num_warps, num_stages=None, per_call=None, **constexprs):
    """kernel[grid](*args, **constexprs) at a fraction of its host cost. per_call: how the launch's grid and
    size-dependent ints follow from a call's tensors (see _PreparedLaunch); a recorder's (_Recorded), unused here.

    Triton's dispatch binds and specialises all arguments and looks the compiled kernel up on every
    launch (tens of microseconds of Python); here it runs on the first launch of each key (_launch_key:
    the specialisation's inputs) and later launches go to that compiled kernel through its launcher
    (_launch_compiled). The interpreter, and MLAGEN_DIRECT_LAUNCH=0, always take the dispatch. Launches
    repeated with tensors of one layout (decode) skip even this through a _PreparedLaunch.
    """
    options = _launch_options(num_warps, num_stages)
    if _INTERPRET or not _options().direct_launch:
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

    per_call: for calls whose tensors share the layout but not the size of their leading dimension (a prefill's
    token count, batch size): (function, names, tensors, max_seqlen), where function(*tensors, max_seqlen) gives
    the launch's grid (three sizes) and the values of its size-dependent int arguments `names` (the launch's own
    are what it gave for `tensors`, the preparing call's). A later call's grid and ints are that function's for
    its tensors (call_values), and every descriptor covers its source's leading rows (base, descriptor and source
    agree on them when prepared). Those ints must fall in the preparing call's classes of what Triton specialises
    an int on (_int_class), else call_values declines the call; the rows are the leading sizes of the call's
    tensors, whose classes the caller's key holds (prefill_signature, chunked_prefill_signature). Without
    per_call, grid and ints are the preparing call's.
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
        "per_call",
        "int_classes",
        "int_specialized",
    )

    def __init__(
        self, kernel, grid, inputs, owned, args, constexprs, num_warps, num_stages=None, launch_pdl=False, per_call=None
    ):
        self.kernel = kernel
        self.grid = _grid3(grid)
        self.options = _launch_options(num_warps, num_stages, launch_pdl)
        values = list(_ordered_values(kernel, args, constexprs))
        self.tensor_slots, self.descriptor_slots, self.reusable = [], [], _options().direct_launch
        self.per_call = self.int_classes = self.int_specialized = None
        sized = per_call is not None
        for position, value in enumerate(values if self.reusable else ()):
            if isinstance(value, torch.Tensor):
                index = _input_index(inputs, value)
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
                if sized and not (base.dim() and base.shape[0] == source.shape[0] == value.shape[0]):
                    self.reusable = False  # (its rows would not follow its source's)
                    continue
                offset = base.storage_offset() - source.storage_offset()
                template = object.__new__(type(value))
                template.__dict__.update(value.__dict__)
                template.base = None
                self.descriptor_slots.append((position, index, template, tuple(base.shape), base.stride(), offset))
        if sized and self.reusable:
            self._prepare_per_call(values, inputs, per_call)
        self.values = tuple(values)
        self.compiled = None
        self.device_index = None
        self.raw = None

    def _prepare_per_call(self, values, inputs, per_call):
        """Keep per_call (see the class) as (function, input index of each of its tensors, argument position of
        each int it gives), its ints' places in `values` emptied, and the classes of the preparing call's ints and
        descriptor rows; not `reusable` where a tensor is not among the inputs or the function does not give what
        the launch holds."""
        function, names, tensors, max_seqlen = per_call
        indices = tuple(None if tensor is None else _input_index(inputs, tensor) for tensor in tensors)
        if any(index is None and tensor is not None for index, tensor in zip(indices, tensors, strict=True)):
            self.reusable = False
            return
        grid, ints = function(*tensors, max_seqlen)
        positions = tuple(self.kernel.arg_names.index(name) for name in names)
        if tuple(grid) != self.grid or [values[p] for p in positions] != list(ints):
            self.reusable = False
            return
        for position in positions:
            values[position] = None
        row_sources = tuple(index for _, index, *_ in self.descriptor_slots)
        self.per_call = (function, indices, positions, row_sources)
        # (what Triton reads of each int: a do_not_specialize one, e.g. the Gluon prefill's sections, changes
        # between 1 and 2 from one batch to the next without compiling another kernel)
        params = getattr(self.kernel, "params", None)
        self.int_specialized = tuple(params is None or not params[p].do_not_specialize for p in positions)
        self.int_classes = self._int_classes(ints)

    def _int_classes(self, ints):
        return tuple(map(_int_class, ints, self.int_specialized))

    def call_values(self, inputs, max_seqlen):
        """(grid, ints, descriptor rows) of a call of this launch (its tensors `inputs`; see the class), or None
        where an int is not of the preparing call's classes (another compiled kernel)."""
        function, indices, _, row_sources = self.per_call
        grid, ints = function(*[None if index is None else inputs[index] for index in indices], max_seqlen)
        if self._int_classes(ints) != self.int_classes:
            return None
        return grid, ints, [inputs[index].shape[0] for index in row_sources]

    def arguments(self, inputs, call=None):
        """Every argument of the launch with `inputs` (tensors of the preparing call's layout, in its order; call:
        their call_values, for a launch prepared with per_call)."""
        values = list(self.values)
        for position, index in self.tensor_slots:
            values[position] = inputs[index]
        if call is not None:
            for position, value in zip(self.per_call[2], call[1], strict=True):
                values[position] = value
        for k, (position, index, template, shape, strides, offset) in enumerate(self.descriptor_slots):
            source = inputs[index]
            descriptor = object.__new__(type(template))
            descriptor.__dict__.update(template.__dict__)
            if call is not None:  # (the source's leading rows: this call's)
                rows = call[2][k]
                shape = (rows, *shape[1:])
                descriptor.shape = type(template.shape)((rows, *template.shape[1:]))
            descriptor.base = source.as_strided(shape, strides, source.storage_offset() + offset)
            values[position] = descriptor
        return values

    def launch(self, inputs, call=None):
        """Launch with `inputs` (tensors of the preparing call's layout, in its order; call: their call_values,
        for a launch prepared with per_call)."""
        grid = self.grid if call is None else call[0]
        raw = self.raw
        if raw is not None and raw.get_device() == raw.device and not _launch_hooks():
            raw.launch_at(
                [None if tensor is None else tensor.data_ptr() for tensor in inputs], raw.get_stream(raw.device), call
            )
            return
        if _INTERPRET or not _options().direct_launch:
            _dispatch(self.kernel, grid, self.arguments(inputs, call), self.options)
            return
        device = triton.runtime.driver.active.get_current_device()
        if self.compiled is not None and device == self.device_index:
            _launch_compiled(self.compiled, grid, self.arguments(inputs, call), device)
            return
        # the compiled kernel is loaded per device: the first launch on each goes through the dispatch
        values = self.arguments(inputs, call)
        self.compiled = _dispatch(self.kernel, grid, values, self.options)
        self.device_index = device
        self.raw = _RawLaunch.prepare(self, values, inputs, device) if _raw_launch() and self.reusable else None


def _input_index(inputs, tensor):
    """The position of `tensor` (itself, not an equal one) among a call's inputs, or None."""
    return next((i for i, value in enumerate(inputs) if value is tensor), None)


def _launch_hooks():
    """Whether a launch hook (e.g. Proton's) is installed: launches then go through Triton's launcher."""
    runtime = triton.knobs.runtime
    return bool(runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls)


def _launch_prepared(launches, inputs, addresses, calls=None):
    """Issue a call's prepared launches in order (inputs: the call's tensors, addresses: their data_ptr(); calls:
    each launch's call_values, for launches prepared with per_call). Where they have raw launches on the current
    device and no launch hook is installed, the device, the hooks and the stream are read once for all of them;
    else each launch goes its own way (_PreparedLaunch.launch).
    """
    if calls is None:
        calls = (None,) * len(launches)
    raw = launches[0].raw
    if raw is not None:
        device = raw.get_device()
        if device == raw.device and not _launch_hooks():
            stream = raw.get_stream(device)
            for launch, call in zip(launches, calls, strict=True):
                raw = launch.raw
                if raw is not None and raw.device == device:
                    raw.launch_at(addresses, stream, call)
                else:
                    launch.launch(inputs, call)
            return
    for launch, call in zip(launches, calls, strict=True):
        launch.launch(inputs, call)


class _Recorded(list):
    """Stands in for _launch in a checked call whose launches may be prepared for later calls of its layout: each
    launch goes through _launch and is kept (its arguments, and per_call: how its grid and size-dependent ints
    follow from a call's tensors); prepare() makes them _PreparedLaunch of the call."""

    def __call__(self, kernel, grid, *args, num_warps, num_stages=None, per_call=None, **constexprs):
        _launch(kernel, grid, *args, num_warps=num_warps, num_stages=num_stages, **constexprs)
        self.append((kernel, grid, args, constexprs, num_warps, num_stages, per_call))

    def prepare(self, inputs):
        """The launches as _PreparedLaunch of the call's `inputs` (nothing owned) for calls of any token count, or
        None where one is not reusable (a launch without per_call included: its grid would be this call's)."""
        launches = [
            _PreparedLaunch(kernel, grid, inputs, (), args, constexprs, num_warps, num_stages, per_call=per_call)
            for kernel, grid, args, constexprs, num_warps, num_stages, per_call in self
        ]
        return launches if all(launch.reusable and launch.per_call for launch in launches) else None


def layout_signature(tensors, addresses):
    """The layouts of a call's tensors (None where absent; addresses: their data_ptr()): shape, strides, dtype,
    device and address modulo 16 of each (_layout, the address read once; what a _PreparedLaunch depends on of
    them). decode_signature writes its out flat: the decode's per-call path is the shorter one."""
    return tuple(
        [
            None if tensor is None else (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, address & 15)
            for tensor, address in zip(tensors, addresses, strict=True)
        ]
    )


# ---- launching below Triton's launcher ---------------------------------------------------------------

#: Triton releases whose CUDA launcher the raw launch (_RawLaunch) was written against, read in their source
#: (triton/backends/nvidia/driver.py): a CompiledKernel's `run` is a CudaLauncher whose `launch` is the C
#: function of the compiled launcher module, wrapped (where a descriptor argument is) by
#: wrap_handle_tensordesc's `inner`, which expands each descriptor (make_tensordesc_arg: a cuTensorMapEncodeTiled
#: at every launch) after the 13 base arguments. Triton 3.9's launcher is another structure (one generic C
#: function taking annotated arguments): it, and every release not listed, takes _launch_compiled.
#: MLAGEN_RAW_LAUNCH=0 turns it off.
_RAW_LAUNCH_RELEASES = ((3, 6),)


def _raw_launch():
    """Whether launches prepared now go through the raw launch (the raw_launch and direct_launch options on,
    a Triton release it was written for)."""
    chosen = _options()
    return chosen.raw_launch and chosen.direct_launch and TRITON_VERSION in _RAW_LAUNCH_RELEASES


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


class _SizedExpansions(dict):
    """The expanded arguments of one descriptor argument of a raw launch prepared with per_call (its rows follow
    its source's), by (address, rows): Triton's own expansion (make_tensordesc_arg: the encoded tensor map, or
    the address of a descriptor lowered to a pointer, then shape and strides) of the slot's descriptor at that
    address with that many rows, kept; the oldest goes first past _RAW_DESCRIPTORS_MAX."""

    __slots__ = ("template", "metadata", "make_tensordesc_arg")

    def __missing__(self, key):
        address, rows = key
        descriptor = object.__new__(type(self.template))
        descriptor.__dict__.update(self.template.__dict__)
        descriptor.base = _DeviceAddress(address)
        descriptor.shape = type(self.template.shape)((rows, *self.template.shape[1:]))
        expansion = self.make_tensordesc_arg(descriptor, self.metadata)
        if self.metadata is None:  # lowered to a pointer: the C launcher takes the address
            expansion[0] = address
        if len(self) >= _RAW_DESCRIPTORS_MAX:
            del self[next(iter(self))]
        self[key] = expansion
        return expansion


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

    A launch prepared with per_call also takes each call's grid and ints (call_values) and expands its
    descriptors at the call's rows: per (address, rows) (_SizedExpansions).
    """

    __slots__ = (
        "c_launch",
        "arguments",
        "pointer_slots",
        "map_slots",
        "int_slots",
        "sized_slots",
        "get_stream",
        "get_device",
        "device",
    )

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
        descriptors_at = {slot[0]: (k, slot) for k, slot in enumerate(prepared.descriptor_slots)}
        if len(descriptors_at) != len(descriptors) or not descriptors_at.keys() <= descriptors.keys():
            raise ValueError("the launcher's descriptor arguments are not the prepared descriptors")
        self.pointer_slots, self.map_slots = [], []  # (argument position, input index, byte offset[, maps])
        # per_call's: the argument position of each int; (argument position, input index, byte offset,
        # expansions, descriptor slot) of each descriptor
        sized_positions = set(prepared.per_call[2]) if prepared.per_call else ()
        int_at, self.sized_slots = {}, []
        for position, value in enumerate(values):
            if position in descriptors_at:
                k, (_, index, template, _, _, _) = descriptors_at[position]
                metadata = descriptors[position]
                expanded = make_tensordesc_arg(value, metadata)
                address = value.base.data_ptr()
                offset = address - inputs[index].data_ptr()
                if prepared.per_call:  # (rows of the call's: expanded whole, per address and rows)
                    expansions = _SizedExpansions()
                    expansions.template, expansions.metadata = template, metadata
                    expansions.make_tensordesc_arg = make_tensordesc_arg
                    self.sized_slots.append((len(arguments), index, offset, expansions, k))
                    arguments.extend([None] * len(expanded))
                    continue
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
                if position in sized_positions:
                    int_at[position] = len(arguments)
                arguments.append(value)
        self.int_slots = tuple(int_at[position] for position in prepared.per_call[2]) if prepared.per_call else ()
        self.arguments = arguments

    def launch_at(self, addresses, stream, call=None):
        """Launch on `stream` with the call's tensors at `addresses` (data_ptr() of each input, in order; call:
        their call_values, for a launch prepared with per_call)."""
        arguments = self.arguments.copy()
        arguments[3] = stream
        for position, index, offset in self.pointer_slots:
            arguments[position] = addresses[index] + offset
        for position, index, offset, maps in self.map_slots:
            arguments[position] = maps[addresses[index] + offset]
        if call is not None:
            grid, ints, rows = call
            arguments[0], arguments[1], arguments[2] = grid
            for position, value in zip(self.int_slots, ints, strict=True):
                arguments[position] = value
            for position, index, offset, expansions, k in self.sized_slots:
                expansion = expansions[(addresses[index] + offset, rows[k])]
                arguments[position : position + len(expansion)] = expansion
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
    return _options().validate or device.type != "cuda"


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


def _validate_cu_seqlens(cu_seqlens, num_tokens, max_seqlen, name="cu_seqlens", total="the number of tokens"):
    """cu_seqlens (named `name`) starts at 0, never decreases, ends at the token count (`total` in the message);
    max_seqlen (None: not checked) covers the longest. Returns the sequences' lengths (int64)."""
    cu = cu_seqlens.long()
    _check(int(cu[0]) == 0, name, f"must start at 0, got {name}[0] = {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    position = _first(lengths < 0)
    if position is not None:
        b = position[0]
        raise ValueError(
            f"{name}: must not decrease, got {name}[{b}] = {int(cu[b])} > {name}[{b + 1}] = {int(cu[b + 1])}"
        )
    _check(int(cu[-1]) == num_tokens, name, f"must end at {total} ({num_tokens}), got {name}[-1] = {int(cu[-1])}")
    if max_seqlen is not None:
        longest = int(lengths.max())
        _check(
            max_seqlen >= longest, "max_seqlen", f"{max_seqlen} is less than the longest sequence ({longest} tokens)"
        )
    return lengths


def _validate_pages(block_table, lengths, lengths_name, num_pages, page_size):
    """Each sequence's length fits its block-table row, and the pages it uses are pages of the cache."""
    capacity = block_table.shape[1] * page_size
    _validate_range(lengths, lengths_name, 0, capacity, f"a length (block_table rows hold {capacity} tokens)")
    pages_used = (lengths.long() + page_size - 1) // page_size
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_used[:, None]
    _validate_range(block_table, "block_table", 0, num_pages - 1, "a page used by its sequence", used)


# ---- a generated module, as the wrappers below see it ----------------------------------------------------


class ModuleView:
    """A generated module's globals as attributes: `ModuleView(globals())` shares the module's own dict, so a
    wrapper reading m.NUM_HEADS reads what the module holds now (a value a test patches in included)."""

    def __init__(self, namespace):
        self.__dict__ = namespace


def bind(m, function):
    """`function(m, ...)` as an entry point of the module `m` (a ModuleView): same name, docstring and signature
    (less `m`), its __module__ the module's."""

    def bound(*args, **kwargs):
        return function(m, *args, **kwargs)

    functools.update_wrapper(bound, function)
    signature = inspect.signature(function)
    bound.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
    bound.__module__ = m.__name__
    del bound.__wrapped__  # help() and inspect show the bound signature, not the runtime function's
    return bound


#: the ops' annotations in typing's spelling, the one torch.library's schema inference knows in every torch
#: release mlagen supports
_OPTIONAL_FLOAT = typing.Optional[float]  # noqa: UP045
_OPTIONAL_BOOL = typing.Optional[bool]  # noqa: UP045
_OPTIONAL_TENSOR = typing.Optional[torch.Tensor]  # noqa: UP045
_OPTIONAL_INTS = typing.Optional[typing.List[int]]  # noqa: UP006, UP045
_TWO_TENSORS = typing.Tuple[torch.Tensor, torch.Tensor]  # noqa: UP006


def register_op(namespace, name, impl, fake, mutates_args=()):
    """The torch.library custom op namespace::name running `impl` (fake implementation `fake`), registered once
    per process: a module imported again keeps the ops of its first import (torch.library.custom_op would
    silently replace them)."""
    ops = getattr(torch.ops, namespace)
    if not hasattr(ops, name):
        torch.library.custom_op(f"{namespace}::{name}", impl, mutates_args=mutates_args).register_fake(fake)
    return getattr(ops, name)


# ---- the entry points while torch.compile traces them ---------------------------------------------------
#
# A tracer (torch.compile, torch.export) may not look into the plain entry points (they read tensor metadata,
# build TMA descriptors, launch Triton kernels). While one traces (torch.compiler.is_compiling()), each entry
# point is called as the module's torch.library op instead (ops.py.jinja): the graph records the op, whose
# implementation runs the same entry point when the graph runs, outside tracing. Eager calls never reach here.

#: torch.compiler.is_compiling, bound once: every entry point asks it first (a tracer reads it as True)
compiling = torch.compiler.is_compiling

#: DecodeSchedule handles: a traced graph keeps a schedule's int handle (a schedule cannot be an op's
#: argument), and the decode op finds the schedule by it; weak, so a schedule lives as long as its caller keeps it
_SCHEDULE_HANDLES = itertools.count()
_SCHEDULES = weakref.WeakValueDictionary()


def schedule_of_handle(handle):
    """The DecodeSchedule whose handle a traced graph kept (-1: none, mla_decode plans its own)."""
    if handle < 0:
        return None
    schedule = _SCHEDULES.get(handle)
    if schedule is None:
        raise ValueError(
            "schedule: the DecodeSchedule this compiled graph was traced with no longer exists: keep it alive "
            "while the compiled function runs"
        )
    return schedule


def _op_kv_scale(m, kv_scale, device):
    """kv_scale as the ops take it: a tensor unchanged (the op's call checks it), a number as a float32 tensor of
    one element made in the graph (checked here, as a plain call checks a number); a 16-bit cache's None, or the
    plain call's one-line error."""
    if isinstance(kv_scale, torch.Tensor):
        return kv_scale
    if not m.CACHE_FORMAT.scaled or kv_scale is None:
        return resolve_kv_scale(m, kv_scale, device)
    return _kv_scale_number(kv_scale, device)


def _op_outputs(result, out, lse, return_lse):
    """An op's (out, lse) as the plain call returns them: copied into the caller's out= / lse= where given."""
    results = list(result)
    for i, (given, name) in enumerate(((out, "out"), (lse, "lse"))):
        if given is None:
            continue
        value = results[i]
        if not (isinstance(given, torch.Tensor) and given.shape == value.shape and given.dtype == value.dtype):
            raise ValueError(f"{name}: expected a {value.dtype} tensor of shape {tuple(value.shape)}")
        given.copy_(value)
        results[i] = given
    return tuple(results) if return_lse else results[0]


def mla_decode_traced(
    m, q, kv_cache, block_table, cache_seqlens, softmax_scale, kv_scale, return_lse, schedule, out, lse, validate,
    causal, empty_lse,
):  # fmt: skip
    """mla_decode while a tracer runs it: the module's decode op. A schedule goes in as its handle (an int the
    graph keeps, and guards on): the compiled call runs on that schedule, which must outlive the graph."""
    handle = -1
    if schedule is not None:
        handle = getattr(schedule, "_handle", None)
        if handle is None:
            raise ValueError("schedule: expected a DecodeSchedule from this module's get_decode_schedule")
    empty = empty_lse if isinstance(empty_lse, (int, float)) and not isinstance(empty_lse, bool) else None
    if empty is None or abs(empty) != math.inf:
        raise ValueError(f"empty_lse: must be -math.inf or math.inf, got {empty_lse!r}")
    result = m.ops.decode(
        q,
        kv_cache,
        block_table,
        cache_seqlens,
        softmax_scale,
        _op_kv_scale(m, kv_scale, q.device),
        causal,
        validate,
        float(empty),
        handle,
    )
    return _op_outputs(result, out, lse, return_lse)


def _op_config(config):
    """A prefill config as the ops take it: a list of ints (checked by the op's call), or None."""
    return None if config is None else [*config]


def mla_prefill_traced(m, q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale, return_lse, out, lse, config,
                       validate):  # fmt: skip
    """mla_prefill while a tracer runs it: the module's prefill op."""
    result = m.ops.prefill(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale, _op_config(config), validate)
    return _op_outputs(result, out, lse, return_lse)


def mla_chunked_prefill_traced(
    m, q, k_nope, k_pe, v, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens, w_uk, w_uv, softmax_scale,
    kv_scale, return_lse, out, lse, config, validate, num_prefix_tokens,
):  # fmt: skip
    """mla_chunked_prefill while a tracer runs it: the module's chunked_prefill op, which takes the prefix
    total as a host int (reading it from prefix_lens would synchronise, which a graph cannot)."""
    if num_prefix_tokens is None:
        raise ValueError("num_prefix_tokens: required under torch.compile (sum(prefix_lens) as a host int)")
    result = m.ops.chunked_prefill(
        q, k_nope, k_pe, v, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens, w_uk, w_uv, num_prefix_tokens,
        softmax_scale, _op_kv_scale(m, kv_scale, q.device), _op_config(config), validate,
    )  # fmt: skip
    return _op_outputs(result, out, lse, return_lse)


def register_ops(m, kinds):
    """The module's entry points as torch.library custom ops in its namespace (m.OPS_NAMESPACE), as
    `m.ops`: cache_write, and decode, prefill and chunked_prefill where the module has those kinds (README,
    "Custom ops"). Each op runs the module's plain function unchanged; its fake gives the outputs' shapes and
    dtypes without launching anything. A namespace already holding the ops (the same file imported twice) keeps
    them: register_op."""

    # fmt: off
    def cache_write_op(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       kv_scale: _OPTIONAL_TENSOR = None, validate: _OPTIONAL_BOOL = None) -> None:
        m.mla_cache_write(c_kv, k_pe, kv_cache, slot_mapping, kv_scale=kv_scale, validate=validate)

    def cache_write_fake(c_kv, k_pe, kv_cache, slot_mapping, kv_scale=None, validate=None):
        return None

    # The decode op plans nothing itself: a call without schedule= reuses mla_decode's schedule for its batch
    # shape, device and stream (planning reads no device memory; the schedule owns the workspace). A captured
    # CUDA graph keeps the schedule it was captured with, as with an explicit schedule=.
    def decode_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                  softmax_scale: _OPTIONAL_FLOAT = None, kv_scale: _OPTIONAL_TENSOR = None, causal: bool = True,
                  validate: _OPTIONAL_BOOL = None, empty_lse: _OPTIONAL_FLOAT = None,
                  schedule: int = -1) -> _TWO_TENSORS:
        return m.mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale, kv_scale=kv_scale,
                            return_lse=True, causal=causal, validate=validate,
                            empty_lse=-math.inf if empty_lse is None else empty_lse,
                            schedule=schedule_of_handle(schedule))

    def decode_fake(q, kv_cache, block_table, cache_seqlens, softmax_scale=None, kv_scale=None, causal=True,
                    validate=None, empty_lse=None, schedule=-1):
        batch, seqlen_q = q.shape[0], q.shape[1]
        return (q.new_empty((batch, seqlen_q, m.NUM_HEADS, m.KV_LORA_RANK), dtype=m.DTYPE),
                q.new_empty((batch, m.NUM_HEADS, seqlen_q), dtype=torch.float32))

    def prefill_op(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                   cu_seqlens: torch.Tensor, max_seqlen: int, softmax_scale: _OPTIONAL_FLOAT = None,
                   config: _OPTIONAL_INTS = None, validate: _OPTIONAL_BOOL = None) -> _TWO_TENSORS:
        return m.mla_prefill(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale=softmax_scale,
                             return_lse=True, config=config, validate=validate)

    def prefill_fake(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale=None, config=None, validate=None):
        return mha_outputs_fake(q)

    def chunked_prefill_op(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                           cu_seqlens: torch.Tensor, max_seqlen: int, kv_cache: torch.Tensor,
                           block_table: torch.Tensor, prefix_lens: torch.Tensor, w_uk: torch.Tensor,
                           w_uv: torch.Tensor, num_prefix_tokens: int, softmax_scale: _OPTIONAL_FLOAT = None,
                           kv_scale: _OPTIONAL_TENSOR = None, config: _OPTIONAL_INTS = None,
                           validate: _OPTIONAL_BOOL = None) -> _TWO_TENSORS:
        return m.mla_chunked_prefill(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens,
                                     w_uk, w_uv, softmax_scale=softmax_scale, kv_scale=kv_scale, return_lse=True,
                                     config=config, validate=validate, num_prefix_tokens=num_prefix_tokens)

    def chunked_prefill_fake(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens, w_uk,
                             w_uv, num_prefix_tokens, softmax_scale=None, kv_scale=None, config=None, validate=None):
        return mha_outputs_fake(q)

    def mha_outputs_fake(q):
        """out [T, H, Dv] in the spec dtype, lse [H, T] float32."""
        num_tokens = q.shape[0]
        return (q.new_empty((num_tokens, m.NUM_HEADS, m.V_HEAD_DIM), dtype=m.DTYPE),
                q.new_empty((m.NUM_HEADS, num_tokens), dtype=torch.float32))
    # fmt: on

    register = functools.partial(register_op, m.OPS_NAMESPACE)
    ops = types.SimpleNamespace(
        namespace=m.OPS_NAMESPACE,
        cache_write=register("cache_write", cache_write_op, cache_write_fake, mutates_args=("kv_cache",)),
    )
    if "decode" in kinds:
        ops.decode = register("decode", decode_op, decode_fake)
    if "prefill" in kinds:
        ops.prefill = register("prefill", prefill_op, prefill_fake)
        ops.chunked_prefill = register("chunked_prefill", chunked_prefill_op, chunked_prefill_fake)
    return ops


# ---- decode: backend, schedule, the checked first call and its launches ---------------------------------

#: L2 eviction policies of split sequences' partial rows, (the split kernels' stores, the combine's loads), by
#: DecodeSchedule.keep_partials: kept in L2 until the combine reads them (then dead), or Triton's default
_PARTIAL_EVICTION = {True: ("evict_last", "evict_first"), False: ("", "")}


def _decode_output_strides(out, lse, o_part):
    """The strides of a decode call's outputs, the last of every decode kernel's (the portable and Gluon split
    kernels', the combine's) positional arguments, in their order: out [B, Sq, H, Dc] by batch, query and head;
    lse [B, H, Sq] by batch and head; the partial rows o_part (see DecodeSchedule.workspace) by slot and row."""
    return (
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        o_part.stride(0),
        o_part.stride(1),
    )


def decode_backend(m, device=None, requested=None, *, knobs_given=False, total_rows=None):
    """(backend, reason) for decode launches on `device` (default: the current CUDA device, else CPU);
    requested defaults to the decode_backend option ($MLAGEN_DECODE_BACKEND, else "auto"). The decision is
    select_decode_backend's (launch policy); this gathers the facts it decides on."""
    device = _device_or_default(device)
    name = "backend" if requested is not None else "MLAGEN_DECODE_BACKEND"
    if requested is None:
        requested = _options().decode_backend
    capability = m._gpu_capability(device) if requested != "triton" and not m._GLUON_IMPORT_ERROR else None
    return select_decode_backend(
        requested,
        eligible=m.DECODE_GLUON_ELIGIBLE,
        ineligible_reason=m.DECODE_GLUON_INELIGIBLE_REASON,
        gluon_error=m._GLUON_IMPORT_ERROR,
        interpreting=m._INTERPRET,
        capability=capability,
        knobs_given=knobs_given,
        total_rows=total_rows,
        latency_rows=m.DECODE_SMALL_BLOCK_M,
        name=name,
    )


class DecodeSchedule:
    """What one decode launch needs besides the tensors: computed on the host from shapes only. Each generated
    module subclasses it (its `DecodeSchedule`, whose `_module` is the module's ModuleView).

    Like FlashMLA's metadata it depends on the batch shape, not on the data, so compute it once per
    batch shape and pass it to every layer's call; nothing here reads device memory, so a call that
    receives it can be captured in a CUDA graph. Immutable, and only this module's mla_decode takes it
    (it names the spec it was planned for).

    It also owns the launch's workspace (partial rows of split sequences, float32 or the output's dtype as
    partial_dtype says, and the merge counters),
    allocated on a device's first call and reused by every later one, so calls allocate nothing and a
    captured graph sees fixed buffers: make the first call (a warm-up) before capture. Calls that share
    a schedule share its workspace: issue them on one stream (as the layers of a model step are), or give
    each concurrent stream its own schedule.
    """

    __slots__ = (
        "spec_hash",
        "batch_size",
        "seqlen_q",
        "backend",
        "backend_reason",
        "block_m",
        "row_blocks",
        "num_parts",
        "min_blocks_per_part",
        "sequence_runs",
        "narrow",
        "land_slots",
        "fp8_compute",
        "fp8_compute_reason",
        "partial_dtype",
        "keep_partials",
        "block_b",
        "config",
        "merge",
        "pdl",
        "combine_tile",
        "combine_runs",
        "combine_grid",
        "combine_warps",
        "_workspaces",
        "_lse_scratch",
        "_launches",
        "_out_layout",
        "_lse_layout",
        "_handle",
        "_frozen",
        "__weakref__",
    )

    def __init__(
        self,
        batch_size,
        seqlen_q,
        block_m,
        num_parts,
        min_blocks_per_part,
        config,
        sm_count,
        backend="triton",
        backend_reason="",
        merge="fused",
        pdl=False,
        sequence_runs=False,
        narrow=0,
        partial_dtype=torch.float32,
        keep_partials=False,
        land_slots=1,
        fp8_compute=False,
        fp8_compute_reason="",
    ):
        m = self._module
        rows = seqlen_q * m.NUM_HEADS if type(seqlen_q) is int else None
        # the narrow form's width: the kernels compute exactly its N query rows (fewer than Sq * H: rows not computed)
        _check(
            narrow == 0 or (narrow in (16, 32) and backend == "gluon" and rows is not None and rows <= narrow),
            "narrow",
            f"0, or 16 or 32 for a Gluon schedule of at most that many query rows (Sq * H), got narrow={narrow!r},"
            f" backend={backend!r}, Sq * H = {rows} (use get_decode_schedule)",
        )
        _check(
            not fp8_compute
            or (
                getattr(m, "DECODE_GLUON_FP8_COMPUTE", False)
                and backend == "gluon"
                and 0 < narrow <= m.DECODE_GLUON_NARROW_ROWS
            ),
            "fp8_compute",
            f"True only for a Gluon schedule in the narrow form at most {m.DECODE_GLUON_NARROW_ROWS} wide"
            f" (0 < narrow <= {m.DECODE_GLUON_NARROW_ROWS}) of a module with cache_compute fp8's products, got"
            f" backend={backend!r}, narrow={narrow!r} (use get_decode_schedule)",
        )
        self.spec_hash = m.SPEC_HASH
        self.batch_size = batch_size
        self.seqlen_q = seqlen_q
        #: "gluon" (warp-specialised Hopper kernel) or "triton" (portable); backend_reason: why not gluon
        self.backend = backend
        self.backend_reason = backend_reason
        self.block_m = block_m
        self.row_blocks = cdiv(seqlen_q * m.NUM_HEADS, block_m)
        self.num_parts = num_parts
        self.min_blocks_per_part = min_blocks_per_part
        #: no run crosses a sequence's end (see _split_schedule and decode_sequence_runs)
        self.sequence_runs = sequence_runs
        #: the Gluon kernel's narrow form: N, the query rows its MMAs take as their N (see gluon_narrow_rows);
        #: 0 where rows are the MMAs' M, and for the portable kernel
        self.narrow = narrow
        #: (Gluon, fp8 cache, the landing producer) blocks landing at a time: more than 1, a ring of its own beside
        #: the query tile (see gluon_land_ring)
        self.land_slots = land_slots
        #: (Gluon, cache_compute fp8) the launch multiplies e4m3 operands (_mla_decode_gluon_fp8_kernel) where TMA
        #: boxes the cache's blocks (else the exact kernel); see gluon_fp8_compute
        self.fp8_compute = fp8_compute
        #: (cache_compute fp8) why this schedule takes the exact path ('' where it takes the products, and for a
        #: module without them)
        self.fp8_compute_reason = fp8_compute_reason
        #: dtype of the workspace's partial rows: float32, or the output's dtype (see decode_partials_in_dtype)
        self.partial_dtype = partial_dtype
        #: the split kernels store partial rows L2 evict-last and the combine reads them evict-first (see
        #: decode_keep_partials)
        self.keep_partials = keep_partials
        self.block_b = max(16, next_pow2(batch_size))
        self.config = config
        #: "fused": split sequences are merged by their runs in the one launch; "kernel": by a second launch
        self.merge = merge
        #: the combine launch is a programmatic dependent launch of the split launch (see decode_pdl)
        self.pdl = pdl
        self.combine_tile, tile_runs = combine_tile(
            batch_size,
            seqlen_q * m.NUM_HEADS,
            m.KV_LORA_RANK,
            sm_count,
            m.DECODE_COMBINE_TILES,
            m.DECODE_SMALL_BATCH,
            num_parts,
        )
        #: the combine launch's grid (batch, row tiles, column tiles), warps a program (see combine_warps) and
        #: runs merged a step (see combine_step_runs_for_warps)
        tile_rows, tile_cols = self.combine_tile
        self.combine_grid = (batch_size, cdiv(seqlen_q * m.NUM_HEADS, tile_rows), cdiv(m.KV_LORA_RANK, tile_cols))
        programs = math.prod(self.combine_grid)
        self.combine_warps = combine_warps(self.combine_tile, programs, sm_count)
        self.combine_runs = combine_step_runs_for_warps(
            tile_runs, self.combine_tile, self.combine_warps, programs, sm_count
        )
        self._workspaces = {}
        self._lse_scratch = {}
        #: (shape, strides) of a call's out [B, Sq, H, Dc] and lse [B, H, Sq], contiguous, when the call allocates them
        self._out_layout = (
            (batch_size, seqlen_q, m.NUM_HEADS, m.KV_LORA_RANK),
            (seqlen_q * m.NUM_HEADS * m.KV_LORA_RANK, m.NUM_HEADS * m.KV_LORA_RANK, m.KV_LORA_RANK, 1),
        )
        self._lse_layout = ((batch_size, m.NUM_HEADS, seqlen_q), (m.NUM_HEADS * seqlen_q, seqlen_q, 1))
        #: call signature (decode_signature) -> the call's launches, prepared by its first call
        self._launches = {}
        #: the int a traced graph keeps for this schedule (see mla_decode_traced)
        self._handle = next(_SCHEDULE_HANDLES)
        _SCHEDULES[self._handle] = self
        self._frozen = True

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"DecodeSchedule is immutable (setting {name}): plan another with get_decode_schedule")
        object.__setattr__(self, name, value)

    def workspace(self, device):
        """(o_part, lse_part, counters) on `device`: one slot per (sequence, run) piece, at most num_parts +
        batch of them, and the fused merge's arrival counters (zero between calls: the last arrival resets)."""
        device = torch.device(device)
        buffers = self._workspaces.get(device)
        if buffers is None:
            m = self._module
            rows = self.seqlen_q * m.NUM_HEADS
            slots = self.num_parts + self.batch_size
            buffers = (
                torch.empty((slots, rows, m.KV_LORA_RANK), dtype=self.partial_dtype, device=device),
                torch.empty((slots, rows), dtype=torch.float32, device=device),
                torch.zeros((slots, self.row_blocks, m.DECODE_MERGE_LEVELS), dtype=torch.int32, device=device),
            )
            self._workspaces[device] = buffers
        if _options().poison_workspace:
            buffers[0].fill_(float("nan"))
            buffers[1].fill_(float("nan"))
        return buffers

    def _lse_rows(self, device):
        """float32 [B, H, Sq] rows on `device` for the LSE of calls that neither give nor return one: the kernels
        only store there, so calls (on the schedule's one stream) share them instead of allocating."""
        rows = self._lse_scratch.get(device)
        if rows is None:
            rows = self._lse_scratch[device] = torch.empty(
                (self.batch_size, self._module.NUM_HEADS, self.seqlen_q), dtype=torch.float32, device=device
            )
        return rows

    def __repr__(self):
        return (
            f"DecodeSchedule(batch_size={self.batch_size}, seqlen_q={self.seqlen_q}, backend={self.backend!r}, "
            f"block_m={self.block_m}, "
            f"num_parts={self.num_parts}, min_blocks_per_part={self.min_blocks_per_part}, "
            f"sequence_runs={self.sequence_runs}, narrow={self.narrow}, land_slots={self.land_slots}, "
            f"fp8_compute={self.fp8_compute}, fp8_compute_reason={self.fp8_compute_reason!r}, "
            f"partial_dtype={self.partial_dtype}, "
            f"keep_partials={self.keep_partials}, "
            f"config={self.config}, merge={self.merge!r}, pdl={self.pdl})"
        )


def get_decode_schedule(
    m,
    batch_size,
    seqlen_q=1,
    device=None,
    *,
    num_parts=None,
    config=None,
    min_blocks_per_part=None,
    block_m=None,
    backend=None,
    merge=None,
    pdl=None,
    tuned=None,
):
    """Plan a decode launch: backend, rows per program, split-KV runs and tile configuration.

    num_parts: how many runs the batch's cache blocks are cut into at most (default: from the SM count).
    config: (block_n, num_warps, num_stages) to force a tile configuration of the portable kernel; with
        backend="gluon", (block_n, registers of the second warpgroup, num_stages) of DECODE_GLUON_SPACE, streamed
        as given (no fp8 landing ring, short or long blocks: see tuned for a candidate of the tuned entry).
    min_blocks_per_part: fewest cache blocks per run (default: the plan's cost rule).
    block_m: query rows per program of the portable kernel, one of DECODE_SPACE's keys (default: H * Sq,
        clamped).
    backend: "auto", "gluon" or "triton" (default: $MLAGEN_DECODE_BACKEND, else "auto"); "auto" takes the
        Gluon kernel where it can run (see decode_backend) unless config or block_m, the portable kernel's
        knobs, are given, or the whole batch has at most 16 query rows (B * H * Sq).
    merge: "fused" (split sequences merged by their own runs: one launch), "kernel" (a second, combine
        launch) or "auto" (fused on the Gluon backend where sequences average at most about five runs, see
        decode_merge); default:
        $MLAGEN_DECODE_MERGE, else "auto".
    pdl: whether a combine launch is a programmatic dependent launch of the split launch (Hopper and later;
        see decode_pdl); default: where it can run, unless MLAGEN_DECODE_PDL=0.
    tuned: a configuration standing for the tuned entry (DECODE_TUNED) of the launch's bucket, of the same form
        as config: what `mlagen tune` checks and times each candidate with. It is taken where the tuned entry
        (or, under the interpreter and off CUDA, the portable kernel's interpreter configuration) would be, and
        is not a knob: the schedule is the one a call without config plans with that entry shipped. On the
        Gluon backend the fp8 landing ring, the short and the long blocks then still apply (gluon_blocks), where
        config forces exactly its tile with none of them. Not with config; name the bucket's backend too.
    """
    _check_host_int(batch_size, "batch_size", 1)
    _check_host_int(seqlen_q, "seqlen_q", 1)
    device = _device_or_default(device)
    _check_device(device, "device", tensors=False)
    _check(config is None or tuned is None, "tuned", "give config (a forced tile) or tuned, not both")
    rows = seqlen_q * m.NUM_HEADS
    chosen, reason = m.decode_backend(
        device, backend, knobs_given=config is not None or block_m is not None, total_rows=batch_size * rows
    )
    sm_count = m._sm_count(device)
    # a caller's forced tile; tuned stands for the tuned entry (not given) and is checked under its own name
    config_given, config_name = config is not None, "config" if tuned is None else "tuned"
    if tuned is not None:
        config = tuned
    fp8_compute, fp8_compute_reason = False, ""
    if chosen == "gluon":
        block_m, small = m.DECODE_GLUON_BLOCK_M, False
        parts_per_sm = m.DECODE_GLUON_PARTS_PER_SM
        if config is None:
            config = tuned_config(m.DECODE_TUNED, m._gpu_key(device), DECODE_GLUON_BUCKET, m.DECODE_GLUON_DEFAULT)
        _check(
            isinstance(config, (tuple, list)) and tuple(config) in m.DECODE_GLUON_SPACE,
            config_name,
            f"the Gluon decode takes (block_n, registers, stages) in {list(m.DECODE_GLUON_SPACE)}, got {config!r}",
        )
        config = tuple(config)
        narrow_limit = gluon_narrow_limit(
            m.DECODE_GLUON_NARROW_ROWS,
            m.DECODE_GLUON_NARROW_ROWS_LARGE_BATCH,
            batch_size=batch_size,
            large_batch=m.DECODE_GLUON_NARROW_LARGE_BATCH,
        )
        narrow = gluon_narrow_rows(rows, narrow_limit)
        fp8_compute, fp8_compute_reason = gluon_fp8_compute(m, config_given, rows, narrow)
        tall_rows = not narrow  # query rows as the MMAs' M (see decode_sequence_runs)
        slots, fewest_blocks = gluon_small_batch_schedule(
            sm_count,
            narrow=narrow,
            batch_size=batch_size,
            small_batch=m.DECODE_SMALL_BATCH,
            min_blocks_per_part=m.DECODE_GLUON_MIN_BLOCKS_PER_PART,
            fp8_cache=m.CACHE_FORMAT.scaled,
        )
    else:
        block_m, small = decode_row_block(
            block_m,
            rows,
            batch_size,
            min_block_m=m.DECODE_MIN_BLOCK_M,
            max_block_m=m.DECODE_MAX_BLOCK_M,
            small_batch=m.DECODE_SMALL_BATCH,
            small_block_m=m.DECODE_SMALL_BLOCK_M,
        )
        _check(block_m in m.DECODE_SPACE, "block_m", f"must be one of {sorted(m.DECODE_SPACE)}, got {block_m!r}")
        parts_per_sm, cost_table, slots = m.DECODE_PARTS_PER_SM, m.DECODE_MIN_BLOCKS_PER_PART, sm_count
        narrow, tall_rows = 0, False
        if getattr(m, "DECODE_GLUON_FP8_COMPUTE", False):
            fp8_compute_reason = "the portable Triton kernel has no fp8 products"
        if config is None and (m._INTERPRET or device.type != "cuda"):
            config = m.DECODE_INTERPRETER_CONFIG
        elif config is None:
            fallback = (m.DECODE_SMALL_DEFAULTS if small else m.DECODE_DEFAULTS)[block_m]
            config = tuned_config(m.DECODE_TUNED, m._gpu_key(device), decode_bucket(block_m, small), fallback)
        config = check_decode_config(config, config_name)
    num_parts = decode_num_parts(
        num_parts,
        sm_count=slots,
        parts_per_sm=parts_per_sm,
        row_blocks=cdiv(rows, block_m),
        batch_size=batch_size,
        align_runs=chosen == "gluon",
    )
    land_slots = 1
    if fp8_compute:
        # the plan's blocks and landing slots (no short, long or ring choices: gluon_blocks); the plan's stages for
        # the exact kernel, should a launch's cache be one TMA cannot box (decode_gluon_split)
        config = (m.DECODE_GLUON_BLOCK_N, config[1], m.DECODE_GLUON_STAGES)
        land_slots = m.DECODE_GLUON_FP8_LAND_SLOTS
        cost_table = {(block_m, config[0]): fewest_blocks}
    elif chosen == "gluon":
        config, fewest_blocks, land_slots = gluon_blocks(
            config,
            fewest_blocks=fewest_blocks,
            sizes=m.DECODE_GLUON_BLOCK_SIZES,
            query_rows=rows,
            narrow=narrow,
            batch_size=batch_size,
            num_parts=num_parts,
            small_batch=m.DECODE_SMALL_BATCH,
            fp8_cache=m.CACHE_FORMAT.scaled,
            page_size=m.PAGE_SIZE,
            config_given=config_given,
        )
        cost_table = {(block_m, config[0]): fewest_blocks}
    min_blocks_per_part = decode_min_blocks_per_part(
        min_blocks_per_part,
        small=small,
        block_m=block_m,
        small_block_m=m.DECODE_SMALL_BLOCK_M,
        block_n=config[0],
        cost_table=cost_table,
    )
    merge = decode_merge(
        merge if merge is not None else _options().decode_merge,
        backend=chosen,
        batch_size=batch_size,
        num_parts=num_parts,
        narrow=narrow,
        name="merge" if merge is not None else "MLAGEN_DECODE_MERGE",
    )
    pdl = decode_pdl(
        pdl if pdl is not None else (None if _options().decode_pdl else False),
        merge=merge,
        capability=m._gpu_capability(device),
        interpreting=m._INTERPRET,
    )
    sequence_runs = decode_sequence_runs(batch_size, num_parts, m.DECODE_SMALL_BATCH, tall_rows=tall_rows)
    partial_dtype = m.DTYPE if decode_partials_in_dtype(chosen, rows, _options().decode_partials) else torch.float32
    return m.DecodeSchedule(
        batch_size,
        seqlen_q,
        block_m,
        num_parts,
        min_blocks_per_part,
        config,
        sm_count,
        chosen,
        reason,
        merge,
        pdl,
        sequence_runs,
        narrow,
        partial_dtype,
        decode_keep_partials(),
        land_slots,
        fp8_compute,
        fp8_compute_reason,
    )


def latent_descriptors(m, rows, block_rows):
    """TMA descriptors of the [c ; pe] column ranges of a [N, Dc + Dr] matrix (padded columns read as 0)."""
    dc, dr = m.KV_LORA_RANK, m.QK_ROPE_HEAD_DIM
    latent = TensorDescriptor(rows, [rows.shape[0], dc], [dc + dr, 1], [block_rows, m.DECODE_DC_PAD])
    rope = TensorDescriptor(rows[:, dc:], [rows.shape[0], dr], [dc + dr, 1], [block_rows, m.DECODE_DR_PAD])
    return latent, rope


def default_schedule(m, batch, seqlen_q, device, plan=True):
    """The schedule of a module's decode call made without one (m._DEFAULT_SCHEDULES, per batch, Sq, device,
    stream and options in force); plan=False: None where none is planned yet."""
    stream = _current_stream(device) if device.type == "cuda" else 0
    key = (batch, seqlen_q, device, stream, _options())
    schedules = m._DEFAULT_SCHEDULES
    schedule = schedules.get(key)
    if schedule is None and plan:
        if len(schedules) >= 64:  # many shapes (e.g. a varying batch): keep the newest
            schedules.pop(next(iter(schedules)))
        schedule = schedules[key] = m.get_decode_schedule(batch, seqlen_q, device)
    return schedule


def decode_signature(
    q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale, kv_scale_tensor, scale, causal, empty_lse, addresses
):
    """What a decode call's launches depend on besides where its tensors are: their layouts (shape, strides,
    dtype, device, address modulo 16), the softmax scale, causality, empty_lse, and the form of kv_scale (a number:
    its cached tensor; a tensor: its layout). out / lse not given count as such (the call allocates them contiguous
    and aligned). addresses: decode_addresses of the call. One flat tuple, written out: this runs on every call."""
    key = (
        q.shape,
        q.stride(),
        q.dtype,
        q.device,
        addresses[0] & 15,
        kv_cache.shape,
        kv_cache.stride(),
        kv_cache.dtype,
        kv_cache.device,
        addresses[1] & 15,
        block_table.shape,
        block_table.stride(),
        block_table.dtype,
        block_table.device,
        addresses[2] & 15,
        cache_seqlens.shape,
        cache_seqlens.stride(),
        cache_seqlens.dtype,
        cache_seqlens.device,
        addresses[3] & 15,
        scale,
        causal,
        empty_lse,
        _layout(kv_scale) if isinstance(kv_scale, torch.Tensor) else kv_scale_tensor is None,
    )
    if out is not None:
        key += ("out", out.shape, out.stride(), out.dtype, out.device, addresses[4] & 15)
    if lse is not None:
        key += ("lse", lse.shape, lse.stride(), lse.dtype, lse.device, addresses[5] & 15)
    return key


def decode_addresses(q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale_tensor):
    """data_ptr() of a call's tensors, in the order of its launches' inputs (None where absent): read once,
    for the signature and the raw launches."""
    return [
        q.data_ptr(),
        kv_cache.data_ptr(),
        block_table.data_ptr(),
        cache_seqlens.data_ptr(),
        None if out is None else out.data_ptr(),
        None if lse is None else lse.data_ptr(),
        None if kv_scale_tensor is None else kv_scale_tensor.data_ptr(),
    ]


def _check_decode_apart(q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale_tensor):
    """A decode call's out and lse share no memory with its inputs (or each other)."""
    inputs = (("q", q), ("kv_cache", kv_cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens))
    _check_no_overlap((("out", out), ("lse", lse)), (*inputs, ("kv_scale", kv_scale_tensor)))


def mla_decode_prepared(
    m, q, kv_cache, block_table, cache_seqlens, softmax_scale, kv_scale, schedule, out, lse, validate, return_lse,
    causal, empty_lse,
):  # fmt: skip
    """A module's mla_decode, the per-call path: (out, lse) of a call whose tensors have the layout of an earlier,
    fully checked call with this schedule (bare calls: the default one): its launches with this call's tensors,
    nothing checked again but index values where validating. None where there is no such call (or the arguments
    are of a kind the checks would reject): mla_decode then checks everything and prepares the launches
    (mla_decode_checked). lse not given and not returned: written to the schedule's scratch rows (the kernels
    only store it)."""
    try:
        device = q.device
        if schedule is None:
            schedule = default_schedule(m, q.shape[0], q.shape[1], device, plan=False)
            if schedule is None:
                return None
        elif type(schedule) is not m.DecodeSchedule:
            return None
        if kv_scale is None or isinstance(kv_scale, torch.Tensor):
            kv_scale_tensor = kv_scale
        elif type(kv_scale) is float and m.CACHE_FORMAT.scaled:  # (a number's tensor, made by the checked call)
            kv_scale_tensor = m._KV_SCALE_TENSORS.get((device, kv_scale))
            if kv_scale_tensor is None:
                return None
        else:
            return None
        if (
            not (softmax_scale is None or type(softmax_scale) is float)
            or type(causal) is not bool
            or (type(empty_lse) is not float)
        ):
            return None
        scale = m.SOFTMAX_SCALE if softmax_scale is None else softmax_scale
        causal = causal or q.shape[1] == 1
        addresses = decode_addresses(q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale_tensor)
        signature = decode_signature(q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale, kv_scale_tensor,
                                     scale, causal, empty_lse, addresses)  # fmt: skip
        launches = schedule._launches.get(signature)
    except (AttributeError, IndexError, TypeError):  # not tensors of the expected rank: the checks say what
        return None
    if launches is None:
        return None
    if _validating(validate, device):
        resolve_kv_scale(m, kv_scale, device, validate)
        _validate_pages(block_table, cache_seqlens, "cache_seqlens", kv_cache.shape[0], m.PAGE_SIZE)
        if out is not None or lse is not None:  # (the first call checked the layout, not these addresses)
            _check_decode_apart(q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale_tensor)
    if out is None:  # (empty_strided with the layout worked out: less host time than empty, performance-log.md)
        out = torch.empty_strided(*schedule._out_layout, dtype=m.DTYPE, device=device)
        addresses[4] = out.data_ptr()
    if lse is None:
        lse = (
            schedule._lse_rows(device)
            if not return_lse
            else torch.empty_strided(*schedule._lse_layout, dtype=torch.float32, device=device)
        )
        addresses[5] = lse.data_ptr()
    if _options().poison_workspace:
        schedule.workspace(device)
    _launch_prepared(launches, (q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale_tensor), addresses)
    return out, lse


def mla_decode_checked(
    m,
    q,
    kv_cache,
    block_table,
    cache_seqlens,
    softmax_scale,
    kv_scale,
    return_lse,
    schedule,
    out,
    lse,
    validate,
    causal,
    empty_lse,
):
    """A generated module's mla_decode where no launch prepared by an earlier call fits: every argument checked,
    the launches prepared on the schedule (kept for later calls of this layout) and issued."""
    width = m.KV_LORA_RANK + m.QK_ROPE_HEAD_DIM
    _check_tensor(q, "q", ndim=4, dtype=m.DTYPE, last_dim=width)
    device = q.device
    _check_device(device, "q")
    _check_flag(return_lse, "return_lse")
    _check(q.shape[2] == m.NUM_HEADS, "q", f"expected {m.NUM_HEADS} heads in dimension 2, got shape {tuple(q.shape)}")
    batch, seqlen_q = q.shape[0], q.shape[1]
    _check(batch >= 1 and seqlen_q >= 1, "q", f"batch and Sq must be >= 1, got shape {tuple(q.shape)}")
    check_paged_cache(m, kv_cache, device)
    kv_scale_tensor = resolve_kv_scale(m, kv_scale, device, validate)
    _check_per_sequence(block_table, "block_table", batch, device, ndim=2)
    _check_per_sequence(cache_seqlens, "cache_seqlens", batch, device, ndim=1)
    if _validating(validate, device):
        _validate_pages(block_table, cache_seqlens, "cache_seqlens", kv_cache.shape[0], m.PAGE_SIZE)
    if schedule is None:
        schedule = default_schedule(m, batch, seqlen_q, device)
    if not (type(schedule) is m.DecodeSchedule and schedule.spec_hash == m.SPEC_HASH):
        raise ValueError(
            f"schedule: planned by another module (spec {getattr(schedule, 'spec_hash', '?')[:12]}), "
            f"not this one ('{m.SPEC['name']}', {m.SPEC_HASH[:12]}): use this module's get_decode_schedule"
        )
    _check(
        schedule.batch_size == batch and schedule.seqlen_q == seqlen_q,
        "schedule",
        f"planned for batch {schedule.batch_size}, Sq {schedule.seqlen_q}; called with {batch}, {seqlen_q}",
    )
    scale = resolve_softmax_scale(m, softmax_scale)
    _check(type(causal) is bool, "causal", f"must be True or False, got {causal!r}")
    causal = causal or seqlen_q == 1  # one new token: both forms are the same launch
    _check(
        isinstance(empty_lse, (int, float)) and not isinstance(empty_lse, bool) and abs(empty_lse) == math.inf,
        "empty_lse",
        f"must be -math.inf or math.inf, got {empty_lse!r}",
    )
    empty_lse = float(empty_lse)
    addresses = decode_addresses(q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale_tensor)
    signature = decode_signature(q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale, kv_scale_tensor,
                                 scale, causal, empty_lse, addresses)  # fmt: skip

    out_shape = (batch, seqlen_q, m.NUM_HEADS, m.KV_LORA_RANK)
    if out is None:
        out = torch.empty(out_shape, dtype=m.DTYPE, device=device)
    _check_tensor(out, "out", ndim=4, dtype=m.DTYPE, device=device)
    _check(tuple(out.shape) == out_shape, "out", f"expected shape {out_shape}, got {tuple(out.shape)}")
    if lse is None:
        lse = (
            schedule._lse_rows(device)
            if not return_lse
            else torch.empty((batch, m.NUM_HEADS, seqlen_q), dtype=torch.float32, device=device)
        )
    _check(
        tuple(lse.shape) == (batch, m.NUM_HEADS, seqlen_q)
        and lse.dtype == torch.float32
        and lse.device == device
        and lse.stride(-1) == 1,
        "lse",
        f"expected float32 [{batch}, {m.NUM_HEADS}, {seqlen_q}] on {device}",
    )
    _check_decode_apart(q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale_tensor)
    inputs = (q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale_tensor)
    workspace = schedule.workspace(device)
    launches = prepare_decode(m, inputs, workspace, scale, schedule, causal, empty_lse)
    for launch in launches:
        launch.launch(inputs)
    if _options().direct_launch and all(launch.reusable for launch in launches):
        if len(schedule._launches) >= 64:  # layouts that never repeat: bounded
            schedule._launches.clear()
        schedule._launches[signature] = launches
    return (out, lse) if return_lse else out


def prepare_decode(m, inputs, workspace, scale, schedule, causal, empty_lse):
    """The launches of one decode call (inputs, causal, empty_lse: see mla_decode): the split kernel, and the
    combine kernel where the schedule merges split sequences in a second launch."""
    q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale = inputs
    if schedule.backend == "gluon":
        launches = [decode_gluon_split(m, inputs, workspace, scale, schedule, causal, empty_lse)]
    else:
        launches = [decode_triton_split(m, inputs, workspace, scale, schedule, causal, empty_lse)]
    if schedule.merge == "kernel":
        o_part, lse_part, _ = workspace
        batch, seqlen_q = q.shape[0], q.shape[1]
        tile_rows, tile_cols = schedule.combine_tile
        launches.append(
            _PreparedLaunch(
                m._mla_decode_combine_kernel,
                schedule.combine_grid,
                inputs,
                workspace,
                (
                    cache_seqlens,
                    out,
                    lse,
                    o_part,
                    lse_part,
                    batch,
                    schedule.num_parts,
                    schedule.min_blocks_per_part,
                    *_decode_output_strides(out, lse, o_part),
                ),
                dict(
                    SQ=seqlen_q,
                    H=m.NUM_HEADS,
                    DC=m.KV_LORA_RANK,
                    BLOCK_N=schedule.config[0],
                    BLOCK_B=schedule.block_b,
                    BLOCK_ROWS=tile_rows,
                    BLOCK_C=tile_cols,
                    BLOCK_RUNS=schedule.combine_runs,
                    PDL=schedule.pdl,
                    SEQUENCE_RUNS=schedule.sequence_runs,
                    PARTIAL_LOAD=_PARTIAL_EVICTION[schedule.keep_partials][1],
                    EMPTY_INF=empty_lse > 0,
                ),
                num_warps=schedule.combine_warps,
                num_stages=2,
                launch_pdl=schedule.pdl,
            )
        )
    return launches


def decode_triton_split(m, inputs, workspace, scale, schedule, causal, empty_lse):
    """The portable split kernel's launch: final results of whole-sequence runs, partials of the others
    (merged in the launch when schedule.merge is "fused"). inputs: see mla_decode; kv_scale among them is None,
    or the fp8 cache's float32 [1] scale tensor (see the module's _kv_scale)."""
    q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale = inputs
    o_part, lse_part, counters = workspace
    width = m.KV_LORA_RANK + m.QK_ROPE_HEAD_DIM
    batch, seqlen_q = q.shape[0], q.shape[1]
    block_n, num_warps, num_stages = schedule.config
    use_tma, q_tma = decode_tile_loads(
        enabled=_options().decode_tma,
        page_size=m.PAGE_SIZE,
        block_n=block_n,
        page_stride=kv_cache.stride(0),
        row_stride=kv_cache.stride(1),
        width=width,
        block_m=schedule.block_m,
        q_tma_min_block_m=m.DECODE_Q_TMA_MIN_BLOCK_M,
        q_contiguous=q.is_contiguous(),
    )
    q_desc_c = q_desc_r = kv_desc_c = kv_desc_r = None
    if use_tma:
        kv_desc_c, kv_desc_r = latent_descriptors(m, kv_cache.view(-1, width), block_n)
    if q_tma:
        q_desc_c, q_desc_r = latent_descriptors(m, q.view(-1, width), schedule.block_m)
    return _PreparedLaunch(
        m._mla_decode_split_kernel,
        (schedule.row_blocks, schedule.num_parts),
        inputs,
        workspace,
        (
            q,
            q_desc_c,
            q_desc_r,
            kv_cache,
            kv_desc_c,
            kv_desc_r,
            block_table,
            cache_seqlens,
            out,
            lse,
            o_part,
            lse_part,
            counters,
            scale * LOG2E,
            batch,
            schedule.num_parts,
            schedule.min_blocks_per_part,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            kv_cache.stride(0),
            kv_cache.stride(1),
            block_table.stride(0),
            *_decode_output_strides(out, lse, o_part),
        ),
        dict(
            SQ=seqlen_q,
            H=m.NUM_HEADS,
            DC=m.KV_LORA_RANK,
            DR=m.QK_ROPE_HEAD_DIM,
            KV_SCALE=kv_scale,
            F16_DOTS=kv_scale is not None
            and fp8_dots_in_float16(schedule.block_m, wgmma_min_block_m=m.DECODE_Q_TMA_MIN_BLOCK_M),
            DC_PAD=m.DECODE_DC_PAD,
            DR_PAD=m.DECODE_DR_PAD,
            PAGE_SIZE=m.PAGE_SIZE,
            BLOCK_M=schedule.block_m,
            BLOCK_N=block_n,
            BLOCK_B=schedule.block_b,
            USE_TMA=use_tma,
            Q_TMA=q_tma,
            UPCAST=m._INTERPRET,
            FUSED_MERGE=schedule.merge == "fused",
            MERGE_FANIN=m.DECODE_MERGE_FANIN,
            MERGE_LEVELS=m.DECODE_MERGE_LEVELS,
            MERGE_BLOCK_C=m.DECODE_MERGE_BLOCK_C,
            PDL=schedule.pdl,
            SEQUENCE_RUNS=schedule.sequence_runs,
            PARTIAL_STORE=_PARTIAL_EVICTION[schedule.keep_partials][0],
            CAUSAL=causal,
            EMPTY_INF=empty_lse > 0,
        ),
        num_warps=num_warps,
        num_stages=num_stages,
    )


# ---- the Gluon decode's launch (gl, GluonTensorDescriptor and the shared layouts are the module's: it imports
# and makes them where its Triton release has Gluon) ---------------------------------------------------------


def gluon_descriptors(m, rows, block_rows):
    """TMA descriptors of a [N, Dc + Dr] matrix: boxes of one latent half and of the rope columns."""
    width = m.KV_LORA_RANK + m.QK_ROPE_HEAD_DIM
    shape = [rows.shape[0], width]
    return (
        m.GluonTensorDescriptor(rows, shape, [width, 1], [block_rows, m.DECODE_GLUON_DC_HALF], m._GLUON_LAYOUT_C),
        m.GluonTensorDescriptor(rows, shape, [width, 1], [block_rows, m.QK_ROPE_HEAD_DIM], m._GLUON_LAYOUT_R),
    )


def gluon_land_descriptors(m, q_rows, cache_rows, block_n, full_query=False):
    """An fp8 cache's landing producer's: query boxes [BLOCK_M / 2, 64] (16-bit chunks of the tile's upper half;
    full_query: the whole tile's, the landing zone being a buffer of its own) and fp8 cache boxes [block_n, 64]
    (one per chunk of the lower half), rope boxes min(Dr, 64) wide (m._GLUON_LAND_RW)."""
    width = m.KV_LORA_RANK + m.QK_ROPE_HEAD_DIM
    q_shape, kv_shape = [q_rows.shape[0], width], [cache_rows.shape[0], width]
    rows = m.DECODE_GLUON_BLOCK_M if full_query else m.DECODE_GLUON_LAND_ROWS
    land_rw, land_layout = m._GLUON_LAND_RW, m._GLUON_LAYOUT_LAND
    return (
        m.GluonTensorDescriptor(q_rows, q_shape, [width, 1], [rows, 64], m._GLUON_LAYOUT_C),
        m.GluonTensorDescriptor(q_rows, q_shape, [width, 1], [rows, land_rw], m._GLUON_LAYOUT_R),
        m.GluonTensorDescriptor(cache_rows, kv_shape, [width, 1], [block_n, 64], land_layout),
        m.GluonTensorDescriptor(cache_rows, kv_shape, [width, 1], [block_n, land_rw], land_layout),
    )


def gluon_cache_boxes(m, kv_cache, block_n):
    """Whether every block_n-position block of the cache is one contiguous range of whole rows that TMA boxes (and
    bulk prefetches) can address: pages holding whole blocks, the cache one [pages * page_size, Dc + Dr] matrix."""
    width = m.KV_LORA_RANK + m.QK_ROPE_HEAD_DIM
    return (
        block_n <= m.PAGE_SIZE
        and kv_cache.stride(1) == width
        and kv_cache.stride(0) == m.PAGE_SIZE * width
        and kv_cache.data_ptr() % 16 == 0
    )


def gluon_tma_box_rows(m, block_n):
    """Rows of the 16-bit TMA producer's cache boxes for block_n-position blocks: the whole block, or for a long
    block (more than DECODE_GLUON_BLOCK_N positions: gluon_long_blocks) the part of it that one page holds, at
    least DECODE_GLUON_BLOCK_N rows (smaller pages take the gathering producer)."""
    return block_n if block_n <= m.DECODE_GLUON_BLOCK_N else max(m.DECODE_GLUON_BLOCK_N, min(block_n, m.PAGE_SIZE))


def gluon_producer_kind(m, kv_cache, query_rows, narrow, block_n=None, land_slots=1):
    """Which producer fills the stages, its warps and registers (block_n None: DECODE_GLUON_BLOCK_N). TMA boxes
    need every block (block_n cache positions: the schedule's; a long block: every gluon_tma_box_rows of it) inside
    one page and the cache viewable as one [pages * page_size, Dc + Dr] matrix; else a 16-bit cache takes the
    gathering producer (any page size). An fp8 cache lands by TMA in the query tile's lower half where the query
    takes at most its upper half (query_rows = Sq * H; more converting warps with the narrow form, narrow > 0:
    the schedule's), or in a ring of its own where the schedule has one (land_slots > 1, see gluon_land_ring: a
    query that fills the tile then lands too), else it is loaded row by row (any page size): 4-byte words at a
    time where the cache starts on 16 bytes and its rows on 4-byte words ("convert"), else byte by byte
    ("convert_bytes": the loads' latency is then paid chunk by chunk)."""
    block_n = m.DECODE_GLUON_BLOCK_N if block_n is None else block_n
    if not m.CACHE_FORMAT.scaled:
        if gluon_cache_boxes(m, kv_cache, gluon_tma_box_rows(m, block_n)):
            return "tma", 1, m.DECODE_GLUON_PRODUCER_REGS
        return "gather", m.DECODE_GLUON_GATHER_WARPS, m.DECODE_GLUON_GATHER_REGS
    if (query_rows <= m.DECODE_GLUON_LAND_ROWS or land_slots > 1) and gluon_cache_boxes(m, kv_cache, block_n):
        land_warps = m.DECODE_GLUON_NARROW_LAND_WARPS if narrow else m.DECODE_GLUON_LAND_WARPS
        return "land", land_warps, m.DECODE_GLUON_LAND_REGS
    # (16 bytes, not 4, for the start: a prepared launch is reused for caches of the same layout and 16-byte
    # alignment, so a launch with word loads must never meet a cache that starts off a word)
    words = kv_cache.data_ptr() % 16 == 0 and kv_cache.stride(0) % 4 == 0 and kv_cache.stride(1) % 4 == 0
    return "convert" if words else "convert_bytes", m.DECODE_GLUON_GATHER_WARPS, m.DECODE_GLUON_CONVERT_REGS


def gluon_launch_descriptors(m, q_rows, kv_cache, producer, block_n=None, full_query=False):
    """The four TMA descriptors of a launch with `producer` and block_n-position cache blocks (None:
    DECODE_GLUON_BLOCK_N; a producer without cache boxes gets the query's twice: unused; full_query: the landing
    producer's query fills the tile)."""
    block_n = m.DECODE_GLUON_BLOCK_N if block_n is None else block_n
    cache_rows = kv_cache.view(-1, m.KV_LORA_RANK + m.QK_ROPE_HEAD_DIM) if producer in ("tma", "land") else None
    if producer == "land":
        return gluon_land_descriptors(m, q_rows, cache_rows, block_n, full_query)
    q_desc_c, q_desc_r = gluon_descriptors(m, q_rows, m.DECODE_GLUON_BLOCK_M)
    if producer == "tma":
        return (q_desc_c, q_desc_r) + gluon_descriptors(m, cache_rows, gluon_tma_box_rows(m, block_n))
    return q_desc_c, q_desc_r, q_desc_c, q_desc_r


def gluon_fp8_compute(m, config_given, query_rows, narrow):
    """(taken, why not) of the fp8 products for a Gluon decode schedule of Sq * H = query_rows: taken where the spec
    asks for cache_compute fp8 and the plan takes it for this geometry (the module's DECODE_GLUON_FP8_COMPUTE),
    the launch is in the narrow form (narrow: its N, 0 where rows are the MMAs' M), and the caller did not force a
    tile (config=: the exact kernel streams it as given); else the exact path, and why
    ('' for a module without the products). The narrow form only: there the products beat the exact fp8 path on
    the H200, with rows as the MMAs' M they lost to it (plan.FP8_NARROW_DC; docs/performance-log.md)."""
    if not getattr(m, "DECODE_GLUON_FP8_COMPUTE", False):
        return False, ""
    if not narrow or query_rows > m.DECODE_GLUON_NARROW_ROWS:
        return False, (
            f"Sq * H = {query_rows} query rows > {m.DECODE_GLUON_NARROW_ROWS}: the fp8 products run only in the narrow"
            f" form of at most {m.DECODE_GLUON_NARROW_ROWS} rows, where they beat the exact path on the H200"
            " (docs/performance-log.md)"
        )
    if config_given:
        return False, "config= forces the exact kernel's tile"
    return True, ""


def gluon_fp8_descriptors(m, cache_rows):
    """The fp8 products' TMA descriptors of the cache seen as [pages * page_size, Dc + Dr]: [block_n, 64] latent
    boxes and [block_n, RW] rope boxes, in the layouts the e4m3 MMAs read them in."""
    width = m.KV_LORA_RANK + m.QK_ROPE_HEAD_DIM
    shape, block_n = [cache_rows.shape[0], width], m.DECODE_GLUON_BLOCK_N
    return (
        m.GluonTensorDescriptor(cache_rows, shape, [width, 1], [block_n, 64], m._GLUON_F8_LAYOUT_C),
        m.GluonTensorDescriptor(cache_rows, shape, [width, 1], [block_n, m._GLUON_LAND_RW], m._GLUON_F8_LAYOUT_R),
    )


def decode_gluon_fp8(m, inputs, workspace, scale, schedule, causal, empty_lse, q_rows):
    """The launch of the fp8 products' kernel (a schedule with fp8_compute, a cache TMA can box)."""
    q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale = inputs
    o_part, lse_part, counters = workspace
    kv_desc_c, kv_desc_r = gluon_fp8_descriptors(m, kv_cache.view(-1, m.KV_LORA_RANK + m.QK_ROPE_HEAD_DIM))
    # the kernel reads the query's rows by address (row r at Q + r * (Dc + Dr)): the call's own tensor where its rows
    # are so (a prepared launch then takes a later call's), else q_rows, a contiguous copy
    q_arg = q if q.is_contiguous() else q_rows
    # fmt: off
    return _PreparedLaunch(
        m._mla_decode_gluon_fp8_kernel, (schedule.row_blocks, schedule.num_parts), inputs, workspace,
        (q_arg, kv_desc_c, kv_desc_r, kv_cache, block_table, cache_seqlens, out, lse, o_part, lse_part, counters,
         kv_scale, scale * LOG2E, q.shape[0], schedule.num_parts, max(1, schedule.min_blocks_per_part),
         block_table.stride(0), *_decode_output_strides(out, lse, o_part)),
        dict(SQ=q.shape[1], H=m.NUM_HEADS, DC=m.KV_LORA_RANK, DR=m.QK_ROPE_HEAD_DIM, DC_HALF=m.DECODE_GLUON_DC_HALF,
             PAGE_SIZE=m.PAGE_SIZE, BLOCK_M=m.DECODE_GLUON_BLOCK_M, BLOCK_N=m.DECODE_GLUON_BLOCK_N,
             BLOCK_B=schedule.block_b, SLOTS=m.DECODE_GLUON_FP8_LAND_SLOTS,
             CONVERT_WARPS=m.DECODE_GLUON_NARROW_LAND_WARPS, CONVERT_REGS=m.DECODE_GLUON_FP8_CONVERT_REGS,
             CONSUMER_REGS=schedule.config[1], ISSUER_REGS=m.DECODE_GLUON_PRODUCER_REGS,
             QUERY_SLICE=4 * m.DECODE_GLUON_NARROW_LAND_WARPS,
             Q_TERMS=m.DECODE_GLUON_FP8_QUERY_TERMS, NARROW=schedule.narrow,
             LN2=m._LN2.value, FUSED_MERGE=schedule.merge == "fused", MERGE_FANIN=m.DECODE_MERGE_FANIN,
             MERGE_LEVELS=m.DECODE_MERGE_LEVELS, MERGE_BLOCK_C=m.DECODE_MERGE_BLOCK_C,
             SEQUENCE_RUNS=schedule.sequence_runs, PARTIAL_STORE=_PARTIAL_EVICTION[schedule.keep_partials][0],
             CAUSAL=causal, EMPTY_INF=empty_lse > 0),
        num_warps=4,
    )
    # fmt: on


def decode_gluon_split(m, inputs, workspace, scale, schedule, causal, empty_lse):
    """The Gluon split kernel's launch: same slots, outputs and fused merge as decode_triton_split. kv_scale
    among the inputs: None, or the fp8 cache's float32 [1] scale tensor (a converting producer then fills the
    stages; or, schedule.fp8_compute where TMA boxes the cache's blocks, the fp8 products' kernel)."""
    q, kv_cache, block_table, cache_seqlens, out, lse, kv_scale = inputs
    o_part, lse_part, counters = workspace
    width = m.KV_LORA_RANK + m.QK_ROPE_HEAD_DIM
    batch, seqlen_q = q.shape[0], q.shape[1]
    q_rows = q.reshape(-1, width)
    if q_rows.data_ptr() % 16 or not q_rows.is_contiguous():
        q_rows = q_rows.clone()  # (a copy per call: such a launch is not reusable)
    block_n = schedule.config[0]
    stages, land_slots = schedule.config[2], schedule.land_slots
    if schedule.fp8_compute:
        if gluon_cache_boxes(m, kv_cache, block_n):
            return decode_gluon_fp8(m, inputs, workspace, scale, schedule, causal, empty_lse, q_rows)
        # (a cache TMA cannot box: the exact kernel, its rows loaded by the converting producer, on the plan's ring)
        stages, land_slots = m.DECODE_GLUON_STAGES, 1
    producer, producer_warps, producer_regs = gluon_producer_kind(
        m, kv_cache, seqlen_q * m.NUM_HEADS, schedule.narrow, block_n, land_slots
    )
    # (more query rows than half the tile land only beside it, in the ring: gluon_producer_kind)
    full_query = producer == "land" and seqlen_q * m.NUM_HEADS > m.DECODE_GLUON_LAND_ROWS
    q_desc_c, q_desc_r, kv_desc_c, kv_desc_r = gluon_launch_descriptors(
        m, q_rows, kv_cache, producer, block_n, full_query
    )
    scaled = m.CACHE_FORMAT.scaled
    land = producer == "land"
    # fmt: off
    return _PreparedLaunch(
        m._mla_decode_gluon_kernel, (schedule.row_blocks, schedule.num_parts), inputs, workspace,
        (q_desc_c, q_desc_r, kv_desc_c, kv_desc_r, kv_cache, block_table, cache_seqlens, out, lse, o_part, lse_part,
         counters, kv_scale if scaled else counters, scale * LOG2E, batch, schedule.num_parts,
         max(1, schedule.min_blocks_per_part), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
         *_decode_output_strides(out, lse, o_part)),
        dict(SQ=seqlen_q, H=m.NUM_HEADS, DC=m.KV_LORA_RANK, DR=m.QK_ROPE_HEAD_DIM, DC_HALF=m.DECODE_GLUON_DC_HALF,
             PAGE_SIZE=m.PAGE_SIZE, BLOCK_M=m.DECODE_GLUON_BLOCK_M, BLOCK_N=block_n, BLOCK_B=schedule.block_b,
             STAGES=stages, P_LAYOUT=m._GLUON_LAYOUT_P[block_n], PRODUCER=producer,
             ZERO_TAIL=producer in ("tma", "land"),
             LAND_PIECES=(m.DECODE_GLUON_LAND_FULL_QUERY_PIECES if full_query else m.DECODE_GLUON_LAND_PIECES)
             if land else 1, FULL_QUERY=full_query, LAND_SLOTS=land_slots if land else 1,
             QUERY_SLICE=m.DECODE_GLUON_LAND_FULL_QUERY_SLICE if full_query else 0,
             PREFETCH_BLOCKS=producer == "convert" and gluon_cache_boxes(m, kv_cache, block_n),
             STAGE_DTYPE=m.gl.float16 if scaled else m._GLUON_DTYPE, PRODUCER_WARPS=producer_warps,
             PRODUCER_REGS=producer_regs, GATHER_COLS=m.DECODE_GLUON_GATHER_COLS,
             ISSUER_REGS=m.DECODE_GLUON_PRODUCER_REGS, CONSUMER_REGS=schedule.config[1], LN2=m._LN2.value,
             FUSED_MERGE=schedule.merge == "fused", MERGE_FANIN=m.DECODE_MERGE_FANIN,
             MERGE_LEVELS=m.DECODE_MERGE_LEVELS, MERGE_BLOCK_C=m.DECODE_MERGE_BLOCK_C, SCALED=scaled,
             NARROW=schedule.narrow, SEQUENCE_RUNS=schedule.sequence_runs,
             PARTIAL_STORE=_PARTIAL_EVICTION[schedule.keep_partials][0], CAUSAL=causal, EMPTY_INF=empty_lse > 0),
        num_warps=4,
    )
    # fmt: on


# ---- the Gluon prefill's launch (GluonTensorDescriptor and the shared layouts, _gluon_prefill_layout, are the
# module's: it imports and makes them where its Triton release has Gluon) ----------------------------------------


def gluon_prefill_descriptors(m, q, k_nope, k_pe, v, block_n):
    """TMA descriptors of q [T, H * (Dn + Dr)] (boxes of one warpgroup's rows: its nope and its rope columns),
    k_nope [T, H * Dn], k_pe [T, Dr] and v [T, H * Dv] (boxes of one key block); the tensors' layouts are
    gluon_prefill_tma_ok's."""
    rows, layout, descriptor = m.PREFILL_GLUON_WARPGROUP_ROWS, m._gluon_prefill_layout, m.GluonTensorDescriptor
    dn, dr, dv, heads = m.QK_NOPE_HEAD_DIM, m.QK_ROPE_HEAD_DIM, m.V_HEAD_DIM, m.NUM_HEADS
    q_shape, q_strides = [q.shape[0], heads * (dn + dr)], [q.stride(0), 1]
    return (
        descriptor(q, q_shape, q_strides, [rows, dn], layout(rows, dn)),
        descriptor(q, q_shape, q_strides, [rows, dr], layout(rows, dr)),
        descriptor(k_nope, [k_nope.shape[0], heads * dn], [k_nope.stride(0), 1], [block_n, dn], layout(block_n, dn)),
        descriptor(k_pe, [k_pe.shape[0], dr], [k_pe.stride(0), 1], [block_n, dr], layout(block_n, dr)),
        descriptor(v, [v.shape[0], heads * dv], [v.stride(0), 1], [block_n, dv], layout(block_n, dv)),
    )


def gluon_prefill_tma_ok(tensor, head_dim):
    """TMA reads a [T, (H,) D] tensor as one [T, H * D] matrix: heads dense, last dim dense, 16-byte aligned rows
    and start."""
    dense = tensor.stride(-1) == 1 and (tensor.dim() == 2 or tensor.stride(1) == head_dim)
    return dense and tensor.stride(0) * tensor.element_size() % 16 == 0 and tensor.data_ptr() % 16 == 0


def launch_prefill_gluon(
    m, q, k_nope, k_pe, v, cu_q, cu_k, max_seqlen_q, out, lse, scale, causal, sections=None, config=None, launch=None
):
    """One launch of the module's _mla_prefill_gluon_kernel (arguments already checked; lse may be None). A tensor
    TMA cannot address is copied into a dense one first; no key at all (an empty prefix batch) takes the portable
    kernel, which only writes zeros and -inf then. sections: of the tile order (default: prefill_sections's; 1:
    row blocks outermost). config: (block_n, stages) of PREFILL_GLUON_SPACE (default: the device's tuned one for
    the launch's bucket, "gluon-causal" or "gluon-prefix", else PREFILL_GLUON_DEFAULT). launch: what issues it
    (default _launch; a checked mla_prefill's _Recorded)."""
    if config is None:
        config = m.tuned_config(
            m.PREFILL_TUNED, m._gpu_key(q.device), m.prefill_gluon_bucket(causal), m.PREFILL_GLUON_DEFAULT
        )
    block_n, stages = _check_prefill_gluon_config(m, config)
    if max_seqlen_q == 0:
        return
    if k_nope.shape[0] == 0:
        launch_prefill(
            m,
            q,
            k_nope,
            k_pe,
            v,
            cu_q,
            cu_k,
            max_seqlen_q,
            out,
            lse,
            scale,
            causal,
            m.PREFILL_INTERPRETER_CONFIG,
            use_tma=False,
            launch=launch,
        )
        return
    dn, dr, dv, heads = m.QK_NOPE_HEAD_DIM, m.QK_ROPE_HEAD_DIM, m.V_HEAD_DIM, m.NUM_HEADS
    tensors = []
    for tensor, head_dim in ((q, dn + dr), (k_nope, dn), (k_pe, dr), (v, dv)):
        if not gluon_prefill_tma_ok(tensor, head_dim):  # (a dense, aligned copy; a copy each call)
            tensor = torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)
        tensors.append(tensor)
    q, k_nope, k_pe, v = tensors
    q_desc_n, q_desc_r, kn_desc, kr_desc, v_desc = gluon_prefill_descriptors(
        m, q.view(q.shape[0], -1), k_nope.view(k_nope.shape[0], -1), k_pe, v.view(v.shape[0], -1), block_n
    )
    given_sections = sections is not None
    if given_sections:  # (a probe's choice: 0 or more sections than pairs would divide by zero inside)
        pairs = (cu_q.shape[0] - 1) * heads
        _check(
            isinstance(sections, int) and not isinstance(sections, bool) and 1 <= sections <= pairs,
            "sections",
            f"must be an int in 1..{pairs} ((sequence, head) pairs), got {sections!r}",
        )
    per_call = _prefill_gluon_per_call(m, (dn + dv) * k_nope.element_size(), l2_cache_bytes(q.device), sections)
    grid, (lse_stride, pairs, m_blocks, sections) = per_call(cu_q, k_nope, lse, max_seqlen_q)
    # (Triton's dispatch on the first launch of an argument key, its compiled kernel's launcher after that; a
    # probe's sections are checked against this call's pairs only: such a launch is never prepared)
    # fmt: off
    (_launch if launch is None else launch)(
        m._mla_prefill_gluon_kernel, grid,
        q_desc_n, q_desc_r, kn_desc, kr_desc, v_desc, out, lse if lse is not None else out, cu_q, cu_k,
        scale * LOG2E, out.stride(0), out.stride(1), lse_stride, pairs, m_blocks, sections,
        H=heads, DN=dn, DR=dr, DV=dv, BLOCK_N=block_n, STAGES=stages,
        CAUSAL=causal, STORE_LSE=lse is not None, CONSUMER_REGS=m.PREFILL_GLUON_CONSUMER_REGS,
        PRODUCER_REGS=m.PREFILL_GLUON_PRODUCER_REGS, LN2=m._LN2.value, num_warps=4,
        per_call=None if given_sections else (per_call, _PREFILL_GLUON_SIZED, (cu_q, k_nope, lse), max_seqlen_q))
    # fmt: on


#: the size-dependent ints of _mla_prefill_gluon_kernel, in the order _prefill_gluon_per_call gives them
_PREFILL_GLUON_SIZED = ("stride_lse_h", "pairs", "m_blocks", "sections")


def _prefill_gluon_per_call(m, bytes_per_key, l2_bytes, sections=None):
    """launch_prefill_gluon's grid and size-dependent ints (_PREFILL_GLUON_SIZED) as a function of its tensors
    cu_q, k_nope, lse (or None) and max_seqlen_q (see _PreparedLaunch's per_call): one program per (sequence,
    head) pair and row block of the longest sequence; the pairs in `sections` sections (default:
    prefill_sections's for the keys per sequence, bytes_per_key and l2_bytes)."""
    heads, block_m = m.NUM_HEADS, m.PREFILL_GLUON_BLOCK_M

    def per_call(cu_q, k_nope, lse, max_seqlen_q):
        batch = cu_q.shape[0] - 1
        pairs, m_blocks = batch * heads, -(-max_seqlen_q // block_m)
        chosen = sections
        if chosen is None:
            chosen = m.prefill_sections(pairs, k_nope.shape[0] // batch, bytes_per_key, l2_bytes)
        return (pairs * m_blocks, 1, 1), (lse.stride(0) if lse is not None else 0, pairs, m_blocks, chosen)

    return per_call


# ---- prefill, chunked prefill, the attention-state merge ------------------------------------------------


def prefill_config(m, device=None, bucket="causal"):
    """The (block_m, block_n, num_warps, num_stages) a prefill launch on `device` uses.

    bucket: "causal" (new tokens among themselves) or "prefix" (new tokens against a cached prefix).
    """
    device = _device_or_default(device)
    if m._INTERPRET or device.type != "cuda":
        return m.PREFILL_INTERPRETER_CONFIG
    return tuned_config(m.PREFILL_TUNED, m._gpu_key(device), bucket, m.PREFILL_DEFAULT)


def prefill_backend(m, device=None, requested=None, *, knobs_given=False):
    """(backend, reason) for prefill launches on `device` (default: the current CUDA device, else CPU);
    requested defaults to the prefill_backend option ($MLAGEN_PREFILL_BACKEND, else "auto"). The decision is
    select_prefill_backend's (launch policy); this gathers the facts it decides on. knobs_given: a config (the
    portable kernel's knobs) was given."""
    device = _device_or_default(device)
    name = "backend" if requested is not None else "MLAGEN_PREFILL_BACKEND"
    if requested is None:
        requested = _options().prefill_backend
    error = m._PREFILL_GLUON_IMPORT_ERROR
    capability = m._gpu_capability(device) if requested != "triton" and not error else None
    return select_prefill_backend(
        requested,
        eligible=m.PREFILL_GLUON_ELIGIBLE,
        ineligible_reason=m.PREFILL_GLUON_INELIGIBLE_REASON,
        gluon_error=error,
        interpreting=m._INTERPRET,
        capability=capability,
        knobs_given=knobs_given,
        name=name,
    )


def _check_prefill_gluon_config(m, config):
    """(block_n, stages) of the module's PREFILL_GLUON_SPACE as a tuple, else a ValueError naming config."""
    _check(
        isinstance(config, (tuple, list)) and tuple(config) in m.PREFILL_GLUON_SPACE,
        "config",
        f"the Gluon prefill takes (block_n, stages) in {list(m.PREFILL_GLUON_SPACE)}, got {config!r}",
    )
    return tuple(config)


def _checked_prefill_config(m, backend, config):
    """A forced prefill configuration as the chosen backend takes it, or None (not forced): the portable kernel's
    (block_m, block_n, num_warps, num_stages) (check_prefill_config), the Gluon kernel's (block_n, stages) of
    PREFILL_GLUON_SPACE."""
    if config is None:
        return None
    return _check_prefill_gluon_config(m, config) if backend == "gluon" else check_prefill_config(config)


def _launch_prefill_on(
    m, backend, q, k_nope, k_pe, v, cu_q, cu_k, max_seqlen_q, out, lse, scale, causal, config, launch=None
):
    """One prefill launch on the chosen backend. config: a forced one of that backend's kind (checked:
    _checked_prefill_config), or None: the device's tuned one for the launch's bucket (the portable kernel's
    "causal" or "prefix", the Gluon kernel's "gluon-causal" or "gluon-prefix"), else the default. launch: what
    issues it (default _launch; a checked mla_prefill's _Recorded)."""
    if backend == "gluon":
        m._launch_prefill_gluon(
            q, k_nope, k_pe, v, cu_q, cu_k, max_seqlen_q, out, lse, scale, causal, config=config, launch=launch
        )
    else:
        if config is None:
            config = prefill_config(m, q.device, "causal" if causal else "prefix")
        launch_prefill(m, q, k_nope, k_pe, v, cu_q, cu_k, max_seqlen_q, out, lse, scale, causal, config, launch=launch)


def _check_cu_seqlens(cu_seqlens, name, device):
    _check_tensor(cu_seqlens, name, ndim=1, dtype=torch.int32, device=device)
    _check(cu_seqlens.shape[0] >= 2, name, f"expected [B+1] with B >= 1, got shape {tuple(cu_seqlens.shape)}")


def _tma_ok(tensor, head_dim):
    """TMA reads a [T, (H,) D] tensor as a 2-D [T, H*D] matrix: heads dense, 16-byte aligned rows."""
    dense_heads = tensor.dim() == 2 or (tensor.stride(1) == head_dim and tensor.stride(2) == 1)
    return (
        dense_heads
        and tensor.shape[0] > 0
        and tensor.stride(0) * tensor.element_size() % 16 == 0
        and tensor.data_ptr() % 16 == 0
    )


def _key_descriptors(m, k_nope, k_pe, v, block_n):
    """TMA descriptors of k_nope [T, H*Dn], k_pe [T, Dr] and v [T, H*Dv], or Nones where not possible."""
    if not (
        _options().prefill_tma
        and _tma_ok(k_nope, m.QK_NOPE_HEAD_DIM)
        and _tma_ok(k_pe, m.QK_ROPE_HEAD_DIM)
        and _tma_ok(v, m.V_HEAD_DIM)
    ):
        return None, None, None
    num_keys = k_nope.shape[0]
    kn = TensorDescriptor(
        k_nope, [num_keys, m.NUM_HEADS * m.QK_NOPE_HEAD_DIM], [k_nope.stride(0), 1], [block_n, m.PREFILL_DN_PAD]
    )
    kr = TensorDescriptor(k_pe, [num_keys, m.QK_ROPE_HEAD_DIM], [k_pe.stride(0), 1], [block_n, m.PREFILL_DR_PAD])
    vd = TensorDescriptor(v, [num_keys, m.NUM_HEADS * m.V_HEAD_DIM], [v.stride(0), 1], [block_n, m.PREFILL_DV_PAD])
    return kn, kr, vd


def launch_prefill(
    m, q, k_nope, k_pe, v, cu_q, cu_k, max_seqlen_q, out, lse, scale, causal, config, use_tma=None, launch=None
):
    """One launch of the module's _mla_prefill_kernel (arguments already checked). lse may be None. launch: what
    issues it (default _launch; a checked mla_prefill's _Recorded)."""
    block_m, block_n, num_warps, num_stages = config
    if max_seqlen_q == 0:
        return
    kn_desc, kr_desc, v_desc = _key_descriptors(m, k_nope, k_pe, v, block_n) if use_tma is not False else (None,) * 3
    per_call = _prefill_per_call(m.NUM_HEADS, block_m)
    grid, (lse_stride,) = per_call(cu_q, lse, max_seqlen_q)
    (_launch if launch is None else launch)(
        m._mla_prefill_kernel,
        grid,
        q,
        k_nope,
        k_pe,
        v,
        kn_desc,
        kr_desc,
        v_desc,
        out,
        lse if lse is not None else out,
        cu_q,
        cu_k,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_nope.stride(0),
        k_nope.stride(1),
        k_pe.stride(0),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        lse_stride,
        H=m.NUM_HEADS,
        DN=m.QK_NOPE_HEAD_DIM,
        DR=m.QK_ROPE_HEAD_DIM,
        DV=m.V_HEAD_DIM,
        DN_PAD=m.PREFILL_DN_PAD,
        DR_PAD=m.PREFILL_DR_PAD,
        DV_PAD=m.PREFILL_DV_PAD,
        CAUSAL=causal,
        STORE_LSE=lse is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_TMA=kn_desc is not None,
        UPCAST=m._INTERPRET,
        num_warps=num_warps,
        num_stages=num_stages,
        per_call=(per_call, ("stride_lse_h",), (cu_q, lse), max_seqlen_q),
    )


def _prefill_per_call(heads, block_m):
    """launch_prefill's grid and size-dependent int (stride_lse_h) as a function of its tensors cu_q, lse (or None)
    and max_seqlen_q (see _PreparedLaunch's per_call): row blocks of the longest sequence by (sequence, head)
    pairs; the LSE's stride by head, its token count where it is dense."""

    def per_call(cu_q, lse, max_seqlen_q):
        grid = (cdiv(max_seqlen_q, block_m), (cu_q.shape[0] - 1) * heads, 1)
        return grid, (lse.stride(0) if lse is not None else 0,)

    return per_call


def _check_mha_inputs(m, q, k_nope, k_pe, v, num_keys=None):
    """Shapes of the MHA-form inputs; returns the number of query tokens."""
    qk_width = m.QK_NOPE_HEAD_DIM + m.QK_ROPE_HEAD_DIM
    _check_tensor(q, "q", ndim=3, dtype=m.DTYPE, last_dim=qk_width)
    device = q.device
    _check_device(device, "q")
    num_tokens = q.shape[0]
    num_keys = num_tokens if num_keys is None else num_keys
    _check(q.shape[1] == m.NUM_HEADS, "q", f"expected {m.NUM_HEADS} heads in dimension 1, got shape {tuple(q.shape)}")
    for name, tensor, shape in (
        ("k_nope", k_nope, (num_keys, m.NUM_HEADS, m.QK_NOPE_HEAD_DIM)),
        ("k_pe", k_pe, (num_keys, m.QK_ROPE_HEAD_DIM)),
        ("v", v, (num_keys, m.NUM_HEADS, m.V_HEAD_DIM)),
    ):
        _check_tensor(tensor, name, ndim=len(shape), dtype=m.DTYPE, device=device)
        _check(tuple(tensor.shape) == shape, name, f"expected shape {list(shape)}, got {tuple(tensor.shape)}")
    return num_tokens


def _check_max_seqlen(max_seqlen, num_tokens):
    """A host int in [0, T]: no sequence is longer than all T tokens, and programs are launched for max_seqlen
    tokens of every sequence (a bound far past T would launch that many idle blocks)."""
    _check_host_int(max_seqlen, "max_seqlen")
    _check(
        max_seqlen <= num_tokens,
        "max_seqlen",
        f"{max_seqlen} is more than the number of tokens ({num_tokens}): must be in [longest sequence, {num_tokens}]",
    )


def _prefill_outputs(m, num_tokens, device, out, lse, return_lse, out_dtype=None):
    out_shape = (num_tokens, m.NUM_HEADS, m.V_HEAD_DIM)
    out_dtype = m.DTYPE if out_dtype is None else out_dtype
    if out is None:
        out = torch.empty(out_shape, dtype=out_dtype, device=device)
    _check_tensor(out, "out", ndim=3, dtype=out_dtype, device=device)
    _check(tuple(out.shape) == out_shape, "out", f"expected shape {out_shape}, got {tuple(out.shape)}")
    if lse is None and return_lse:
        lse = torch.empty((m.NUM_HEADS, num_tokens), dtype=torch.float32, device=device)
    if lse is not None:
        _check(
            tuple(lse.shape) == (m.NUM_HEADS, num_tokens)
            and lse.dtype == torch.float32
            and lse.device == device
            and lse.stride(-1) == 1,
            "lse",
            f"expected float32 [{m.NUM_HEADS}, {num_tokens}] on {device}",
        )
    return out, lse


def mla_prefill(
    m,
    q,
    k_nope,
    k_pe,
    v,
    cu_seqlens,
    max_seqlen,
    *,
    softmax_scale=None,
    return_lse=False,
    out=None,
    lse=None,
    config=None,
    validate=None,
):
    """Causal MLA prefill in MHA form over packed variable-length sequences.

    q [T, H, Dn+Dr] (= [q_nope ; q_pe]), k_nope [T, H, Dn], k_pe [T, Dr] (shared by all heads),
    v [T, H, Dv], cu_seqlens [B+1] int32 (sequence b owns tokens cu_seqlens[b]..cu_seqlens[b+1]-1),
    max_seqlen: a host int >= the longest sequence (programs are launched for that many tokens; a smaller
    value leaves tokens unwritten, so it is checked whenever validation is on).
    Returns out [T, H, Dv] and, with return_lse=True, (out, lse [H, T] float32, natural log).
    Inputs may be strided views (e.g. k_pe a column slice of [c_kv ; k_pe] rows) if the last dim is dense.
    config: (block_m, block_n, num_warps, num_stages) to force a tile configuration of the portable kernel (under
    prefill_backend "auto" a config keeps the portable kernel); on the Gluon backend (prefill_backend "gluon"),
    (block_n, stages) of PREFILL_GLUON_SPACE.
    validate: check cu_seqlens and max_seqlen against the tokens (default: on for CPU tensors or with
    MLAGEN_VALIDATE=1; on the GPU it costs a synchronisation, and the values are the caller's contract).

    The first calls with tensors of a given layout check everything and prepare its launch (mla_prefill_checked);
    later calls of that layout and those scalars (prefill_signature), whatever their token counts, sequences and
    max_seqlen, only put their tensors in, the grid and sizes computed from them (mla_prefill_prepared). While
    torch.compile traces it, the call is the module's prefill op.
    """
    if compiling():
        return mla_prefill_traced(
            m, q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale, return_lse, out, lse, config, validate
        )
    arguments = (m, q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale, return_lse, out, lse, config, validate)
    outputs = mla_prefill_prepared(*arguments) if _options().direct_launch else None
    if outputs is None:
        outputs = mla_prefill_checked(*arguments)
    return outputs if return_lse else outputs[0]


def _token_layouts(tensors, addresses):
    """Per tensor of a call whose leading dimension is the call's own size (tokens, sequences), None where
    absent: its layout but that size (addresses: the tensors' data_ptr()): the other sizes, every stride, dtype,
    device and address modulo 16. A stride is kept as it is, the leading one included: a tensor's strides do not
    change with its leading size unless it is a transposed view, which then simply keys apart."""
    return [
        None if tensor is None else (tensor.shape[1:], tensor.stride(), tensor.dtype, tensor.device, address & 15)
        for tensor, address in zip(tensors, addresses, strict=True)
    ]


def _lse_layout(lse, address):
    """An LSE's ([H, T]) layout but its token count (None where absent): as _token_layouts, its stride by head
    kept as None where it is the token count (a dense LSE, whose stride changes with every token count)."""
    if lse is None:
        return None
    strides = lse.stride()
    head_stride = None if strides[0] == lse.shape[1] else strides[0]
    return (lse.shape[:1], lse.shape[2:], strides[1:], head_stride, lse.dtype, lse.device, address & 15)


def _size_classes(count):
    """What the prepared launches depend on of one of a call's sizes (tokens, prefix tokens): zero or not (no
    launch, no TMA descriptor of no rows, the Gluon kernel's fallback to the portable one for no keys), and what
    Triton specialises a runtime int on (_int_class: descriptors' rows, a dense LSE's stride, a token count)."""
    return count == 0, *_int_class(count)


def prefill_signature(inputs, addresses, max_seqlen, softmax_scale, return_lse, config):
    """What a prefill call's launch depends on besides where its tensors are and the sizes the launch takes per
    call (token count, sequences, max_seqlen): the layouts of its tensors but their token or sequence count
    (q, k_nope, k_pe, v, cu_seqlens, out: _token_layouts; lse: _lse_layout; out / lse not given count as such:
    the call allocates them), the token count's classes (_size_classes), whether max_seqlen is 0 (nothing is
    launched), softmax_scale and config as given, return_lse, and the options in force (the backend, TMA, direct
    and raw launch are theirs). The rest follows from these: the backend from the options, the device (its
    capability) and whether a config is given; the tile configuration from the device and the launch's bucket
    (causal or prefix: no bucket depends on a size); the L2 size from the device; descriptors and copies from the
    layouts; the grid and the ints that follow the sizes from the call's tensors (the launches' per_call).
    Call-level: prepared_sizes_agree."""
    return (
        *_token_layouts(inputs[:6], addresses[:6]),
        _lse_layout(inputs[6], addresses[6]),
        *_size_classes(inputs[0].shape[0]),
        max_seqlen == 0,
        softmax_scale,
        return_lse,
        config,
        _options(),
    )


def prepared_sizes_agree(inputs, max_seqlen, batch_rows=()):
    """Whether a call of a prepared signature has sizes that agree (its layouts do, but its token and sequence
    counts are its own): the token count of q in k_nope, k_pe, v and given out (rows) and lse (columns);
    cu_seqlens of at least one sequence, and as many in `batch_rows` (positions of the call's block table and
    prefix lengths); max_seqlen in [0, tokens]. What the checks would reject otherwise: the call goes to them."""
    q, k_nope, k_pe, v, cu_seqlens, out, lse = inputs[:7]
    num_tokens, batch = q.shape[0], cu_seqlens.shape[0] - 1
    return (
        k_nope.shape[0] == num_tokens
        and k_pe.shape[0] == num_tokens
        and v.shape[0] == num_tokens
        and (out is None or out.shape[0] == num_tokens)
        and (lse is None or lse.shape[1] == num_tokens)
        and batch >= 1
        and all(inputs[i].shape[0] == batch for i in batch_rows)
        and 0 <= max_seqlen <= num_tokens
    )


def mla_prefill_prepared(
    m, q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale, return_lse, out, lse, config, validate
):
    """mla_prefill's per-call path: (out, lse) of a call whose tensors and scalars have the signature
    (prefill_signature) of an earlier, fully checked call: its launch with this call's tensors, grid and sizes
    (the launch's call_values). Checked again: the sizes against one another (prepared_sizes_agree), index values
    where validating, given out / lse against the call's memory (_check_no_overlap). None where there is no such
    call, or the arguments are of a kind or size the checks would reject, or a size falls outside the prepared
    kernel's specialisation: mla_prefill then checks everything (mla_prefill_checked)."""
    if not _prepared_scalars(max_seqlen, softmax_scale, return_lse, config):
        return None
    inputs = [q, k_nope, k_pe, v, cu_seqlens, out, lse]
    addresses, signature = _call_signature(inputs, prefill_signature, max_seqlen, softmax_scale, return_lse, config)
    prepared = m._PREFILL_LAUNCHES.get(signature)
    if not prepared or not prepared_sizes_agree(inputs, max_seqlen):  # (None: seen once; False: not reusable)
        return None
    device = q.device
    if _validating(validate, device):
        _validate_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen)
    _check_given_outputs_apart(inputs)
    return _launch_prepared_prefill(m, prepared[0], inputs, addresses, max_seqlen, return_lse, device)


def _check_given_outputs_apart(inputs):
    """A prepared prefill call's given out / lse (inputs: the call's tensors as given, out and lse at positions 5
    and 6) against the memory of its other tensors, as the checked call checks them (before anything is made or
    launched)."""
    if inputs[5] is not None or inputs[6] is not None:
        names = ("q", "k_nope", "k_pe", "v", "cu_seqlens", "out", "lse", *_CHUNKED_INPUT_NAMES)
        given = list(zip(names, inputs, strict=False))
        _check_no_overlap(given[5:7], given[:5] + given[7:])


def _launch_prepared_prefill(m, launches, inputs, addresses, max_seqlen, return_lse, device):
    """A prepared prefill call's launches (launches: m._PREFILL_LAUNCHES's; inputs, addresses: the call's tensors
    and their data_ptr(), out and lse at positions 5 and 6, then any temporaries), its given out / lse checked
    (_check_given_outputs_apart): (out, lse), allocated where not given as the checked call allocates them; None
    where a launch's sizes fall outside its prepared specialisation (call_values)."""
    out, lse = inputs[5], inputs[6]
    num_tokens = inputs[0].shape[0]
    if out is None:
        inputs[5] = torch.empty((num_tokens, m.NUM_HEADS, m.V_HEAD_DIM), dtype=m.DTYPE, device=device)
        addresses[5] = inputs[5].data_ptr()
    if lse is None and return_lse:
        inputs[6] = torch.empty((m.NUM_HEADS, num_tokens), dtype=torch.float32, device=device)
        addresses[6] = inputs[6].data_ptr()
    calls = [launch.call_values(inputs, max_seqlen) for launch in launches]
    if None in calls:
        return None
    if launches:
        _launch_prepared(launches, inputs, addresses, calls)
    return inputs[5], inputs[6]


def _call_signature(inputs, signature, *scalars):
    """A call's tensors' data_ptr() (None where absent) and its signature (signature(inputs, addresses, *scalars)),
    or (None, None) where they are not tensors (or one has no memory, or too few dimensions): the checks say what."""
    try:
        addresses = [None if tensor is None else tensor.data_ptr() for tensor in inputs]
        return addresses, signature(inputs, addresses, *scalars)
    except (AttributeError, TypeError, RuntimeError, IndexError):
        return None, None


def _prepared_scalars(max_seqlen, softmax_scale, return_lse, config):
    """Whether a prefill call's scalars are of the kinds a prepared call may have (its signature holds their
    values, which a checked call accepted; a kind the checks reject, e.g. True for 1, must go back to them; a list
    config, which the checks accept, is not hashable: such calls are always checked)."""
    return (
        (softmax_scale is None or type(softmax_scale) is float)
        and type(max_seqlen) is int
        and type(return_lse) is bool
        and (config is None or (type(config) is tuple and all(type(value) is int for value in config)))
    )


def mla_prefill_checked(
    m, q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale, return_lse, out, lse, config, validate
):
    """mla_prefill where no launch prepared by an earlier call fits: every argument checked, the launch prepared
    (kept in m._PREFILL_LAUNCHES for later calls of this signature where it can be reused) and issued."""
    signature = None
    if _options().direct_launch and _prepared_scalars(max_seqlen, softmax_scale, return_lse, config):
        inputs = (q, k_nope, k_pe, v, cu_seqlens, out, lse)  # (out / lse it allocates count as not given)
        signature = _call_signature(inputs, prefill_signature, max_seqlen, softmax_scale, return_lse, config)[1]
    num_tokens = _check_mha_inputs(m, q, k_nope, k_pe, v)
    device = q.device
    _check_flag(return_lse, "return_lse")
    _check_cu_seqlens(cu_seqlens, "cu_seqlens", device)
    _check_max_seqlen(max_seqlen, num_tokens)
    if _validating(validate, device):
        _validate_cu_seqlens(cu_seqlens, num_tokens, max_seqlen)
    out, lse = _prefill_outputs(m, num_tokens, device, out, lse, return_lse)
    _check_no_overlap(
        (("out", out), ("lse", lse)),
        (("q", q), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v), ("cu_seqlens", cu_seqlens)),
    )
    backend, _ = prefill_backend(m, device, knobs_given=config is not None)
    config = _checked_prefill_config(m, backend, config)
    scale = resolve_softmax_scale(m, softmax_scale)
    recorded = _Recorded()
    _launch_prefill_on(
        m, backend, q, k_nope, k_pe, v, cu_seqlens, cu_seqlens, max_seqlen, out, lse, scale, True, config, recorded
    )
    if signature is not None:
        _keep_prefill_launches(m, signature, recorded, (q, k_nope, k_pe, v, cu_seqlens, out, lse))
    return out, lse


def _keep_prefill_launches(m, signature, recorded, inputs, temporaries_layout=None):
    """Keep a checked prefill call's launches (recorded) in m._PREFILL_LAUNCHES for later calls of its signature,
    whatever their sizes (the launches' per_call), as (launches, temporaries_layout: a chunked call's
    _temporaries_layout, else None): on the second call of a signature (the first only marks it seen: a layout
    used once pays no preparation); False where a launch is not reusable (a per-call copy): later calls of the
    signature are checked, nothing prepared. A call passing one tensor twice prepares nothing (a launch finds its
    tensors among the inputs by identity: a later call's two tensors would get one slot)."""
    if len({id(tensor) for tensor in inputs if tensor is not None}) < sum(tensor is not None for tensor in inputs):
        return
    kept = m._PREFILL_LAUNCHES
    if signature not in kept:
        if len(kept) >= 64:  # layouts that never repeat (e.g. fresh views at odd alignments): bounded
            kept.clear()
        kept[signature] = None
        return
    if kept[signature] is not None:  # (False; or prepared, where the per-call path declined this call)
        return
    launches = recorded.prepare(inputs)
    kept[signature] = False if launches is None else (launches, temporaries_layout)


def merge_attn_states(
    m, prefix_output, prefix_lse, suffix_output, suffix_lse, *, out=None, out_lse=None, return_lse=False
):
    """Exact merge of attention over two disjoint key sets through their log-sum-exps.

    *_output [T, H, Dv] (spec dtype or float32), *_lse [H, T] float32 (natural log; -inf: no keys, then
    that part's output is ignored). Returns out [T, H, Dv] in the spec dtype (and lse [H, T]).
    """
    _check(isinstance(prefix_output, torch.Tensor), "prefix_output", "expected a torch.Tensor")
    num_tokens, device = prefix_output.shape[0], prefix_output.device
    _check_device(device, "prefix_output")
    _check_flag(return_lse, "return_lse")
    shape = (num_tokens, m.NUM_HEADS, m.V_HEAD_DIM)
    for name, tensor in (("prefix_output", prefix_output), ("suffix_output", suffix_output)):
        _check(
            isinstance(tensor, torch.Tensor) and tensor.dtype in (m.DTYPE, torch.float32),
            name,
            f"expected a {m.DTYPE} or torch.float32 tensor",
        )
        _check_tensor(tensor, name, ndim=3, dtype=tensor.dtype, device=device)
        _check(tuple(tensor.shape) == shape, name, f"expected shape {list(shape)}, got {tuple(tensor.shape)}")
    for name, tensor in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        _check_tensor(tensor, name, ndim=2, dtype=torch.float32, device=device)
        _check(
            tuple(tensor.shape) == (m.NUM_HEADS, num_tokens),
            name,
            f"expected shape {[m.NUM_HEADS, num_tokens]}, got {tuple(tensor.shape)}",
        )
    out, out_lse = _prefill_outputs(m, num_tokens, device, out, out_lse, return_lse)
    _check_no_overlap(
        (("out", out), ("out_lse", out_lse)),
        (
            ("prefix_output", prefix_output),
            ("prefix_lse", prefix_lse),
            ("suffix_output", suffix_output),
            ("suffix_lse", suffix_lse),
        ),
    )
    _launch_merge(m, out, out_lse, prefix_output, prefix_lse, suffix_output, suffix_lse)
    return (out, out_lse) if return_lse else out


def _launch_merge(m, out, out_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, launch=None):
    """The merge kernel's launch (merge_attn_states's, arguments checked; out_lse may be None). launch: what
    issues it (default _launch; a checked chunked prefill's _Recorded)."""
    if out.shape[0] > 0:
        per_call = _merge_per_call(m.NUM_HEADS, m.PREFILL_MERGE_BLOCK_T)
        grid, (num_tokens, out_lse_stride, prefix_lse_stride, suffix_lse_stride) = per_call(
            out, out_lse, prefix_lse, suffix_lse, None
        )
        (_launch if launch is None else launch)(
            m._merge_attn_states_kernel,
            grid,
            out,
            out_lse if out_lse is not None else prefix_lse,
            prefix_output,
            prefix_lse,
            suffix_output,
            suffix_lse,
            num_tokens,
            out.stride(0),
            out.stride(1),
            out_lse_stride,
            prefix_output.stride(0),
            prefix_output.stride(1),
            prefix_lse_stride,
            suffix_output.stride(0),
            suffix_output.stride(1),
            suffix_lse_stride,
            DV=m.V_HEAD_DIM,
            DV_PAD=m.PREFILL_DV_PAD,
            BLOCK_T=m.PREFILL_MERGE_BLOCK_T,
            STORE_LSE=out_lse is not None,
            num_warps=4,
            per_call=(per_call, _MERGE_SIZED, (out, out_lse, prefix_lse, suffix_lse), None),
        )


#: the size-dependent ints of _merge_attn_states_kernel, in the order _merge_per_call gives them
_MERGE_SIZED = ("num_tokens", "stride_out_lse_h", "stride_lse_a_h", "stride_lse_b_h")


def _merge_per_call(heads, block_t):
    """_launch_merge's grid and size-dependent ints (_MERGE_SIZED) as a function of its tensors out, out_lse (or None),
    prefix_lse, suffix_lse (see _PreparedLaunch's per_call; max_seqlen unused): token blocks by heads, the token
    count, the LSEs' strides by head (their token counts where dense)."""

    def per_call(out, out_lse, prefix_lse, suffix_lse, max_seqlen):
        num_tokens = out.shape[0]
        out_lse_stride = out_lse.stride(0) if out_lse is not None else 0
        return (cdiv(num_tokens, block_t), heads, 1), (
            num_tokens,
            out_lse_stride,
            prefix_lse.stride(0),
            suffix_lse.stride(0),
        )

    return per_call


def _cache_row_constexprs(m):
    """The constexprs of the kernels that move whole latent rows between the paged cache and packed tensors
    (_mla_cache_write_kernel, _mla_cache_gather_kernel): the row's two parts, their padded widths, the page size and
    the tokens a program moves."""
    return dict(
        DC=m.KV_LORA_RANK,
        DR=m.QK_ROPE_HEAD_DIM,
        DC_PAD=m.CACHE_WRITE_DC_PAD,
        DR_PAD=m.CACHE_WRITE_DR_PAD,
        PAGE_SIZE=m.PAGE_SIZE,
        BLOCK_T=m.CACHE_WRITE_BLOCK_T,
    )


def _check_up_projections(m, w_uk, w_uv, device):
    """w_uk [H, Dn, Dc] and w_uv [H, Dv, Dc] in the module's dtype on `device` (the latent's up-projections)."""
    for name, tensor, head_dim in (("w_uk", w_uk, m.QK_NOPE_HEAD_DIM), ("w_uv", w_uv, m.V_HEAD_DIM)):
        _check_tensor(tensor, name, ndim=3, dtype=m.DTYPE, device=device, last_dim=m.KV_LORA_RANK)
        _check(
            tuple(tensor.shape) == (m.NUM_HEADS, head_dim, m.KV_LORA_RANK),
            name,
            f"expected shape {[m.NUM_HEADS, head_dim, m.KV_LORA_RANK]}, got {tuple(tensor.shape)}",
        )


def expand_latent_prefix(
    m, kv_cache, block_table, cu_prefix, num_prefix_tokens, w_uk, w_uv, kv_scale=None, *, validate=None
):
    """Gather the cached prefixes from the paged latent cache and expand them to MHA form.

    kv_cache [num_pages, PAGE_SIZE, 1, Dc+Dr]; block_table [B, max_pages] int32; cu_prefix [B+1] int32, the
    prefixes' cumulative lengths; num_prefix_tokens = cu_prefix[-1] as a host int; w_uk [H, Dn, Dc], w_uv
    [H, Dv, Dc]. Returns packed k_nope [P, H, Dn] = c_kv W_UK^T, k_pe [P, Dr] (a view of the gathered rows) and
    v [P, H, Dv] = c_kv W_UV^T, P = num_prefix_tokens. kv_scale: for a float8_e4m3fn cache the layer's scale (a
    number or a float32 tensor of one element; required), None for a 16-bit cache.
    validate: also check cu_prefix's values against num_prefix_tokens and the pages each prefix reads against the
    cache (default: on for CPU tensors or with MLAGEN_VALIDATE=1; on the GPU it costs a synchronisation).
    """
    check_paged_cache(m, kv_cache, None)
    device = kv_cache.device
    _check_device(device, "kv_cache")
    _check_cu_seqlens(cu_prefix, "cu_prefix", device)
    _check_per_sequence(block_table, "block_table", cu_prefix.shape[0] - 1, device, ndim=2)
    _check_host_int(num_prefix_tokens, "num_prefix_tokens")
    _check_up_projections(m, w_uk, w_uv, device)
    kv_scale = resolve_kv_scale(m, kv_scale, device, validate)
    if _validating(validate, device):
        lengths = _validate_cu_seqlens(cu_prefix, num_prefix_tokens, None, "cu_prefix", "num_prefix_tokens")
        _validate_pages(block_table, lengths, "cu_prefix's lengths", kv_cache.shape[0], m.PAGE_SIZE)
    return _expand_latent_prefix(m, kv_cache, block_table, cu_prefix, num_prefix_tokens, w_uk, w_uv, kv_scale)


def _expand_latent_prefix(m, kv_cache, block_table, cu_prefix, num_prefix_tokens, w_uk, w_uv, kv_scale):
    """expand_latent_prefix of arguments already checked (mla_chunked_prefill's; kv_scale resolved)."""
    width = m.KV_LORA_RANK + m.QK_ROPE_HEAD_DIM
    rows = torch.empty((num_prefix_tokens, width), dtype=m.DTYPE, device=kv_cache.device)  # [P, Dc+Dr]
    if num_prefix_tokens > 0:
        # one launch finds each row's sequence, page and slot and reads it (an fp8 row dequantised on the device,
        # in float32, then rounded once to the dtype the expansion GEMMs and the attention run in)
        num_seqs = cu_prefix.shape[0] - 1
        _launch(
            m._mla_cache_gather_kernel,
            (cdiv(num_prefix_tokens, m.CACHE_WRITE_BLOCK_T),),
            rows,
            kv_cache,
            block_table,
            cu_prefix,
            kv_scale,
            num_prefix_tokens,
            num_seqs,
            max(num_seqs - 1, 0).bit_length(),
            rows.stride(0),
            kv_cache.stride(0),
            kv_cache.stride(1),
            block_table.stride(0),
            num_warps=4,
            **_cache_row_constexprs(m),
        )
    c_kv = rows[:, : m.KV_LORA_RANK]
    k_nope = (c_kv @ w_uk.reshape(m.NUM_HEADS * m.QK_NOPE_HEAD_DIM, m.KV_LORA_RANK).t()).view(
        num_prefix_tokens, m.NUM_HEADS, m.QK_NOPE_HEAD_DIM
    )
    v = (c_kv @ w_uv.reshape(m.NUM_HEADS * m.V_HEAD_DIM, m.KV_LORA_RANK).t()).view(
        num_prefix_tokens, m.NUM_HEADS, m.V_HEAD_DIM
    )
    return k_nope, rows[:, m.KV_LORA_RANK :], v


def mla_chunked_prefill(
    m,
    q,
    k_nope,
    k_pe,
    v,
    cu_seqlens,
    max_seqlen,
    kv_cache,
    block_table,
    prefix_lens,
    w_uk,
    w_uv,
    *,
    softmax_scale=None,
    kv_scale=None,
    return_lse=False,
    out=None,
    lse=None,
    config=None,
    validate=None,
    num_prefix_tokens=None,
):
    """Chunked prefill: new tokens attend to their cached prefix and causally to themselves.

    New tokens (packed, like mla_prefill): q [T, H, Dn+Dr], k_nope [T, H, Dn], k_pe [T, Dr], v [T, H, Dv],
    cu_seqlens [B+1] int32, max_seqlen (host int). Token j of sequence b sits at position
    prefix_lens[b] + j. Cached prefix: kv_cache [num_pages, page_size, 1, Dc+Dr] (latent rows
    [c_kv ; k_pe]), block_table [B, max_pages] int32, prefix_lens [B] int32 (0 allowed); its first
    prefix_lens[b] positions are attended. w_uk [H, Dn, Dc], w_uv [H, Dv, Dc]: the up-projections
    (k_nope = W_UK c_kv, v = W_UV c_kv). Returns out [T, H, Dv] (and lse [H, T]): exactly attention over
    prefix + new tokens. kv_scale: for a float8_e4m3fn cache the layer's scale (as in mla_decode); the
    prefix is dequantised (stored * kv_scale) before it is expanded. None for a 16-bit cache.

    Steps: expand the prefix to MHA form, attend to it without a mask, attend causally among the new
    tokens, merge both through their LSEs (partials in fp32).
    num_prefix_tokens: sum(prefix_lens) as a host int, like max_seqlen (trusted unless validating); given,
    the call never synchronises with the device and can be captured in a CUDA graph; omitted, it is read
    from prefix_lens (one host synchronisation).
    validate: as in mla_prefill, and prefix_lens within the block table, its pages within the cache, their
    sum equal to num_prefix_tokens.
    config: as in mla_prefill, for both launches (default: each launch's tuned one, prefix and causal).

    The first calls with tensors of a given layout check everything and prepare the launches (prefix attention,
    new-token attention, merge: mla_chunked_prefill_checked); later calls of that layout and those scalars
    (chunked_prefill_signature), whatever their token counts, sequences, max_seqlen and prefix total, only expand
    their prefix and put their tensors and temporaries in, grids and sizes computed from them
    (mla_chunked_prefill_prepared). While torch.compile traces it, the call is the module's chunked prefill op.
    """
    if compiling():
        return mla_chunked_prefill_traced(
            m, q, k_nope, k_pe, v, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens, w_uk, w_uv,
            softmax_scale, kv_scale, return_lse, out, lse, config, validate, num_prefix_tokens,
        )  # fmt: skip
    arguments = (
        m, q, k_nope, k_pe, v, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens, w_uk, w_uv,
        softmax_scale, kv_scale, return_lse, out, lse, config, validate, num_prefix_tokens,
    )  # fmt: skip
    outputs = mla_chunked_prefill_prepared(*arguments) if _options().direct_launch else None
    if outputs is None:
        outputs = mla_chunked_prefill_checked(*arguments)
    return outputs if return_lse else outputs[0]


#: the names of a chunked prefill call's tensors past the new tokens' (q, k_nope, k_pe, v, cu_seqlens, out, lse)
_CHUNKED_INPUT_NAMES = ("kv_cache", "block_table", "prefix_lens", "w_uk", "w_uv")


def chunked_prefill_signature(inputs, addresses, max_seqlen, num_prefix_tokens, softmax_scale, return_lse, config):
    """What a chunked prefill call's launches depend on besides where its tensors are and the sizes the launches
    take per call: prefill_signature's of its new tokens' tensors (q, k_nope, k_pe, v, cu_seqlens, out, lse) and
    scalars; the layouts of kv_cache, w_uk and w_uv (whole: layout_signature), and of block_table and prefix_lens
    but their sequence count (_token_layouts); and the prefix total's classes (_size_classes: the expanded prefix's
    rows, no prefix keys at all). The call's temporaries (_chunked_temporaries) follow in layout from these, as
    the per-call path checks. kv_scale goes into the expansion alone (torch's work, per call)."""
    kv_cache, block_table, prefix_lens, w_uk, w_uv = inputs[7:12]
    return (
        "chunked",
        *_size_classes(num_prefix_tokens),
        *prefill_signature(inputs, addresses, max_seqlen, softmax_scale, return_lse, config),
        *layout_signature((kv_cache, w_uk, w_uv), (addresses[7], addresses[10], addresses[11])),
        *_token_layouts((block_table, prefix_lens), addresses[8:10]),
    )


def _temporaries_layout(temporaries, addresses):
    """The layouts of a chunked prefill call's temporaries (_chunked_temporaries; addresses: their data_ptr()) but
    their sizes: cu_prefix, the expanded prefix and the partial outputs by _token_layouts, the partial LSEs by
    _lse_layout. Prepared launches take the temporaries as their tensors: a later call's must lie alike."""
    cu_prefix, pre_k_nope, pre_k_pe, pre_v, o_prefix, lse_prefix, o_new, lse_new = temporaries
    return (
        *_token_layouts(
            (cu_prefix, pre_k_nope, pre_k_pe, pre_v, o_prefix, o_new), [addresses[i] for i in (0, 1, 2, 3, 4, 6)]
        ),
        _lse_layout(lse_prefix, addresses[5]),
        _lse_layout(lse_new, addresses[7]),
    )


def _chunked_temporaries(m, kv_cache, block_table, prefix_lens, num_prefix_tokens, w_uk, w_uv, kv_scale, num_tokens):
    """A chunked prefill call's temporaries, made alike by the checked and the prepared call (so of one layout per
    signature): cu_prefix, the expanded prefix (k_nope, k_pe, v: expand_latent_prefix's gathers and GEMMs), and the
    fp32 partial outputs and LSEs of the prefix and new-token attentions (NaN with the poison_workspace option)."""
    device = block_table.device
    cu_prefix = torch.zeros(prefix_lens.shape[0] + 1, dtype=torch.int32, device=device)
    cu_prefix[1:] = torch.cumsum(prefix_lens, 0, dtype=torch.int32)
    pre_k_nope, pre_k_pe, pre_v = _expand_latent_prefix(
        m, kv_cache, block_table, cu_prefix, num_prefix_tokens, w_uk, w_uv, kv_scale
    )
    o_prefix = torch.empty((num_tokens, m.NUM_HEADS, m.V_HEAD_DIM), dtype=torch.float32, device=device)
    lse_prefix = torch.empty((m.NUM_HEADS, num_tokens), dtype=torch.float32, device=device)
    o_new = torch.empty_like(o_prefix)
    lse_new = torch.empty_like(lse_prefix)
    if _options().poison_workspace:
        for workspace in (o_prefix, lse_prefix, o_new, lse_new):
            workspace.fill_(float("nan"))
    return [cu_prefix, pre_k_nope, pre_k_pe, pre_v, o_prefix, lse_prefix, o_new, lse_new]


def _validate_chunked(m, q, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens, num_prefix_tokens):
    """A chunked prefill's index values (validating): cu_seqlens and max_seqlen, the prefixes' pages, and
    num_prefix_tokens (where given) their sum."""
    _validate_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen)
    _validate_pages(block_table, prefix_lens, "prefix_lens", kv_cache.shape[0], m.PAGE_SIZE)
    total = int(prefix_lens.sum())
    _check(
        num_prefix_tokens in (None, total),
        "num_prefix_tokens",
        f"{num_prefix_tokens} is not the sum of prefix_lens ({total})",
    )


def mla_chunked_prefill_prepared(
    m, q, k_nope, k_pe, v, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens, w_uk, w_uv, softmax_scale,
    kv_scale, return_lse, out, lse, config, validate, num_prefix_tokens,
):  # fmt: skip
    """mla_chunked_prefill's per-call path: (out, lse) of a call whose tensors and scalars have the signature
    (chunked_prefill_signature) of an earlier, fully checked call: the prefix expanded and the temporaries made
    (_chunked_temporaries, as that call made them), then its launches with this call's tensors, temporaries,
    grids and sizes (the launches' call_values). Checked again: the sizes against one another
    (prepared_sizes_agree: block_table and prefix_lens of the batch too), kv_scale (resolve_kv_scale), index
    values where validating, given out / lse against the call's memory, the temporaries' layouts against the
    preparing call's. None where there is no such call (num_prefix_tokens not given: always), or the arguments are
    of a kind or size the checks would reject, or a layout or size falls outside what was prepared:
    mla_chunked_prefill then checks everything."""
    if (
        type(num_prefix_tokens) is not int
        or num_prefix_tokens < 0
        or not _prepared_scalars(max_seqlen, softmax_scale, return_lse, config)
    ):
        return None
    inputs = [q, k_nope, k_pe, v, cu_seqlens, out, lse, kv_cache, block_table, prefix_lens, w_uk, w_uv]
    addresses, signature = _call_signature(
        inputs, chunked_prefill_signature, max_seqlen, num_prefix_tokens, softmax_scale, return_lse, config
    )
    prepared = m._PREFILL_LAUNCHES.get(signature)
    # (None: seen once; False: not reusable; the block table's and prefix lengths' rows: 8, 9)
    if not prepared or not prepared_sizes_agree(inputs, max_seqlen, (8, 9)):
        return None
    launches, temporaries_layout = prepared
    device = q.device
    kv_scale = resolve_kv_scale(m, kv_scale, device, validate)
    if _validating(validate, device):
        _validate_chunked(m, q, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens, num_prefix_tokens)
    _check_given_outputs_apart(inputs)
    temporaries = _chunked_temporaries(
        m, kv_cache, block_table, prefix_lens, num_prefix_tokens, w_uk, w_uv, kv_scale, q.shape[0]
    )
    temporary_addresses = [tensor.data_ptr() for tensor in temporaries]
    if _temporaries_layout(temporaries, temporary_addresses) != temporaries_layout:
        return None
    inputs += temporaries
    addresses += temporary_addresses
    return _launch_prepared_prefill(m, launches, inputs, addresses, max_seqlen, return_lse, device)


def mla_chunked_prefill_checked(
    m, q, k_nope, k_pe, v, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens, w_uk, w_uv, softmax_scale,
    kv_scale, return_lse, out, lse, config, validate, num_prefix_tokens,
):  # fmt: skip
    """mla_chunked_prefill where no launches prepared by an earlier call fit: every argument checked, the launches
    prepared (kept in m._PREFILL_LAUNCHES for later calls of this signature where they can be reused; only where
    num_prefix_tokens is given) and issued."""
    signature = None
    given = (q, k_nope, k_pe, v, cu_seqlens, out, lse, kv_cache, block_table, prefix_lens, w_uk, w_uv)
    if (
        _options().direct_launch
        and type(num_prefix_tokens) is int
        and _prepared_scalars(max_seqlen, softmax_scale, return_lse, config)
    ):  # (out / lse it allocates count as not given)
        signature = _call_signature(
            given, chunked_prefill_signature, max_seqlen, num_prefix_tokens, softmax_scale, return_lse, config
        )[1]
    num_tokens = _check_mha_inputs(m, q, k_nope, k_pe, v)
    device = q.device
    _check_flag(return_lse, "return_lse")
    _check_cu_seqlens(cu_seqlens, "cu_seqlens", device)
    batch = cu_seqlens.shape[0] - 1
    _check_max_seqlen(max_seqlen, num_tokens)
    backend, _ = prefill_backend(m, device, knobs_given=config is not None)
    config = _checked_prefill_config(m, backend, config)
    check_paged_cache(m, kv_cache, device)
    kv_scale = resolve_kv_scale(m, kv_scale, device, validate)
    _check_per_sequence(block_table, "block_table", batch, device, ndim=2)
    _check_per_sequence(prefix_lens, "prefix_lens", batch, device, ndim=1)
    _check_up_projections(m, w_uk, w_uv, device)
    if num_prefix_tokens is not None:
        _check_host_int(num_prefix_tokens, "num_prefix_tokens")
    if _validating(validate, device):
        _validate_chunked(m, q, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens, num_prefix_tokens)
    if num_prefix_tokens is None:
        prefix = prefix_lens.tolist()  # host sync: the expanded prefix is sized by its total length
        _check(min(prefix) >= 0, "prefix_lens", f"must be >= 0, got {prefix}")
        num_prefix_tokens = sum(prefix)
    out, lse = _prefill_outputs(m, num_tokens, device, out, lse, return_lse)
    _check_no_overlap(
        (("out", out), ("lse", lse)),
        (
            ("q", q),
            ("k_nope", k_nope),
            ("k_pe", k_pe),
            ("v", v),
            ("cu_seqlens", cu_seqlens),
            ("kv_cache", kv_cache),
            ("block_table", block_table),
            ("prefix_lens", prefix_lens),
            ("w_uk", w_uk),
            ("w_uv", w_uv),
        ),
    )
    scale = resolve_softmax_scale(m, softmax_scale)
    temporaries = _chunked_temporaries(
        m, kv_cache, block_table, prefix_lens, num_prefix_tokens, w_uk, w_uv, kv_scale, num_tokens
    )
    cu_prefix, pre_k_nope, pre_k_pe, pre_v, o_prefix, lse_prefix, o_new, lse_new = temporaries
    recorded = _Recorded()
    _launch_prefill_on(
        m, backend, q, pre_k_nope, pre_k_pe, pre_v, cu_seqlens, cu_prefix, max_seqlen, o_prefix, lse_prefix, scale,
        False, config, recorded,
    )  # fmt: skip
    _launch_prefill_on(
        m, backend, q, k_nope, k_pe, v, cu_seqlens, cu_seqlens, max_seqlen, o_new, lse_new, scale, True, config,
        recorded,
    )  # fmt: skip
    _launch_merge(m, out, lse, o_prefix, lse_prefix, o_new, lse_new, recorded)
    if signature is not None:
        inputs = (*given[:5], out, lse, *given[7:], *temporaries)  # (out, lse as allocated)
        addresses = [tensor.data_ptr() for tensor in temporaries]
        _keep_prefill_launches(m, signature, recorded, inputs, _temporaries_layout(temporaries, addresses))
    return out, lse


# ---- cache write --------------------------------------------------------------------------------------


def mla_cache_write(m, c_kv, k_pe, kv_cache, slot_mapping, *, kv_scale=None, validate=None):
    """Write new tokens' latent rows into the paged cache (in place): like vLLM's concat_and_cache_mla.

    c_kv [T, Dc], k_pe [T, Dr], kv_cache [num_pages, page_size, 1, Dc+Dr], slot_mapping [T] int32/int64:
    token t goes to page slot_mapping[t] // page_size, row slot_mapping[t] % page_size (pages in any
    order); a negative slot skips the token (padding). Slots must be distinct. Returns kv_cache.
    kv_scale: for a float8_e4m3fn cache (CACHE_FORMAT.scaled) the layer's scale, a number or a float32 tensor of one
    element: rows are stored as fp8(row / kv_scale), rounded to nearest even and saturated at +-448 (finite
    rows never give NaN), bit for bit torch's `(row.float() / kv_scale).clamp(-448, 448).to(float8_e4m3fn)`.
    None (and only None) for a 16-bit cache.
    validate: check every slot is -1 or a row of the cache, and no row is written twice (default: on for
    CPU tensors or with MLAGEN_VALIDATE=1; on the GPU it costs a synchronisation).
    """
    if compiling():  # the op writes kv_cache in place (and returns nothing)
        m.ops.cache_write(c_kv, k_pe, kv_cache, slot_mapping, _op_kv_scale(m, kv_scale, c_kv.device), validate)
        return kv_cache
    _check_tensor(c_kv, "c_kv", ndim=2, dtype=m.DTYPE, last_dim=m.KV_LORA_RANK)
    device = c_kv.device
    _check_device(device, "c_kv")
    num_tokens = c_kv.shape[0]
    _check_tensor(k_pe, "k_pe", ndim=2, dtype=m.DTYPE, device=device, last_dim=m.QK_ROPE_HEAD_DIM)
    _check(k_pe.shape[0] == num_tokens, "k_pe", f"expected {num_tokens} tokens, got shape {tuple(k_pe.shape)}")
    check_paged_cache(m, kv_cache, device)
    kv_scale = resolve_kv_scale(m, kv_scale, device, validate)
    _check(
        isinstance(slot_mapping, torch.Tensor) and slot_mapping.dtype in (torch.int32, torch.int64),
        "slot_mapping",
        "expected an int32 or int64 torch.Tensor",
    )
    _check_tensor(slot_mapping, "slot_mapping", ndim=1, dtype=slot_mapping.dtype, device=device)
    _check(
        slot_mapping.shape[0] == num_tokens,
        "slot_mapping",
        f"expected {num_tokens} slots, got shape {tuple(slot_mapping.shape)}",
    )
    if num_tokens > 0 and _validating(validate, device):
        rows = kv_cache.shape[0] * m.PAGE_SIZE
        _validate_range(slot_mapping, "slot_mapping", -1, rows - 1, "a slot (-1: skip the token)")
        written = slot_mapping[slot_mapping >= 0]
        distinct, counts = torch.unique(written, return_counts=True)
        twice = distinct[counts > 1]
        if twice.numel():
            raise ValueError(f"slot_mapping: slot {int(twice[0])} is written by more than one token")
        _check_no_overlap(
            (("kv_cache", kv_cache),),
            (("c_kv", c_kv), ("k_pe", k_pe), ("slot_mapping", slot_mapping), ("kv_scale", kv_scale)),
        )
    if num_tokens > 0:
        _launch(
            m._mla_cache_write_kernel,
            (cdiv(num_tokens, m.CACHE_WRITE_BLOCK_T),),
            kv_cache,
            c_kv,
            k_pe,
            slot_mapping,
            kv_scale,
            num_tokens,
            kv_cache.stride(0),
            kv_cache.stride(1),
            c_kv.stride(0),
            k_pe.stride(0),
            num_warps=4,
            **_cache_row_constexprs(m),
        )
    return kv_cache
