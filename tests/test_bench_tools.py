"""The benchmark jobs' offline helpers (the results log, ncu's SASS table), on synthetic inputs (CPU only)."""

import csv
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import harness  # noqa: E402
import sass_partitions  # noqa: E402

_COLUMNS = [
    "Address",
    "Source",
    "Warp Stall Sampling (All Samples)",
    "Instructions Executed",
    "L2 Theoretical Sectors Local",
    "stall_long_sb",
    "stall_wait",
    "stall_long_sb (Not Issued)",
]


def _ncu_csv(tmp_path: Path, rows: list[tuple[str, str, int, int, int, int]]) -> Path:
    """ncu's source-page CSV: a kernel-name line, the header, one line per SASS instruction."""
    text = io.StringIO()
    text.write('"Kernel Name","_mla_decode_gluon_kernel",\n')
    writer = csv.writer(text, quoting=csv.QUOTE_ALL)
    writer.writerow(_COLUMNS)
    for address, source, samples, executed, sectors, long_sb in rows:
        writer.writerow([address, source, samples, f"{executed:,}", sectors, long_sb, samples - long_sb, 0])
    path = tmp_path / "src.csv"
    path.write_text(text.getvalue())
    return path


#: the warp-specialised partitions' register markers (ncu rows without samples): the 168-register partition
#: starts at 0x10, the 232-register one at 0x30
_TRY_ALLOC_168 = ("0x10", "      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa8", 0, 4, 0, 0)
_DEALLOC_232 = ("0x30", "      USETMAXREG.DEALLOC.CTAPOOL 0xe8", 0, 4, 0, 0)


def test_instructions_are_counted_per_warp_specialized_partition(tmp_path):
    path = _ncu_csv(
        tmp_path,
        [
            ("0x00", "      LDC R1, c[0x0][0x28]", 1, 10, 0, 0),
            _TRY_ALLOC_168,
            ("0x20", "      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", 5, 7, 0, 3),
            _DEALLOC_232,
            ("0x40", "  @!P0 LDL.64 R198, [R1+0x30]", 8, 100, 800, 6),
            ("0x50", "      STL [R1+0xcc], R14", 2, 40, 160, 0),
            ("0x60", "      LDG.E.128 R4, desc[UR6][R2.64]", 3, 9, 0, 3),
        ],
    )
    parts, spills = sass_partitions.partitions(sass_partitions.read_rows(path))
    assert [p.name for p in parts] == ["prologue", "try_alloc 168 regs @0x10", "dealloc 232 regs @0x30"]
    softmax = parts[2]
    assert (softmax.spill_loads, softmax.spill_stores, softmax.local_sectors) == (100, 40, 960)
    assert (softmax.global_loads, softmax.executed, softmax.samples) == (9, 153, 13)
    assert softmax.stalls["long_sb"] == 9 and "long_sb (Not Issued)" not in softmax.stalls
    assert parts[1].mmas == 7 and parts[1].spill_loads == 0
    assert sorted(executed for executed, *_ in spills) == [40, 100]
    # each instruction's stall samples and its largest reason, for the most stalled list
    assert sorted(softmax.stalled, reverse=True) == [
        (8, "@!P0 LDL.64 R198, [R1+0x30]", "long_sb"),
        (3, "LDG.E.128 R4, desc[UR6][R2.64]", "long_sb"),
        (2, "STL [R1+0xcc], R14", "wait"),
    ]


def test_the_report_lists_the_most_stalled_instructions_of_busy_partitions(tmp_path, capsys):
    path = _ncu_csv(
        tmp_path,
        [
            _TRY_ALLOC_168,
            ("0x20", "      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", 1, 7, 0, 0),
            _DEALLOC_232,
            ("0x40", "      LDL.64 R198, [R1+0x30]", 30, 100, 800, 25),
            ("0x50", "      FMUL R4, R4, R5", 10, 40, 0, 0),
        ],
    )
    sass_partitions.report(path, top=1, stalled=1)
    text = capsys.readouterr().out
    # the 168-register partition holds 1 of 41 samples (< 10%): no list of its own
    assert "most stalled instructions of dealloc 232 regs @0x30 (of 40 samples)" in text
    assert "| 30 | `LDL.64 R198, [R1+0x30]` | long_sb |" in text
    assert "FMUL" not in text.split("most stalled")[1] and "most stalled instructions of try_alloc" not in text


