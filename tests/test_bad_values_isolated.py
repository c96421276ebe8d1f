"""Every bad index value of the list, each in a process of its own: a committed generated module (generated/,
imported for Triton's interpreter, on a GPU machine too) given the bad value on CPU tensors (validation on,
the CPU default) must end its process normally with a one-line ValueError naming the argument, never a
signal (a crash, a foreign memory access) or a return (a silent wrong answer). One case per process, so one
crash cannot hide the rest. (Unvalidated, a bad page or slot kills the interpreter with SIGSEGV.)

Processes: a fresh `python -c` costs ~4.5 s here (importing torch), so the 23 cases would add ~100 s per
Triton version. Each case instead runs in a child forked by a multiprocessing fork server: one fresh
interpreter that has imported torch and run nothing, so its children (their own address spaces: a death by
a signal is seen as such) are safe to fork. Forking the pytest process itself is not: its torch thread
pools, started by earlier tests, leave locks held in a child (seen: a child hung on a futex in CI).
MLAGEN_ISOLATE=spawn runs each case in a fresh interpreter instead (the same snippets), and so do
platforms without the fork server.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE_PATH = ROOT / "generated" / "deepseek_v3_tp8.py"
SPAWN = os.environ.get("MLAGEN_ISOLATE") == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods()
TIMEOUT_S = 300.0  # a case that hangs fails instead of stalling the suite

# Run in the child before the case: the module and small, valid arguments of each wrapper, which a case
# spoils in one value. Two sequences of 70 and 9 cached tokens own pages [1, 2] and [0] of a pool of 4
# (rows hold 128 tokens); 3 and 5 new tokens for prefill.
PRELUDE = f"""
import importlib.util, os, sys
os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors: the interpreter's kernels, on a GPU machine too
import torch
spec = importlib.util.spec_from_file_location("mlagen_isolated_cases", {str(MODULE_PATH)!r})
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
H, DC, DR, DN, DV = m.NUM_HEADS, m.KV_LORA_RANK, m.QK_ROPE_HEAD_DIM, m.QK_NOPE_HEAD_DIM, m.V_HEAD_DIM
g = torch.Generator().manual_seed(0)
def rand(*shape): return torch.randn(*shape, generator=g).to(m.DTYPE)
def i32(values): return torch.tensor(values, dtype=torch.int32)
def pool(pages): return rand(pages, m.PAGE_SIZE, 1, DC + DR)
def mha(t=8): return rand(t, H, DN + DR), rand(t, H, DN), rand(t, DR), rand(t, H, DV)
TABLE, LENGTHS = [[1, 2], [0, 3]], [70, 9]
def prefill(cu, max_seqlen): return m.mla_prefill(*mha(), i32(cu), max_seqlen)
def chunked(cu=(0, 3, 8), max_seqlen=5, table=TABLE, prefix=LENGTHS):
    extra = len(cu) - 3  # sequences past two: no prefix
    return m.mla_chunked_prefill(*mha(), i32(cu), max_seqlen, pool(4), i32(table + [[3, 3]] * extra),
                                 i32(prefix + [0] * extra), rand(H, DN, DC), rand(H, DV, DC))
def decode(table=TABLE, lengths=LENGTHS): return m.mla_decode(rand(2, 1, H, DC + DR), pool(4), i32(table), i32(lengths))
def cache_write(slots): return m.mla_cache_write(rand(3, DC), rand(3, DR), pool(2), torch.tensor(slots))
"""

# A case's report: "ValueError: <message>" for the error the wrappers raise, "returned" when the call
# returned, else the last line of whatever else was raised.
RUN_CASE = """
try:
    {snippet}
except ValueError as error:
    report = f"ValueError: {{error}}"
except BaseException as error:
    import traceback
    report = traceback.format_exc().strip().splitlines()[-1]
else:
    report = "returned"
