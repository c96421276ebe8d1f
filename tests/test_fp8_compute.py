"""The spec option cache_compute (exact | fp8) and the Gluon decode's fp8 tensor-core products it selects.

On the CPU: the option validates, reaches the plan, `mlagen show` and the hash, renders for every bundled fp8
spec (the source compiles to bytecode), leaves the exact path's rendering as it was, and (offline, no GPU) the
fp8 kernel compiles for sm_90a with e4m3 warpgroup MMAs. On a Hopper GPU: the fp8 decode against the float64
reference on the dequantised cache, within a bound chosen before any run.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import DEEPSEEK_V3_TP8_SPEC, import_source

from mlagen_compiler import compile_spec, runtime
from mlagen_compiler.module_file import module_source
from mlagen_compiler.plan import lower
from mlagen_compiler.registry import registered_specs, resolve_spec
from mlagen_compiler.spec import SpecError, spec_from_dict
from mlagen_compiler.verify import decode_reference, make_decode_inputs, poison_unused_cache

FP8 = "float8_e4m3fn"
ROOT = Path(__file__).resolve().parent.parent
#: the bound of the fp8 products' decode against the float64 reference on the dequantised cache, chosen before
#: any run: relative Frobenius error of each call's whole output, and the largest LSE error (natural log)
FP8_COMPUTE_REL_NORM = 0.05
FP8_COMPUTE_LSE_ATOL = 0.05


def fp8_spec(**fields):
    return spec_from_dict({**DEEPSEEK_V3_TP8_SPEC, "name": "fp8-compute", "cache_dtype": FP8, **fields})


def bundled_fp8_specs():
    return [name for name in sorted(registered_specs()) if resolve_spec(name).cache_format.scaled]


def with_fp8_compute(spec):
    """A bundled spec with cache_compute fp8 (its other fields as they are)."""
    return spec_from_dict({**spec.to_flat_dict(), "name": f"{spec.name}-mma", "cache_compute": "fp8"})


# ---- the option --------------------------------------------------------------------------------------------


def test_cache_compute_defaults_to_exact_and_leaves_the_hash_as_it_was():
    spec = fp8_spec()
    assert spec.cache_compute == "exact"
    assert "cache_compute" not in spec.to_flat_dict()  # (so every existing spec's hash and module stay)
    explicit = fp8_spec(cache_compute="exact")
    assert explicit.content_hash() == spec.content_hash()
    assert fp8_spec(cache_compute="fp8").content_hash() != spec.content_hash()
    # the flat dict round-trips, the option included
    fp8 = fp8_spec(cache_compute="fp8")
    assert spec_from_dict(fp8.to_flat_dict()) == fp8


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(cache_dtype="bfloat16", cache_compute="fp8"), ["cache_compute=fp8", "cache_dtype=bfloat16", "exact"]),
        (dict(cache_dtype=None, cache_compute="fp8"), ["cache_compute=fp8", "cache_dtype=bfloat16", FP8]),
        (dict(cache_compute="int8"), ["cache_compute", "int8", "'exact'", "'fp8'"]),
        (dict(cache_compute=8), ["cache_compute", "8"]),
    ],
)
def test_cache_compute_rejects_a_bad_value_in_one_line(fields, words):
    with pytest.raises(SpecError) as info:
        fp8_spec(**fields)
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


def test_cache_compute_reaches_the_plan_and_mlagen_show():
    exact, fp8 = lower(fp8_spec()), lower(fp8_spec(cache_compute="fp8"))
    assert exact.cache_compute == "exact" and not exact.decode.gluon.fp8_compute
    assert fp8.cache_compute == "fp8" and fp8.decode.gluon.fp8_compute, fp8.decode.gluon.fp8_compute_reason
    assert fp8.decode.gluon.fp8_land_slots >= 2 and fp8.decode.gluon.fp8_stages >= 2
    summary = fp8.summary()
    assert summary["cache_compute"] == "fp8"
    assert "e4m3 tensor-core products" in summary["decode"]["backend"]
    assert "portable Triton kernel keeps the exact path" in summary["decode"]["cache_compute"]
    assert "cache_compute" not in exact.summary()["decode"]
    # a geometry the Gluon decode does not take: exact everywhere, and the plan says why
    odd = lower(fp8_spec(kv_lora_rank=96, qk_rope_head_dim=16, cache_compute="fp8"))
    assert not odd.decode.gluon.fp8_compute
    assert odd.decode.gluon.fp8_compute_reason
    assert "exact everywhere" in odd.summary()["decode"]["cache_compute"]


@pytest.mark.parametrize("name", bundled_fp8_specs())
def test_every_bundled_fp8_spec_renders_the_fp8_kernel(name):
    spec = with_fp8_compute(resolve_spec(name))
    assert lower(spec).decode.gluon.fp8_compute
    source = module_source(spec)
    assert "def _mla_decode_gluon_fp8_kernel(" in source and "DECODE_GLUON_FP8_COMPUTE = True" in source
    assert "def _mla_decode_gluon_kernel(" in source  # (the exact kernel: launches TMA cannot box)
    compile(source, f"<{spec.name}>", "exec")


def _stable_lines(source, spec):
    """The module's lines but those naming the spec, its hash or the generator's (they differ by construction)."""
    spec_bits = (spec.content_hash(), spec.name, spec.module_name)
    return [
        line
        for line in source.splitlines()
        if not any(bit in line for bit in spec_bits) and not line.startswith(("OPS_NAMESPACE", "SPEC = "))
    ]


@pytest.mark.parametrize("name", bundled_fp8_specs())
def test_the_exact_path_renders_as_before(name):
    """cache_compute fp8 only adds to a module: every line of the exact module is there, in order, and nothing
    of the fp8 kernel is in the exact one (generated/ holds the exact modules: test_render checks them)."""
    spec = resolve_spec(name)
    exact = module_source(spec)
    assert "_gluon_f8_" not in exact and "FP8_COMPUTE" not in exact and "cache_compute" not in exact
    fp8_spec_ = with_fp8_compute(spec)
    a, b = _stable_lines(exact, spec), _stable_lines(module_source(fp8_spec_), fp8_spec_)
    changes = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    assert changes and all(tag == "insert" for tag, *_ in changes), changes[:3]


def test_the_schedule_takes_the_fp8_products_where_the_module_has_them(tmp_path):
    module = import_source(module_source(with_fp8_compute(resolve_spec("deepseek-v3-tp8-fp8"))), tmp_path, "mma")
    assert module.DECODE_GLUON_FP8_COMPUTE
    assert runtime.gluon_fp8_compute(module, config_given=False)
    assert not runtime.gluon_fp8_compute(module, config_given=True)  # (a forced tile: the exact kernel as given)
    exact = import_source(module_source(resolve_spec("deepseek-v3-tp8-fp8")), tmp_path, "exact")
    assert not runtime.gluon_fp8_compute(exact, config_given=False)
    # pages smaller than a block: TMA cannot box them, the exact kernel runs
    small_pages = import_source(module_source(fp8_spec(page_size=16, cache_compute="fp8")), tmp_path, "pages16")
    assert not runtime.gluon_fp8_compute(small_pages, config_given=False)


@pytest.mark.parametrize(
    ("name", "seqlen_q"), [("deepseek-v3-tp8-fp8", 2), ("mistral-small-4-fp8", 2), ("deepseek-v3-tp8-fp8", 1)]
)
def test_the_fp8_kernel_compiles_for_sm90_with_e4m3_mmas(tmp_path, name, seqlen_q):
    """Offline (Triton's front end, passes and ptxas; no GPU), in a process of its own: the fp8 kernel compiles,
    its SASS holds e4m3 warpgroup MMAs (QGMMA) and no 16-bit ones, and (without the fused merge's stack frame)
    nothing goes to local memory but a few of the prologue's values held there for the partitions (stored once,
    loaded once at a partition's start, as the exact kernel's): DeepSeek's 16 query rows at Sq 1, the narrow form
    (m64n16 MMAs, a launch of 16 warps), up to 4; the wide form up to 2 (two of the converters' shared addresses,
    computed in the prologue)."""
    spec = with_fp8_compute(resolve_spec(name))
    module = import_source(module_source(spec), tmp_path, "probe")
    if module._GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon kernels are not defined under this Triton: {module._GLUON_IMPORT_ERROR}")
    path = compile_spec(spec, tmp_path / "out")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    tool = ROOT / "benchmarks" / "gluon_offline_compile.py"
    done = subprocess.run(
        [sys.executable, str(tool), str(path), "--fp8-compute", "--sq", str(seqlen_q), "--combine-kernel"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    narrow = spec.num_heads * seqlen_q <= 16
    assert re.search(r"'QGMMA\.64x16x32': \d+" if narrow else r"'QGMMA\.64x\d+x32': \d+", done.stdout), done.stdout
    assert "HGMMA" not in done.stdout, done.stdout
    stores = int(re.search(r"'STL': (\d+)", done.stdout).group(1))
    assert stores <= (4 if narrow else 2), done.stdout


def emulate_fp8_products(q, latent, kv_scale, softmax_scale, dc, terms):
    """(out, lse) of one sequence as the fp8 kernel rounds them, in float64: q [rows, Dc + Dr] (bfloat16 values),
    latent [positions, Dc + Dr] the stored e4m3 values, kv_scale; the query as `terms` e4m3 terms with a scale a
    row, P = exp(s - m) * 2**8 rounded to e4m3, l the sum of the rounded P (the accumulators exact)."""
    scale = q.abs().amax(1, keepdim=True) / 448
    q8 = (q / scale).to(torch.float8_e4m3fn).double()
    if terms == 2:
        q8 = q8 + (q / scale - q8).to(torch.float8_e4m3fn).double()
    s = (q8 @ latent.T) * scale * kv_scale * softmax_scale
    m = s.amax(1, keepdim=True)
    p8 = (torch.exp(s - m) * 256.0).to(torch.float8_e4m3fn).double()
    sums = p8.sum(1, keepdim=True)
    return (p8 @ latent[:, :dc]) * kv_scale / sums, (m + torch.log(sums) - 8 * math.log(2)).squeeze(1)


@pytest.mark.parametrize("name", ["deepseek-v3-tp8-fp8", "mistral-small-4-fp8"])
def test_the_fp8_rounding_model_meets_the_bound(name):
    """The kernel's rounding (plan.FP8_QUERY_TERMS e4m3 terms of the query, P in e4m3), emulated in float64 on the
    GPU test's data (N(0, 1) query and latent, kv_scale = max / 448), within the GPU test's bound at 64 to 8192
    positions. With one query term DeepSeek-V3's geometry is not (0.048-0.059 relative, LSE 0.06-0.12 off): the
    reason the plan takes two."""
    spec = resolve_spec(name)
    terms = lower(with_fp8_compute(spec)).decode.gluon.fp8_query_terms
    assert terms == 2
    dc, width = spec.kv_lora_rank, spec.kv_lora_rank + spec.qk_rope_head_dim
    scale = spec.derived_softmax_scale()
    g = torch.Generator().manual_seed(5)
    for positions in (64, 700, 8192):
        latent = torch.randn(positions, width, generator=g, dtype=torch.float64)
        kv_scale = float(latent.abs().max()) / 448
        stored = (latent / kv_scale).to(torch.float8_e4m3fn).double()
        q = torch.randn(2 * spec.num_heads, width, generator=g).to(torch.bfloat16).double()
        scores = q @ (stored * kv_scale).T * scale
        want, want_lse = torch.softmax(scores, 1) @ (stored[:, :dc] * kv_scale), torch.logsumexp(scores, 1)
        out, lse = emulate_fp8_products(q, stored, kv_scale, scale, dc, terms)
        rel = float((out - want).norm() / want.norm())
        lse_err = float((lse - want_lse).abs().max())
        assert rel <= FP8_COMPUTE_REL_NORM / 2 and lse_err <= FP8_COMPUTE_LSE_ATOL / 2, (positions, rel, lse_err)


def fp8_mma_chain(a, b, bits=13):
    """a [R, K] @ b [P, K]^T, both e4m3 values in float64, as a model of a chain of Hopper e4m3 warpgroup MMAs:
    per K step of 32, the 32 products and the running fp32 sum aligned to the largest of them and truncated
    (toward 0) to `bits` bits below its leading bit, then summed and rounded to fp32 (DeepSeek-V3's report: about
    14 bits kept on the H800; 13 reproduces the GPU's LSE errors at DeepSeek's geometry)."""
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    for k in range(0, a.shape[1], 32):
        terms = torch.cat([acc[..., None], a[:, None, k : k + 32] * b[None, :, k : k + 32]], -1)
        top = terms.abs().amax(-1, keepdim=True)
        quantum = torch.exp2(torch.floor(torch.log2(torch.where(top > 0, top, torch.ones_like(top)))) + 1 - bits)
        acc = (torch.trunc(terms / quantum) * quantum).sum(-1).float().double()
    return acc


def test_the_fp8_accumulation_model_favours_the_lo_term_first():
    """The Q K^T chain of the two query terms under a model of the tensor cores' fp8 accumulation (fp8_mma_chain):
    with the hi term first, the lo term's small products are added to a sum 2**4 larger and mostly truncated away
    (the GPU's LSE errors at DeepSeek H16 / H128 B128 S8192, 0.035-0.057, against 0.01 for exact accumulators); the
    kernel chains the lo term first, which keeps its products at their own scale. Scores at DeepSeek-V3's scale."""
    spec = resolve_spec("deepseek-v3-tp8-fp8")
    width, scale = spec.kv_lora_rank + spec.qk_rope_head_dim, spec.derived_softmax_scale()
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(512, width, generator=g, dtype=torch.float64)
    kv_scale = 6.0 / 448
    k8 = (latent / kv_scale).to(torch.float8_e4m3fn).double()
    q = torch.randn(16, width, generator=g).to(torch.bfloat16).double()
    q_scale = q.abs().amax(1, keepdim=True) / 448
    hi = (q / q_scale).to(torch.float8_e4m3fn).double()
    lo = (q / q_scale - hi).to(torch.float8_e4m3fn).double()
    exact = (hi + lo) @ k8.T

    def score_error(first, second):
        chained = fp8_mma_chain(torch.cat([first, second], 1), torch.cat([k8, k8], 1))
        return float(((chained - exact) * q_scale * kv_scale * scale).pow(2).mean().sqrt())

    hi_first, lo_first = score_error(hi, lo), score_error(lo, hi)
    print(f"fp8 accumulation model: RMS score error hi first {hi_first:.4f}, lo first {lo_first:.4f}")
    assert lo_first < 0.5 * hi_first, (hi_first, lo_first)


# ---- on a Hopper GPU ------------------------------------------------------------------------------------------


def prmt_b32(a, b, selector):
    """PTX prmt.b32 in its default mode, elementwise on uint32 arrays: result byte i is byte (nibble i & 7) of the
    pair {b, a} (a's bytes 0-3, b's 4-7), or with the nibble's bit 3 set that byte's sign bit copied 8 times."""
    pair = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint32)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = ((pair >> np.uint64(8 * (nibble & 7))) & np.uint64(0xFF)).astype(np.uint32)
        if nibble & 8:
            byte = np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0))
        out |= byte << np.uint32(8 * i)
    return out