def test_results_are_appended_one_json_object_a_line(tmp_path):
    """A run's rows go after the log's earlier lines, each with the run's environment and its own figures."""
    log = tmp_path / "results" / "results.jsonl"
    meta = {"gpu": "GPU X", "date": "2026-11-29T00:00+00:00", "commit": "0123456789ab", "torch": "t", "triton": "3.6.0"}
    assert harness.append_results(log, "decode", meta, [("H16 B1", {"us": 12.5, "passed": True})]) == 1
    rows = [("H16 B128", {"us": 414.2, "graph_us": None}), ("H128 B1", {"us": float("nan")})]
    assert harness.append_results(log, "decode", {**meta, "commit": None}, rows) == 2
    lines = log.read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert first == {
        "bench": "decode",
        "gpu": "GPU X",
        "date": "2026-11-29T00:00+00:00",
        "commit": "0123456789ab",
        "torch": "t",
        "triton": "3.6.0",
        "case": "H16 B1",
        "figures": {"us": 12.5, "passed": True},
    }
    rows = harness.read_results(log)
    assert [row["case"] for row in rows] == ["H16 B1", "H16 B128", "H128 B1"]
    assert rows[1]["commit"] is None and rows[1]["figures"]["graph_us"] is None


def test_the_environment_names_the_commit_and_the_versions(tmp_path, monkeypatch):
    import torch
    import triton

    monkeypatch.delenv(harness.COMMIT_VARIABLE, raising=False)
    env = harness.environment(gpu="cpu")
    assert (env["gpu"], env["torch"], env["triton"]) == ("cpu", torch.__version__, triton.__version__)
    assert env["date"].endswith("+00:00")
    commit = harness.git_commit()
    assert commit is None or len(commit.removesuffix("-dirty")) == 12
    # the variable names the commit where it is set: outside a git checkout, and inside one (a device machine's
    # copy of the tree can carry an older .git beside newer files)
    monkeypatch.setenv(harness.COMMIT_VARIABLE, "abc123")
    assert harness.git_commit(tmp_path) == "abc123"
    assert harness.git_commit() == "abc123"


def test_the_committed_results_log_is_well_formed():
    rows = harness.read_results()
    assert rows, "benchmarks/results/results.jsonl is empty"
    for row in rows:
        assert {"bench", "gpu", "date", "commit", "case", "figures"} <= row.keys(), row
        jobs = {"decode", "prefill", "before_after", "vllm_e2e", "vllm_throughput", "vllm_tp_agreement"}
        assert row["bench"] in jobs and isinstance(row["figures"], dict)


# ---- bench_decode.py: FlashMLA in the same run, through stand-ins of a built FlashMLA ---------------------------

#: a stand-in for a built FlashMLA package (tests only): its dense decode API computed with torch ops
_FAKE_FLASH_MLA = '''
"""Stand-in for a built flash_mla (a test's): dense MLA decode over a paged cache, with torch ops."""
import dataclasses

import torch

__version__ = "0.0+stand-in"
CALLS = []
API = "{api}"


@dataclasses.dataclass
class FlashMLASchedMeta:
    have_initialized: bool = False


def get_mla_metadata(*args, **kwargs):
    if API == "current":  # an empty schedule, filled by the first decode call
        return FlashMLASchedMeta(), None
    cache_seqlens, num_q_tokens_per_head_k, num_heads_k = args
    return torch.zeros(4, 8, dtype=torch.int32), torch.zeros(cache_seqlens.numel() + 1, dtype=torch.int32)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False):
    if API == "current":
        assert num_splits is None and isinstance(tile_scheduler_metadata, FlashMLASchedMeta)
        tile_scheduler_metadata.have_initialized = True
    batch, seqlen_q, heads, width = q.shape
    page = k_cache.shape[1]
    scale = width ** -0.5 if softmax_scale is None or {wrong} else softmax_scale
    out = torch.empty(batch, seqlen_q, heads, head_dim_v, dtype=q.dtype)
    lse = torch.empty(batch, heads, seqlen_q)
    for b in range(batch):
        n = int(cache_seqlens[b])
        keys = k_cache[block_table[b, : -(-n // page)].long()].reshape(-1, width)[:n].float()
        scores = torch.einsum("shd,nd->hsn", q[b].float(), keys) * scale
        if causal:
            last = n - seqlen_q + torch.arange(seqlen_q)
            scores = scores.masked_fill(torch.arange(n)[None, None, :] > last[None, :, None], float("-inf"))
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = torch.einsum("hsn,nc->shc", torch.softmax(scores, dim=-1), keys[:, :head_dim_v]).to(q.dtype)
    CALLS.append(batch)
    return out, lse
'''


