"""The benchmark jobs' offline helpers (the results log, ncu's SASS table), on synthetic inputs (CPU only)."""

import csv
import io
import json
import sys
from pathlib import Path

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


def test_instructions_are_counted_per_warp_specialized_partition(tmp_path):
    path = _ncu_csv(
        tmp_path,
        [
            ("0x00", "      LDC R1, c[0x0][0x28]", 1, 10, 0, 0),
            ("0x10", "      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa8", 0, 4, 0, 0),
            ("0x20", "      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", 5, 7, 0, 3),
            ("0x30", "      USETMAXREG.DEALLOC.CTAPOOL 0xe8", 0, 4, 0, 0),
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
            ("0x10", "      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa8", 0, 4, 0, 0),
            ("0x20", "      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", 1, 7, 0, 0),
            ("0x30", "      USETMAXREG.DEALLOC.CTAPOOL 0xe8", 0, 4, 0, 0),
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