def run_prmt_asm(asm, inputs):
    """The rendered inline PTX of the V^T transpose (only prmt.b32 and .reg lines) run on uint32 arrays: inputs
    bind $4.. (after the 4 outputs $0..$3); returns the outputs."""
    regs = {f"${4 + i}": x for i, x in enumerate(inputs)}
    body = asm.strip().removeprefix("{").removesuffix("}")
    for line in filter(None, (part.strip() for part in body.split(";"))):
        if line.startswith(".reg"):
            continue
        op, operands = line.split(None, 1)
        assert op == "prmt.b32", line
        dst, a, b, selector = (x.strip() for x in operands.split(","))
        regs[dst] = prmt_b32(regs[a], regs[b], int(selector, 0))
    return [regs[f"${i}"] for i in range(4)]


@pytest.mark.parametrize("n_valid", [64, 37, 1])
def test_the_vt_write_transposes_the_box_exactly(tmp_path, n_valid):
    """_gluon_f8_write_vt as numpy: a landed [64 positions, 64 columns] box of random bytes as 32-bit words, the
    positions >= n_valid zeroed, the rendered prmt.b32 transpose (_GLUON_F8_VT_ASM, its selectors
    _GLUON_F8_VT_PRMT) on every 4 positions' word, the index renamed as the kernel's reshape / permute, gives V^T
    byte for byte; and the read layout (_gluon_f8_vt_layout) holds 4 consecutive positions in registers 0-3."""
    module = import_source(module_source(with_fp8_compute(resolve_spec("deepseek-v3-tp8-fp8"))), tmp_path, "vt")
    if module._GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon kernels are not defined under this Triton: {module._GLUON_IMPORT_ERROR}")
    asm = getattr(module._GLUON_F8_VT_ASM, "value", module._GLUON_F8_VT_ASM)
    for step in module._GLUON_F8_VT_PRMT:
        for selector in step:
            assert f"{selector:#06x}" in asm
    rng = np.random.default_rng(n_valid)
    box = rng.integers(0, 256, size=(64, 64), dtype=np.uint8)
    words = box.view("<u4").copy()  # [64 positions, 16 words]: word w of a row is columns 4w..4w + 3
    words[n_valid:] = 0
    quads = words.reshape(16, 4, 16)  # (p, k, w): position 4p + k
    cols = np.stack(run_prmt_asm(asm, [quads[:, k] for k in range(4)]), axis=1)  # (p, k, w): register k's output
    vt = cols.transpose(2, 1, 0).reshape(64, 16)  # the kernel's reshape / permute: (V^T row 4w + k, word p)
    expected = box.copy()
    expected[n_valid:] = 0
    np.testing.assert_array_equal(vt.astype("<u4").view(np.uint8).reshape(64, 64), expected.T)

    from triton._C.libtriton import gluon_ir, ir, nvidia
    from triton.experimental.gluon.language._semantic import GluonSemantic

    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    semantic = GluonSemantic(gluon_ir.GluonOpBuilder(ctx))
    for warps in (4, 2):
        linear = semantic.to_linear_layout(module._gluon_f8_vt_layout(warps), [warps // 2, 64, 16]).value
        assert linear.reg_bases[:2] == [[0, 1, 0], [0, 2, 0]], linear.reg_bases


def _linear_bases(semantic, layout, shape):
    linear = semantic.to_linear_layout(layout, shape).value
    return {"reg": linear.reg_bases, "lane": linear.lane_bases, "warp": linear.warp_bases}


def _linear_at(bases, reg, lane, warp):
    """The coordinate a linear layout gives register reg of lane lane of warp warp (XOR of the set bits' bases)."""
    at = np.zeros(len(bases["reg"][0]), dtype=np.int64)
    for kind, index in (("reg", reg), ("lane", lane), ("warp", warp)):
        for bit, basis in enumerate(bases[kind]):
            if index >> bit & 1:
                at ^= np.asarray(basis)
    return tuple(int(x) for x in at)


@pytest.mark.parametrize("n_valid", [64, 37])
def test_the_narrow_pv_operand_holds_v_in_sigma_and_pi_order(tmp_path, n_valid):
    """_gluon_f8_v_operand as numpy: the half's 4 landed boxes of random bytes read as words in the read layout
    (_gluon_f8_va_read_layout), positions >= n_valid zeroed, the rendered prmt.b32 transpose on each 4 registers,
    the kernel's renames (_GLUON_F8_VA_T_PERM, _GLUON_F8_VA_SIGMA_PERM) give A[m, kappa] = V[pi(kappa),
    sigma(m)] (sigma: _gluon_f8_sigma, a bijection; pi: _GLUON_F8_PI_PERM, P's store); every thread ends up
    holding exactly the A words it loaded itself (the conversions to the dot operand move no data); the bytes
    layout is the dot operand's; the reads take no extra bank wavefronts (Triton's counter); and the output store's
    sigma undoes the rows' order: O^T[sigma(m)] = (V^T P^T)."""
    module = import_source(module_source(with_fp8_compute(resolve_spec("deepseek-v3-tp8-fp8"))), tmp_path, "va")
    if module._GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon kernels are not defined under this Triton: {module._GLUON_IMPORT_ERROR}")
    from triton._C.libtriton import gluon_ir, ir, nvidia
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._semantic import GluonSemantic

    value = lambda x: getattr(x, "value", x)  # noqa: E731
    sigma = np.asarray(module._gluon_f8_sigma.fn(np.arange(256)))
    assert sorted(sigma) == list(range(256))
    assert [int(sigma[1 << b]) for b in range(8)] == [1 << value(module._GLUON_F8_VA_SIGMA_BITS).index(b) for b in
                                                      range(8)]  # fmt: skip
    pi = np.arange(64).reshape([2] * 6).transpose(value(module._GLUON_F8_PI_PERM)[:6]).reshape(64)
    # the renames on the cols tensor's flat index [box, position, word] -> [m, K word]
    flat = np.arange(4 * 64 * 16).reshape(4, 2, 2, 2, 2, 2, 2, 16).transpose(value(module._GLUON_F8_VA_T_PERM))
    flat = flat.reshape([2] * 8 + [16]).transpose(value(module._GLUON_F8_VA_SIGMA_PERM)).reshape(256, 16)

    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    semantic = GluonSemantic(gluon_ir.GluonOpBuilder(ctx))
    read = _linear_bases(semantic, module._gluon_f8_va_read_layout(), [4, 64, 16])
    words3 = _linear_bases(semantic, module._gluon_f8_va_bytes_layout(), [256, 16, 4])
    dot = gl.DotOperandLayout(0, module._gluon_f8_mma_layout(16), 4)
    operand = _linear_bases(semantic, dot, [256, 64])
    split = {kind: [[m, 4 * w + b] for m, w, b in bases] for kind, bases in words3.items()}
    assert split == operand, (split, operand)
    # the reads of the swizzled box: no extra wavefronts by Triton's counter (benchmarks/probes/fp8_pv_vregs.py: 32
    # a box, the floor)
    words_layout = value(module._GLUON_F8_WORDS_LAYOUT)
    builder = semantic.builder
    conflicts = builder.get_shared_bank_conflicts(
        module._gluon_f8_va_read_layout()._to_ir(builder), words_layout._to_ir(builder), [4, 64, 16], 32
    )
    assert conflicts == 0, conflicts

    rng = np.random.default_rng(n_valid)
    v = rng.integers(0, 256, size=(64, 256), dtype=np.uint8)  # V [positions, the half's columns]
    v[n_valid:] = 0
    words = v.reshape(64, 4, 64).transpose(1, 0, 2).copy().view("<u4")  # [box, position, word]
    asm = value(module._GLUON_F8_VT_ASM)
    cols = np.zeros_like(words)
    for warp in range(4):
        for lane in range(32):
            held = set()
            for group in range(8):  # registers 4 group.. 4 group + 3: one transpose's inputs, then its outputs
                at = [_linear_at(read, 4 * group + k, lane, warp) for k in range(4)]
                outs = run_prmt_asm(asm, [np.asarray([words[a]], dtype=np.uint32) for a in at])
                for a, out in zip(at, outs, strict=True):
                    cols[a] = out[0]
                    held.add(int(np.ravel_multi_index(a, words.shape)))
            # the A words this thread holds (the bytes layout's K bit 0 and 1 registers: one word)
            mine = set()
            for reg in range(0, 128, 4):
                m, w, _ = _linear_at(words3, reg, lane, warp)
                mine.add(int(flat[m, w]))
            assert mine == held, (warp, lane)
    a = cols.reshape(-1)[flat].astype("<u4").view(np.uint8).reshape(256, 64)
    np.testing.assert_array_equal(a, v[pi][:, sigma].T)  # A[m, kappa] = V[pi(kappa), sigma(m)]
    p = rng.standard_normal((16, 64))
    out = np.empty((256, 16))
    out[sigma] = a.astype(np.float64) @ p[:, pi].T  # row m stored to column sigma(m); P^T's row kappa: P[:, pi(kappa)]
    np.testing.assert_allclose(out, v.astype(np.float64).T @ p.T)


def _require_fp8_gluon(module, device):
    if device.type != "cuda":
        pytest.skip("GPU only: the Gluon decode does not run in the interpreter")
    backend, reason = module.decode_backend(device, "auto")
    if backend != "gluon":
        pytest.skip(f"Gluon decode cannot run here: {reason}")


#: (heads, Dc, Sq, lengths): DeepSeek-V3 TP8 and Mistral-Small-4 widths, lengths from one position to a few
#: thousand with last blocks partly and wholly filled (pages of 64)
GPU_CASES = [
    (16, 512, 1, [1, 63, 64, 65, 700, 2049]),
    (16, 512, 2, [2, 129, 1000, 4097, 31, 64]),
    (32, 256, 1, [5, 64, 191, 2500, 8, 1025]),
    (32, 256, 2, [3, 65, 700, 3001, 128, 17]),
]


@pytest.mark.parametrize("merge", ["fused", "kernel"])
@pytest.mark.parametrize(("heads", "dc", "seqlen_q", "seqlens"), GPU_CASES)
def test_fp8_compute_decode_within_its_bound(build_module, device, heads, dc, seqlen_q, seqlens, merge):
    """cache_compute fp8 on the Gluon decode against the float64 reference on the dequantised cache: random data
    (N(0, 1), never zeros), NaN in every unused cache slot (e4m3 0x7f) and in the outputs before the call. Each
    call's output within FP8_COMPUTE_REL_NORM (relative Frobenius norm), its LSE within FP8_COMPUTE_LSE_ATOL;
    no NaN or inf anywhere (so no poisoned output element survives)."""
    module = build_module(
        **{**DEEPSEEK_V3_TP8_SPEC, "name": "fp8-mma", "num_heads": heads, "kv_lora_rank": dc},
        cache_dtype=FP8,
        cache_compute="fp8",
    )
    _require_fp8_gluon(module, device)
    g = torch.Generator().manual_seed(1000 * heads + 10 * seqlen_q + len(merge))
    inputs = make_decode_inputs(module, seqlens, seqlen_q, g, device)
    poison_unused_cache(inputs)
    batch = len(seqlens)
    schedule = module.get_decode_schedule(batch, seqlen_q, device, merge=merge)
    assert schedule.backend == "gluon" and schedule.fp8_compute, schedule
    assert bool(schedule.narrow) == (heads * seqlen_q <= 16), schedule  # (both forms: 16 rows as the MMAs' N)
    out = torch.full((batch, seqlen_q, heads, dc), float("nan"), dtype=module.DTYPE, device=device)
    lse = torch.full((batch, heads, seqlen_q), float("nan"), dtype=torch.float32, device=device)
    module.mla_decode(**inputs, return_lse=True, schedule=schedule, out=out, lse=lse)
    torch.cuda.synchronize()
    want, want_lse = (t.double().cpu() for t in decode_reference(module, inputs))  # (it may run on the GPU)
    got = out.double().cpu()
    rel = float((got - want).norm() / want.norm())
    lse_err = float((lse.double().cpu() - want_lse).abs().max())
    print(f"fp8 products H{heads} Dc{dc} Sq{seqlen_q} {merge}: relative error {rel:.4f}, max LSE error {lse_err:.4f}")
    assert torch.isfinite(out).all(), "a NaN / inf (or a poisoned element) in the output"
    assert torch.isfinite(lse).all(), "a NaN / inf (or a poisoned element) in the LSE"
    assert rel <= FP8_COMPUTE_REL_NORM, f"relative error {rel:.4f} > {FP8_COMPUTE_REL_NORM}"
    assert lse_err <= FP8_COMPUTE_LSE_ATOL, f"max LSE error {lse_err:.4f} > {FP8_COMPUTE_LSE_ATOL}"


def _launch_for(module, kv_cache, seqlen_q=2, narrow=0):
    """The Gluon launch decode_gluon_split prepares for a cache_compute fp8 schedule (built, not launched: CPU
    tensors; the kernel's arguments bound by name)."""
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    batch = 3
    schedule = module.DecodeSchedule(
        batch, seqlen_q, module.DECODE_GLUON_BLOCK_M, 8, 1,
        (module.DECODE_GLUON_BLOCK_N, module.DECODE_GLUON_CONSUMER_REGS, module.DECODE_GLUON_FP8_STAGES), 132,
        backend="gluon", merge="fused", land_slots=module.DECODE_GLUON_FP8_LAND_SLOTS, fp8_compute=True,
        narrow=narrow,
    )  # fmt: skip
    q = torch.zeros(batch, seqlen_q, module.NUM_HEADS, width, dtype=module.DTYPE)
    table = torch.zeros(batch, 4, dtype=torch.int32)
    lens = torch.full((batch,), 100, dtype=torch.int32)
    out = torch.empty(batch, seqlen_q, module.NUM_HEADS, module.KV_LORA_RANK, dtype=module.DTYPE)
    lse = torch.empty(batch, module.NUM_HEADS, seqlen_q, dtype=torch.float32)
    inputs = (q, kv_cache, table, lens, out, lse, torch.ones(1))
    return runtime.decode_gluon_split(module, inputs, schedule.workspace("cpu"), 0.1, schedule, True, float("-inf"))


def test_the_fp8_launch_binds_every_kernel_argument(tmp_path):
    """decode_gluon_split gives the fp8 kernel exactly its arguments where TMA boxes the cache, and the exact
    kernel (the plan's ring, one block landing at a time) where it cannot."""
    module = import_source(module_source(with_fp8_compute(resolve_spec("deepseek-v3-tp8-fp8"))), tmp_path, "bind")
    if module._GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon kernels are not defined under this Triton: {module._GLUON_IMPORT_ERROR}")
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    cache = torch.zeros(8, module.PAGE_SIZE, 1, width, dtype=torch.float8_e4m3fn)
    launch = _launch_for(module, cache)
    assert launch.kernel is module._mla_decode_gluon_fp8_kernel
    assert len(launch.values) == len(module._mla_decode_gluon_fp8_kernel.arg_names)
    names = module._mla_decode_gluon_fp8_kernel.arg_names
    assert launch.values[names.index("STAGES")] == module.DECODE_GLUON_FP8_STAGES
    assert launch.values[names.index("SLOTS")] == module.DECODE_GLUON_FP8_LAND_SLOTS
    assert launch.values[names.index("Q_TERMS")] == module.DECODE_GLUON_FP8_QUERY_TERMS == 2
    assert launch.values[names.index("NARROW")] == 0
    narrow = _launch_for(module, cache, seqlen_q=1, narrow=16)
    assert narrow.kernel is module._mla_decode_gluon_fp8_kernel and narrow.values[names.index("NARROW")] == 16
    assert narrow.values[names.index("CONVERT_WARPS")] == module.DECODE_GLUON_NARROW_LAND_WARPS
    # rows off the [pages * page_size, Dc + Dr] matrix TMA boxes: the exact kernel, rows loaded by its converters
    wide = torch.zeros(8, module.PAGE_SIZE, 1, width + 16, dtype=torch.float8_e4m3fn)[..., :width]
    fallback = _launch_for(module, wide)
    exact_names = module._mla_decode_gluon_kernel.arg_names
    assert fallback.kernel is module._mla_decode_gluon_kernel
    assert fallback.values[exact_names.index("STAGES")] == module.DECODE_GLUON_STAGES
    assert fallback.values[exact_names.index("LAND_SLOTS")] == 1
    assert fallback.values[exact_names.index("PRODUCER")] in ("convert", "convert_bytes")