def _fake_flash_mla(folder: Path, api: str = "2025", wrong: bool = False) -> Path:
    """A folder holding a stand-in `flash_mla` package (the API of 2025 or the current one; `wrong`: it ignores
    the softmax scale it is given)."""
    package = folder / "flash_mla"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(_FAKE_FLASH_MLA.format(api=api, wrong=wrong))
    return folder


@pytest.fixture
def stand_ins(monkeypatch):
    """sys.path and sys.modules as before the test: the stand-in packages it imports leave nothing behind; and
    bench_decode's FlashMLA figures measured in the test only."""
    import bench_decode

    monkeypatch.setattr(bench_decode, "_FLASH_MLA", {})
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("flash_mla", "vllm"):
            del sys.modules[name]


class _Graph:
    """A captured 'graph' on the CPU: replay() runs the call again into the tensors it returned at capture."""

    def __init__(self, fn):
        self.fn = fn
        self.result = fn()

    def replay(self):
        for held, new in zip(self.result, self.fn(), strict=True):
            held.copy_(new)


#: a clock instead of do_bench and CUDA graphs: FlashMLA 'takes' 50 µs eager, 30 replayed, 40 back to back
_CLOCK = SimpleNamespace(
    median_ms=lambda fn: (fn(), 0.050)[1],
    capture_graph=lambda fn: ((graph := _Graph(fn)), graph.result),
    time_graph=lambda fn, graph: 0.030,
    time_stream=lambda fn: 0.040,
)


def _decode_case(bench_decode, tmp_path, name="H16 B2 Sq2", spec="deepseek-v3-tp8", heads=16, cache="bf16"):
    """A small case of a bundled geometry (its module and inputs on the CPU)."""
    case = bench_decode.Case(name, spec, heads, [70, 130], seqlen_q=2, graph=True)
    module = bench_decode.module_for(case.spec, case.num_heads, tmp_path, cache)
    gen = torch.Generator().manual_seed(0)
    return case, module, bench_decode.make_inputs(module, case.seqlens, case.seqlen_q, gen, device="cpu")


def _result(bench_decode, case, us=20.0, graph_us=None):
    return bench_decode.Result(
        case=case.name, backend="gluon", cache="bf16", geometry="Dc512/Dr64", batch=len(case.seqlens),
        seqlen_q=case.seqlen_q, num_heads=case.num_heads, total_tokens=sum(case.seqlens), config="m64 n64 r168 s2 p8",
        us=us, gbps=1.0, tflops=1.0, pct_copy=1.0, pct_mma=1.0, eager_us=100.0, speedup=5.0, graph_us=graph_us,
    )  # fmt: skip


def test_flash_mla_is_loaded_from_the_path_given_or_said_absent(tmp_path, stand_ins):
    import bench_decode

    api, why = bench_decode.load_flash_mla(str(_fake_flash_mla(tmp_path / "build")))
    assert why == "" and api.source == f"flash_mla 0.0+stand-in from {tmp_path / 'build' / 'flash_mla'}"
    again, _ = bench_decode.load_flash_mla(str(tmp_path / "build" / "flash_mla"))  # the package folder itself
    assert again.source == api.source
    assert bench_decode.load_flash_mla("auto")[0].source == api.source  # importable now: auto finds it
    api, why = bench_decode.load_flash_mla(str(tmp_path / "empty"))
    assert api is None and "holds no flash_mla package" in why
    broken = tmp_path / "broken" / "flash_mla"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import flash_mla.cuda  # not built\n")
    api, why = bench_decode.load_flash_mla(str(broken.parent))
    assert api is None and "does not import (ModuleNotFoundError: No module named 'flash_mla.cuda')" in why
    assert bench_decode.load_flash_mla("none") == (None, "not asked for (--flash-mla none)")