"""

PAGE = "a page used by its sequence must be in [0, 3]"
LENGTH = "a length (block_table rows hold 128 tokens) must be in [0, 128]"
SLOT = "a slot (-1: skip the token) must be in [-1, 127]"
TOKEN_BOUNDS = [  # (cu_seqlens, max_seqlen, message) over 8 new tokens in two sequences of 3 and 5
    ("past T", [0, 3, 9], 6, "cu_seqlens: must end at the number of tokens (8), got cu_seqlens[-1] = 9"),
    ("negative first", [-2, 3, 8], 5, "cu_seqlens: must start at 0, got cu_seqlens[0] = -2"),
    ("not starting at 0", [1, 3, 8], 5, "cu_seqlens: must start at 0, got cu_seqlens[0] = 1"),
    ("not monotone", [0, 6, 5, 8], 6, "cu_seqlens: must not decrease, got cu_seqlens[1] = 6 > cu_seqlens[2] = 5"),
    ("max_seqlen too small", [0, 3, 8], 4, "max_seqlen: 4 is less than the longest sequence (5 tokens)"),
    ("max_seqlen 0", [0, 3, 8], 0, "max_seqlen: 0 is less than the longest sequence (5 tokens)"),
    ("max_seqlen True", [0, 3, 8], True, "max_seqlen: must be an int >= 0, got True"),
]
PAST_TOKENS = "is more than the number of tokens (8): must be in [longest sequence, 8]"
SCALE_BOUND = "must be within [-2**64, 2**64] (the kernels' float32 scales stay finite)"
META = ("a meta tensor holds no data: the kernels need CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); "
        "torch.compile's fake tensors go through the module's ops")  # fmt: skip
PREFILL_CONFIG = "expected (block_m, block_n: powers of two in 16..256, num_warps: 1, 2, 4, 8 or 16, num_stages: 1..6)"
CASES = {
    **{f"prefill {name}": (f"prefill({cu}, {n})", msg) for name, cu, n, msg in TOKEN_BOUNDS},
    **{f"chunked prefill {name}": (f"chunked({cu}, {n})", msg) for name, cu, n, msg in TOKEN_BOUNDS},
    "cache_write slot past the cache": ("cache_write([0, 128, -1])", f"slot_mapping[1] = 128: {SLOT}"),
    "cache_write slot 2**40": ("cache_write([0, 2**40, -1])", f"slot_mapping[1] = 1099511627776: {SLOT}"),
    "decode page past the pool": ("decode(table=[[1, 4], [0, 3]])", f"block_table[0, 1] = 4: {PAGE}"),
    "decode page negative": ("decode(table=[[1, 2], [-1, 3]])", f"block_table[1, 0] = -1: {PAGE}"),
    "decode length past capacity": ("decode(lengths=[129, 9])", f"cache_seqlens[0] = 129: {LENGTH}"),
    "decode length 2**31-1": ("decode(lengths=[9, 2**31 - 1])", f"cache_seqlens[1] = 2147483647: {LENGTH}"),
    "decode length -2**31": ("decode(lengths=[-2**31, 9])", f"cache_seqlens[0] = -2147483648: {LENGTH}"),
    "chunked prefill page -1": ("chunked(table=[[1, -1], [0, 3]])", f"block_table[0, 1] = -1: {PAGE}"),
    "chunked prefill page past the pool": ("chunked(table=[[1, 2], [4, 3]])", f"block_table[1, 0] = 4: {PAGE}"),
    # values that would hang a call, crash the interpreter or reach Triton's asserts
    "prefill max_seqlen past the tokens": ("prefill([0, 3, 8], 200000)", f"max_seqlen: 200000 {PAST_TOKENS}"),
    "chunked prefill max_seqlen past the tokens": ("chunked(max_seqlen=200000)", f"max_seqlen: 200000 {PAST_TOKENS}"),
    "decode softmax_scale 1e300": (
        "m.mla_decode(rand(2, 1, H, DC + DR), pool(4), i32(TABLE), i32(LENGTHS), softmax_scale=1e300)",
        f"softmax_scale: {SCALE_BOUND}, got 1e+300",
    ),
    "prefill softmax_scale -1e300": (
        "m.mla_prefill(*mha(), i32([0, 3, 8]), 5, softmax_scale=-1e300)",
        f"softmax_scale: {SCALE_BOUND}, got -1e+300",
    ),
    "decode cache of no pages": (
        "m.mla_decode(rand(2, 1, H, DC + DR), pool(0), i32([[0], [0]]), i32([0, 0]))",
        "kv_cache: expected at least one page, got shape (0, 64, 1, 576)",
    ),
    "decode meta tensors": (
        "m.mla_decode(*(t.to('meta') for t in (rand(2, 1, H, DC + DR), pool(4), i32(TABLE), i32(LENGTHS))))",
        f"q: {META}",
    ),
    "prefill config of 3 warps": (
        "m.mla_prefill(*mha(), i32([0, 3, 8]), 5, config=(16, 16, 3, 1))",
        f"config: {PREFILL_CONFIG}, got (16, 16, 3, 1)",
    ),
    "decode out and lse overlapping": (
        "o = torch.empty(2, 1, H, DC, dtype=m.DTYPE); m.mla_decode(rand(2, 1, H, DC + DR), pool(4), i32(TABLE), "
        "i32(LENGTHS), out=o, lse=o.view(torch.float32).reshape(-1)[:2 * H].view(2, H, 1))",
        "out: overlaps lse in memory: give out memory of its own",
    ),
    "get_decode_schedule backend cuda": (
        "m.get_decode_schedule(2, 1, backend='cuda')",
        "backend: expected auto, gluon or triton, got 'cuda'",
    ),
    "get_decode_schedule batch True": ("m.get_decode_schedule(True, 1)", "batch_size: must be an int >= 1, got True"),
}


def run_isolated(snippet: str) -> tuple[int | None, int | None, str]:
    """Run PRELUDE + `snippet` in a process of its own: (exit code or None, signal or None, report)."""
    code = PRELUDE + RUN_CASE.format(snippet=snippet)
    if SPAWN:
        child = subprocess.run(
            [sys.executable, "-c", code + "print(report)"], capture_output=True, text=True, timeout=TIMEOUT_S,
            cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
        )  # fmt: skip
        lines = child.stdout.strip().splitlines()
        died = -child.returncode if child.returncode < 0 else None
        return (None if died else child.returncode), died, lines[-1] if lines else ""
    with tempfile.TemporaryDirectory() as directory:
        report_path = Path(directory) / "report"
        write_report = f"open({str(report_path)!r}, 'w').write(report)\n"
        # target: the builtin exec (the fork server pickles a target by name; a test module is not importable)
        child = _FORK_SERVER.Process(target=exec, args=(code + write_report, {}))
        child.start()
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()  # our own child: a hang fails the case instead of stalling the suite
            child.join()
        report = report_path.read_text() if report_path.exists() else ""
    if child.exitcode < 0:
        return None, -child.exitcode, report
    return child.exitcode, None, report


_FORK_SERVER = multiprocessing.get_context("forkserver") if not SPAWN else None
if _FORK_SERVER is not None:
    _FORK_SERVER.set_forkserver_preload(["torch"])


@pytest.mark.parametrize("case", list(CASES))
def test_bad_value_is_a_one_line_value_error_in_its_own_process(case):
    snippet, message = CASES[case]
    code, died, report = run_isolated(snippet)
    assert died is None, f"{case}: the process died of {signal.Signals(died).name} ({report!r})"
    assert code == 0, f"{case}: exit code {code} ({report!r})"
    assert report == f"ValueError: {message}", case
    assert "\n" not in report


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("prefill([0, 3, 8], 5)", (0, None, "returned")),  # valid arguments: the kernel runs and returns
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", (None, signal.SIGSEGV, "")),
        ("raise RuntimeError('not a ValueError')", (0, None, "RuntimeError: not a ValueError")),
    ],
)
def test_the_harness_tells_a_return_a_crash_and_another_error_apart(snippet, expected):
    """What the cases above rely on: a call that returns, a process killed by a signal and an error other
    than ValueError are each reported as such, not as a pass."""
    assert run_isolated(snippet) == expected