def test_flash_mla_through_vllms_wrapper(tmp_path, stand_ins):
    """--flash-mla vllm: vLLM's build through vllm.v1.attention.ops.flashmla, where vLLM says it can run."""
    import importlib.util

    import bench_decode

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("a real vLLM is importable here; the stand-in would not be the one imported")
    ops = tmp_path / "site" / "vllm" / "v1" / "attention" / "ops"
    ops.mkdir(parents=True)
    for folder in (ops, ops.parent, ops.parent.parent, ops.parent.parent.parent):
        (folder / "__init__.py").write_text('__version__ = "0.0+stand-in"\n' if folder.name == "vllm" else "")
    (ops / "flashmla.py").write_text(
        _FAKE_FLASH_MLA.format(api="current", wrong=False)
        + "\nSUPPORTED = (True, None)\n\ndef is_flashmla_dense_supported():\n    return SUPPORTED\n"
    )
    sys.path.insert(0, str(tmp_path / "site"))
    api, why = bench_decode.load_flash_mla("vllm")
    assert why == "" and api.source.startswith("vLLM 0.0+stand-in's FlashMLA (vllm._flashmla_C through")
    sys.modules["vllm.v1.attention.ops.flashmla"].SUPPORTED = (False, "FlashMLA Dense is only supported on Hopper")
    assert bench_decode.load_flash_mla("vllm") == (
        None,
        "vLLM 0.0+stand-in's FlashMLA cannot run here: FlashMLA Dense is only supported on Hopper",
    )


@pytest.mark.parametrize("api", ["2025", "current"])
def test_flash_mla_is_checked_then_timed_beside_mlagen(tmp_path, stand_ins, api, capsys):
    """FlashMLA's rows: checked against the fp32 reference first, then timed as mlagen's (eager, graph replay,
    back to back for graph cases), once a case; its columns in the table, decode.json and the results log."""
    import bench_decode

    flash, _ = bench_decode.load_flash_mla(str(_fake_flash_mla(tmp_path / "build", api)))
    case, module, inputs = _decode_case(bench_decode, tmp_path)
    figures = bench_decode.flash_mla_for_case(flash, case, module, "bf16", inputs, case.graph, _CLOCK)
    assert figures["passed"] and figures["detail"] == "" and figures["max_err"] < 0.02
    assert (figures["us"], figures["graph_us"], figures["stream_us"]) == (50.0, 30.0, 40.0)
    calls = sys.modules["flash_mla"].CALLS
    assert len(calls) == 5  # the check, the timed call, the poisoned check, the capture, the replay
    # once a case: the next backend's row of the same case takes the same figures without running FlashMLA again
    assert bench_decode.flash_mla_for_case(flash, case, module, "bf16", inputs, case.graph, _CLOCK) is figures
    assert len(calls) == 5
    result = bench_decode.attach_flash_mla(_result(bench_decode, case, us=20.0, graph_us=15.0), figures)
    assert result.vs_flash_mla == pytest.approx(30.0 / 15.0)  # best of eager and replay, each
    # where FlashMLA cannot run: said once a case, no figures
    other, mistral, mistral_inputs = _decode_case(bench_decode, tmp_path, "Mistral", "mistral-small-4", 32)
    for _ in range(2):
        assert bench_decode.flash_mla_for_case(flash, other, mistral, "bf16", mistral_inputs, False, _CLOCK) is None
    assert capsys.readouterr().out.count("[flash-mla] Mistral bf16: not run (Dc 256 / Dr 64 (it runs 512 / 64))") == 1
    fp8 = bench_decode.module_for(case.spec, case.num_heads, tmp_path, "fp8")
    assert "fp8 cache" in bench_decode.flash_mla_unsupported(fp8, "fp8")
    assert bench_decode.flash_mla_for_case(None, case, module, "bf16", inputs, True, _CLOCK) is None  # absent

    # the table, decode.json and the results log carry FlashMLA beside mlagen
    absent = _result(bench_decode, other)
    meta = {"gpu": "GPU X", "date": "2026-11-29T00:00+00:00", "commit": "abc", "torch": "t", "triton": "3.6.0"}
    roof = {"copy_gbps": 4000.0, "matmul_tflops": 700.0}
    lines = bench_decode.summary_lines([result, absent], meta, roof, ("bf16",), flash.source)
    header, row, row_absent = lines[1], lines[3], lines[4]
    assert header.split(" | ")[-4:] == ["FlashMLA µs", "FlashMLA graph µs", "FlashMLA / mlagen", "ok |"]
    assert row.endswith("| 50.0 | 30.0 | 2.00x | yes |") and row_absent.endswith("| - | - | - | yes |")
    assert f"FlashMLA: {flash.source}" in lines[0] and lines[2].count("---") == len(header.split(" | "))
    assert "FlashMLA 50.0 us, graph 30.0 us, FlashMLA / mlagen 2.00x" in bench_decode.done_line(result)
    doc = json.loads(json.dumps(bench_decode.run_json(meta, roof, flash.source, [result, absent])))
    assert doc["flash_mla"] == flash.source and doc["results"][0]["flash_mla"]["graph_us"] == 30.0
    assert doc["results"][0]["vs_flash_mla"] == 2.0 and doc["results"][1]["flash_mla"] is None
    log = tmp_path / "results.jsonl"
    harness.append_results(log, "decode", meta, bench_decode.log_rows([result, absent], roof))
    first, second = harness.read_results(log)
    assert first["figures"]["flash_mla"]["us"] == 50.0 and first["figures"]["vs_flash_mla"] == 2.0
    assert second["figures"]["flash_mla"] is None and first["figures"]["roofline"] == roof


def test_flash_mla_giving_wrong_results_is_not_timed(tmp_path, stand_ins):
    import bench_decode

    flash, _ = bench_decode.load_flash_mla(str(_fake_flash_mla(tmp_path / "build", wrong=True)))
    case, module, inputs = _decode_case(bench_decode, tmp_path, name="wrong scale")
    figures = bench_decode.flash_mla_figures(flash, module, inputs, max(case.seqlens), True, _CLOCK)
    assert not figures["passed"] and figures["us"] is None and figures["graph_us"] is None
    assert figures["detail"] and len(sys.modules["flash_mla"].CALLS) == 1  # checked once, never timed
    result = bench_decode.attach_flash_mla(_result(bench_decode, case), figures)
    assert result.vs_flash_mla is None
    cells = bench_decode.flash_mla_cells(result)
    assert cells[0].startswith("WRONG: ") and cells[1:] == ("-", "-")
    meta = {"gpu": "GPU X", "date": "2026-11-29T00:00+00:00"}
    lines = bench_decode.summary_lines([result], meta, {"copy_gbps": 1.0, "matmul_tflops": 1.0}, ("bf16",), "x")
    assert lines[-1] == "FlashMLA failed its check (not timed): ['wrong scale']"
    # a FlashMLA that raises (e.g. refusing a shape) is reported in its figures, not fatal
    broken = bench_decode.FlashMLA("broken", lambda *a: (None, None), lambda *a, **k: 1 / 0)
    figures = bench_decode.flash_mla_figures(broken, module, inputs, max(case.seqlens), False, _CLOCK)
    assert figures["detail"] == "ZeroDivisionError: division by zero" and not figures["passed"]


# ---- before_after.py: rows and arguments (its timing needs a GPU) ------------------------------------------------


def test_before_after_rows_record_errors_and_the_time_budget(capsys):
    import before_after

    args = SimpleNamespace(start=0.0, budget=float("inf"))
    rows: list[dict] = []
    before_after.run_row(rows, args, "decode", "ok", lambda case: {"case": case, "kind": "decode"}, "ok")
    before_after.run_row(rows, args, "prefill", "boom", lambda: 1 / 0)
    args.budget = -1.0
    before_after.run_row(rows, args, "chunked", "late", lambda: pytest.fail("measured past the budget"))
    assert rows[0] == {"case": "ok", "kind": "decode"}
    assert rows[1]["error"].startswith("ZeroDivisionError") and rows[2]["error"] == "NOT RUN: time budget"
    assert [before_after.verdict(r, 0.02) for r in rows[1:]] == ["ERROR", "NOT RUN"]
    assert len(capsys.readouterr().out.splitlines()) == 3  # every row printed as it is made
    timed = {"check": "ok", "ratio": {"before": 1.0, "after": 1.021}}
    assert before_after.verdict(timed, 0.02) == "SLOWER" and before_after.verdict(timed, 0.025) == "ok"
    assert before_after.verdict({**timed, "check": "after differs"}, 0.02) == "WRONG"


def test_before_after_only_matches_a_rows_whole_name(monkeypatch):
    """--only words match the decode row's name with its cache and backend ("... fix bf16" selects both backends of
    the bf16 cache), and a case none of whose rows match loads no module."""
    import before_after

    loaded, labels = [], []

    class Builds:
        labels = ["before", "after"]

        def modules(self, name):
            loaded.append(name)
            return [name]

    monkeypatch.setattr(before_after, "run_row", lambda rows, args, kind, label, *rest: labels.append(label))
    args = SimpleNamespace(only=["H16 B128 S8192 Sq2 fix bf16"], rounds=1)
    before_after.decode_rows(Builds(), args)
    assert labels == ["H16 B128 S8192 Sq2 fix bf16 gluon", "H16 B128 S8192 Sq2 fix bf16 triton"]
    assert loaded == ["deepseek_v3_tp8"]
    labels.clear()
    before_after.decode_rows(Builds(), SimpleNamespace(only=["Mistral-S4 H32 B128 S8192 fp8 gluon"], rounds=1))
    assert labels == ["Mistral-S4 H32 B128 S8192 fp8 gluon"]


@pytest.mark.parametrize("value", ["generated", "=generated", "after=", "after=/no/such/folder"])
def test_before_after_refuses_a_bad_build(value, capsys):
    import argparse

    import before_after

    parser = argparse.ArgumentParser(prog="before_after.py")
    with pytest.raises(SystemExit):
        before_after.parse_builds(parser, [value])
    assert f"--build {value!r}: expected LABEL=DIR" in capsys.readouterr().err


def test_before_after_refuses_a_label_twice(capsys):
    import argparse

    import before_after

    parser = argparse.ArgumentParser(prog="before_after.py")
    root = Path(__file__).resolve().parent.parent
    generated, benchmarks = root / "generated", root / "benchmarks"
    assert before_after.parse_builds(parser, [f"a={generated}"]) == [("a", generated)]
    with pytest.raises(SystemExit):
        before_after.parse_builds(parser, [f"a={generated}", f"a={benchmarks}"])
    assert "label 'a' given twice" in capsys.readouterr().err


def test_bench_decode_checks_fp8_products_against_their_bound_and_selects_exact_names():
    import bench_decode

    from mlagen_compiler.verify import compare_fp8_compute

    ref = torch.randn(2, 1, 4, 8, dtype=torch.float64)
    ref_lse = torch.randn(2, 4, 1, dtype=torch.float64)
    assert compare_fp8_compute(ref * 1.01, ref_lse + 0.01, ref, ref_lse)[2] == ""
    assert "relative norm error" in compare_fp8_compute(ref * 1.2, ref_lse, ref, ref_lse)[2]
    assert "LSE error" in compare_fp8_compute(ref, ref_lse + 0.1, ref, ref_lse)[2]
    poisoned = ref.clone()
    poisoned[0, 0, 0, 0] = float("nan")
    assert "NaN" in compare_fp8_compute(poisoned, ref_lse, ref, ref_lse)[2]
    assert bench_decode.CACHE_COMPUTE == {"fp8mma": "fp8", "fp8mma1": "fp8"}
    assert {"fp8mma", "fp8mma1"} <= set(bench_decode.CACHES)
    assert bench_decode.CACHE_OVERRIDES["fp8mma1"]["DECODE_GLUON_FP8_QUERY_TERMS"] == 1
    name = "Mistral-S4 H32 B128 S8192"
    assert bench_decode.only_matches(f"={name}", name) and not bench_decode.only_matches(f"={name}", f"{name} Sq4")
    assert bench_decode.only_matches("S8192", f"{name} Sq4")
