"""The tuning database (read / merge / write, selection per spec) and how its entries reach a generated
module; the CPU-side parts of the tuner. Tuning itself needs a GPU (`mlagen tune` on the device)."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import mlagen_compiler
from mlagen_compiler import tuning
from mlagen_compiler.cli import app
from mlagen_compiler.compile import compile_spec, import_module_from_path, module_source
from mlagen_compiler.plan import lower
from mlagen_compiler.registry import resolve_spec
from mlagen_compiler.spec import spec_from_dict
from mlagen_compiler.tuner import (
    CASES,
    BucketResult,
    ConfigResult,
    TuneCase,
    decode_buckets,
    entries_from_results,
    make_inputs,
    parse_cases,
)
from mlagen_compiler.tuning import TuningDBError, read_db, tuned_for_spec, write_db

ROOT = Path(__file__).resolve().parent.parent
H100 = "NVIDIA H100 80GB HBM3"
FIELDS = dict(
    name="tune-me",
    num_heads=16,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    page_size=16,
    dtype="float16",
)


def entry(spec, bucket="m16", config=(64, 4, 2), gpu=H100, triton=None, **extra):
    return {
        "kernel": "decode",
        "spec": spec.name,
        "spec_hash": spec.content_hash(),
        "gpu": gpu,
        "triton": triton or tuning.triton_version(),
        "bucket": bucket,
        "config": list(config),
        "time_us": 10.0,
        **extra,
    }


def space(spec, block_m):
    cfgs = dict(lower(spec).decode.space)[block_m]
    return [(c.block_n, c.num_warps, c.num_stages) for c in cfgs]


def test_round_trip_and_merge(tmp_path):
    spec = spec_from_dict(FIELDS)
    db = tmp_path / "db.json"
    assert read_db(db) == []  # a missing database is empty
    a, b = entry(spec, "m16"), entry(spec, "m32", (32, 4, 1))
    write_db(db, [b, a])
    assert read_db(db) == [a, b]  # sorted by key
    text = db.read_text()
    assert json.loads(text)["schema"] == tuning.SCHEMA_VERSION
    write_db(db, [a, b])
    assert db.read_text() == text  # deterministic
    a2 = {**a, "config": [32, 8, 2], "time_us": 5.0}
    c = entry(spec, "m16", gpu="NVIDIA H200")
    write_db(db, [a2, c])  # replaces the same key, adds a new one, keeps the rest
    assert read_db(db) == sorted([a2, b, c], key=tuning.entry_key)
    write_db(db, [c], merge=False)
    assert read_db(db) == [c]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".db.json*"))


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ('{"schema": 1}', "not a tuning database"),
        ('{"schema": 7, "entries": []}', "schema 7"),
        ('{"schema": 1, "entries": [{"kernel": "decode"}]}', "entry is missing spec_hash"),
        (
            '{"schema": 1, "entries": [{"kernel": "decode", "spec_hash": "x", "gpu": "g", "triton": "3", '
            '"bucket": "m16", "config": "fast"}]}',
            "config must be a list",
        ),
    ],
)
def test_bad_databases_are_one_line_errors(tmp_path, content, fragment):
    db = tmp_path / "bad.json"
    db.write_text(content)
    with pytest.raises(TuningDBError, match=fragment) as info:
        read_db(db)
    assert str(db) in str(info.value) and "\n" not in str(info.value)


def test_concurrent_writers_keep_every_entry(tmp_path):
    db = tmp_path / "db.json"
    worker = textwrap.dedent(
        """
        import sys
        from mlagen_compiler.tuning import write_db
        i = int(sys.argv[2])
        entries = [{"kernel": "decode", "spec_hash": "h", "gpu": f"gpu{i}", "triton": "3.6.0",
                    "bucket": f"m{j}", "config": [i, j, 1]} for j in range(20)]
        for e in entries:
            write_db(sys.argv[1], [e])
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(db), str(i)], env=env) for i in range(4)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    assert len(read_db(db)) == 4 * 20


def test_selection_by_spec_hash_space_and_triton(tmp_path):
    spec = spec_from_dict(FIELDS)
    other = spec_from_dict({**FIELDS, "page_size": 32})
    m16 = space(spec, 16)
    installed = tuning.triton_version()
    entries = [
        entry(spec, "m16", m16[0]),
        entry(other, "m32", m16[1]),  # another spec's hash: ignored
        entry(spec, "m32", (999, 4, 2)),  # not in the space (stale database): ignored
        entry(spec, "m16", m16[1], gpu="NVIDIA H200", triton="0.1.0"),
        entry(spec, "m16", m16[2], gpu="NVIDIA H200", triton="0.2.0"),  # newest when the installed is absent
        entry(spec, "m64", m16[0], gpu="NVIDIA H200", triton="99.0.0"),
        entry(spec, "m64", space(spec, 64)[0], gpu="NVIDIA H200", triton=installed),  # installed wins
    ]
    db = tmp_path / "db.json"
    write_db(db, entries)
    tuned = tuned_for_spec(spec, [db])
    assert tuned == {
        "decode": {
            f"{H100}|m16": list(m16[0]),
            "NVIDIA H200|m16": list(m16[2]),
            "NVIDIA H200|m64": list(space(spec, 64)[0]),
        }
    }
    assert tuned_for_spec(spec, []) == {}


def test_later_databases_override_earlier(tmp_path):
    spec = spec_from_dict(FIELDS)
    m16 = space(spec, 16)
    shipped, user = tmp_path / "shipped.json", tmp_path / "user.json"
    write_db(shipped, [entry(spec, "m16", m16[0]), entry(spec, "m32", m16[0])])
    write_db(user, [entry(spec, "m16", m16[3])])
    assert tuned_for_spec(spec, [shipped, user])["decode"] == {f"{H100}|m16": list(m16[3]), f"{H100}|m32": list(m16[0])}


def test_db_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("MLAGEN_TUNING_DB", str(tmp_path / "mine.json"))
    assert tuning.user_db_path() == tmp_path / "mine.json"
    assert tuning.default_db_paths() == tuning.shipped_db_paths()  # the user database does not exist yet
    write_db(tmp_path / "mine.json", [])
    assert tuning.default_db_paths()[-1] == tmp_path / "mine.json"
    monkeypatch.delenv("MLAGEN_TUNING_DB")
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert tuning.user_db_path() == tmp_path / "cache" / "tuning.json"
    shipped = tuning.shipped_db_paths()
    assert ROOT / "tuning" / "h100.json" in shipped
    for path in shipped:
        for e in read_db(path):  # every shipped entry belongs to a bundled spec and is still valid
            spec = resolve_spec(e["spec"])
            assert e["spec_hash"] == spec.content_hash(), f"{path}: stale entry for {e['spec']}"
            assert tuning.select_entries(spec, [e]), f"{path}: {e['spec']} {e['bucket']} {e['config']} not usable"


def test_bucket_names_agree_with_generated_module(build_module):
    module = build_module(**FIELDS)
    spec = spec_from_dict(FIELDS)
    valid = tuning._valid_configs(spec)["decode"]
    names = {module.decode_bucket(m, small) for m in module.DECODE_SPACE for small in (False, True)}
    assert names == set(valid)
    for m, cfgs in module.DECODE_SPACE.items():
        for small in (False, True):
            assert valid[module.decode_bucket(m, small)] == {tuple(c) for c in cfgs}


def _pretend_gpu(monkeypatch, module, name):
    """Run the module's launch-time selection as on a GPU called `name` (still on the CPU)."""
    monkeypatch.setattr(module, "_INTERPRET", False)
    monkeypatch.setattr(module, "_gpu_name", lambda device: name)
    monkeypatch.setattr(module, "_sm_count", lambda device: 132)


def test_db_entry_reaches_module_and_schedule(tmp_path, monkeypatch):
    spec = spec_from_dict(FIELDS)
    default16 = dataclasses.astuple(dict(lower(spec).decode.defaults)[16])
    chosen = next(c for c in space(spec, 16) if c != default16)
    db = tmp_path / "db.json"
    write_db(db, [entry(spec, "m16", chosen)])
    tuned = tuned_for_spec(spec, [db])
    source = module_source(spec, tuned)
    assert source != module_source(spec)
    module = import_module_from_path(compile_spec(spec, tmp_path / "tuned", tuned))
    tuned_table = module.DECODE_TUNED
    assert tuned_table == {(H100, "m16"): chosen}
    cuda = torch.device("cuda", 0)  # never touched: num_parts given, GPU name pretended
    _pretend_gpu(monkeypatch, module, H100)
    assert module.get_decode_schedule(64, 1, cuda, num_parts=2).config == chosen  # H=16, Sq=1: bucket m16
    assert module.get_decode_schedule(64, 2, cuda, num_parts=2).config == module.DECODE_DEFAULTS[32]  # untuned
    # the latency regime (few sequences) has its own bucket, so the large-batch winner does not leak in
    assert module.get_decode_schedule(4, 1, cuda, num_parts=2).config == module.DECODE_SMALL_DEFAULTS[16]
    _pretend_gpu(monkeypatch, module, "NVIDIA A100-SXM4-80GB")  # unknown GPU: the default
    assert module.get_decode_schedule(64, 1, cuda, num_parts=2).config == module.DECODE_DEFAULTS[16]
    monkeypatch.undo()
    # under the interpreter (no GPU): the interpreter's configuration, never a tuned one
    assert module.get_decode_schedule(4, 1, torch.device("cpu")).config == module.DECODE_INTERPRETER_CONFIG


def test_load_renders_the_tuning_database_in(tmp_path, monkeypatch):
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLAGEN_TUNING_DB", str(tmp_path / "user.json"))
    spec = spec_from_dict(FIELDS)
    untuned = mlagen_compiler.load(spec)
    assert untuned.DECODE_TUNED == {}
    chosen = space(spec, 32)[0]
    write_db(tmp_path / "user.json", [entry(spec, "m32", chosen)])
    tuned = mlagen_compiler.load(spec)  # the database is part of the key: a new entry
    tuned_table = tuned.DECODE_TUNED
    assert tuned is not untuned and tuned_table == {(H100, "m32"): chosen}
    assert mlagen_compiler.load(spec, tuning_dbs=[]) is untuned


def test_compile_cli_uses_shipped_database(tmp_path, monkeypatch):
    monkeypatch.setenv("MLAGEN_TUNING_DB", str(tmp_path / "user.json"))
    spec = resolve_spec("deepseek-v3-tp8")
    user_cfg = space(spec, 64)[0]
    write_db(tmp_path / "user.json", [entry(spec, "m64", user_cfg, gpu="Some GPU")])
    runner = CliRunner()
    for which in ("shipped", "all", "none"):
        result = runner.invoke(app, ["compile", "deepseek-v3-tp8", "-o", str(tmp_path / which), "--tuning", which])
        assert result.exit_code == 0, result.output
    shipped = tuned_for_spec(spec, tuning.shipped_db_paths())
    assert (tmp_path / "shipped" / "deepseek_v3_tp8.py").read_text() == module_source(spec, shipped)
    assert "'Some GPU'" in (tmp_path / "all" / "deepseek_v3_tp8.py").read_text()
    assert (tmp_path / "none" / "deepseek_v3_tp8.py").read_text() == module_source(spec)


def test_tune_without_gpu_is_one_line_error():
    result = CliRunner().invoke(app, ["tune", "deepseek-v3-tp8", "--cases", "quick"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mlagen: error:") and "needs a CUDA GPU" in lines[0]
    bad = CliRunner().invoke(app, ["tune", "deepseek-v3-tp8", "--cases", "b1-s1"])
    assert bad.exit_code == 2 and "unknown case 'b1-s1'" in bad.output


def test_parse_cases():
    assert [c.name for c in parse_cases("quick")] == ["b64-s4k"]
    assert [c.name for c in parse_cases("standard,b64-s4k,b16-s16k")] == ["b16-s16k", "b128-s8k", "b64-s4k"]
    with pytest.raises(ValueError, match="no case"):
        parse_cases(" , ")


def test_tuning_inputs_are_realistic(build_module):
    module = build_module(**FIELDS)
    generator = torch.Generator().manual_seed(3)
    case = TuneCase("t", 12, 100)
    seqlens = case.seqlens(generator)
    assert all(50 <= s < 150 for s in seqlens) and len(set(seqlens)) > 1
    inputs = make_inputs(module, seqlens, 2, generator, torch.device("cpu"))
    table = inputs["block_table"]
    assert table.shape[1] % 16 == 0
    used = torch.cat([table[b, : -(-s // module.PAGE_SIZE)] for b, s in enumerate(seqlens)])
    assert len(set(used.tolist())) == len(used)  # no page shared by two sequences
    assert (used[1:] != used[:-1] + 1).any()  # shuffled, not one contiguous run
    for name in ("q", "kv_cache"):
        assert (inputs[name] != 0).float().mean() > 0.99 and inputs[name].dtype == module.DTYPE
    assert inputs["cache_seqlens"].tolist() == seqlens
    for c in CASES.values():
        assert c.batch >= 16 and c.mean_seqlen >= 4096


def test_buckets_cover_sq_1_2_4(build_module):
    module = build_module(**FIELDS)  # H = 16: Sq 1, 2, 4 -> 16, 32, 64 rows
    buckets = decode_buckets(module, torch.device("cpu"))
    assert [(b.bucket, b.seqlen_q) for b in buckets] == [("m16", 1), ("m32", 2), ("m64", 4)]
    wide = build_module(**{**FIELDS, "num_heads": 128})
    assert [(b.bucket, b.seqlen_q) for b in decode_buckets(wide, torch.device("cpu"))] == [("m64", 1)]


def _result(default, times):
    results = [ConfigResult(cfg, "ok" if t is not None else "failed", {"c": t} if t else {}) for cfg, t in times]
    spec = spec_from_dict(FIELDS)
    case = TuneCase("c", 16, 4096)
    return BucketResult("tune-me", spec.content_hash(), "decode", "m16", 16, 1, H100, "3.6.0", [case], default, results)


def test_winner_keeps_default_unless_clearly_faster():
    d, a, b = (64, 4, 2), (32, 4, 1), (128, 8, 1)
    assert _result(d, [(d, 100.0), (a, 99.5), (b, None)]).choose() == d  # 0.5% faster: noise
    assert _result(d, [(d, 100.0), (a, 90.0), (b, None)]).choose() == a
    assert _result(d, [(d, None), (a, 120.0), (b, 110.0)]).choose() == b  # default failed: best that works
    assert _result(d, [(d, None)]).choose() is None


def test_entries_from_results_are_valid_db_entries(tmp_path):
    d, a = (64, 4, 2), (32, 4, 1)
    r = _result(d, [(d, 100.0), (a, 80.0), ((128, 8, 1), None)])
    r.choose()
    entries = entries_from_results([r, _result(d, [(d, None)])])  # the second has no winner: no entry
    assert len(entries) == 1
    e = entries[0]
    assert e["config"] == list(a) and e["time_us"] == 80.0 and e["default_time_us"] == 100.0
    assert e["candidates"][0] == [list(a), 80.0] and e["skipped"][0][:2] == [[128, 8, 1], "failed"]
    write_db(tmp_path / "db.json", entries)
    assert read_db(tmp_path / "db.json") == entries


PINNED = {**FIELDS, "name": "tune-pinned", "tiles": {"decode": {"block_m": 16, "num_warps": 4, "num_stages": 1}}}


def test_tune_flow_under_interpreter(tmp_path, monkeypatch, capsys):
    """The whole `mlagen tune` flow after the GPU check, on the CPU: real kernel runs checked against the
    reference, a fake clock instead of do_bench (which needs CUDA), database written and picked up."""
    from mlagen_compiler import cli_tools, tuner

    spec = spec_from_dict(PINNED)
    monkeypatch.setattr(tuner, "time_config", lambda module, inputs, config, **_: 100.0 - config[0] / 8)
    db = tmp_path / "db.json"
    ok = cli_tools.run_tune(
        [spec],
        [TuneCase("tiny", 3, 40)],
        db_path=db,
        jobs=0,
        warmup_ms=1,
        rep_ms=1,
        seed=0,
        device=torch.device("cpu"),
    )
    out = capsys.readouterr()
    assert ok, out.err
    (e,) = read_db(db)
    assert (e["spec"], e["bucket"], e["config"], e["gpu"]) == ("tune-pinned", "m16", [128, 4, 1], "interpreter")
    default = dataclasses.astuple(dict(lower(spec).decode.defaults)[16])
    default_us = 100.0 - default[0] / 8
    assert e["time_us"] == 84.0 and e["default_config"] == list(default) and e["default_time_us"] == default_us
    space = [list(dataclasses.astuple(c)) for c in dict(lower(spec).decode.space)[16]]
    assert [c[0] for c in e["candidates"]] == sorted(space, key=lambda c: -c[0])
    assert "tune-pinned" in out.out and f"{default_us / 84:.3f}x" in out.out and "wrote 1 entries" in out.out
    # a configuration giving wrong results is never chosen, and the run says so
    real_check = tuner._check_config
    monkeypatch.setattr(
        tuner,
        "_check_config",
        lambda module, inputs, cfg, ref: "bad" if cfg[0] == 128 else real_check(module, inputs, cfg, ref),
    )
    ok = cli_tools.run_tune(
        [spec], [TuneCase("tiny", 3, 40)], db_path=db, jobs=0, warmup_ms=1, rep_ms=1, seed=0, device=torch.device("cpu")
    )
    out = capsys.readouterr()
    assert not ok and "WRONG RESULTS: tune-pinned m16 (128, 4, 1)" in out.err
    assert read_db(db)[0]["config"] == [64, 4, 1]  # the fastest that is right


def test_warm_up_compiles_in_worker_processes(tmp_path):
    from mlagen_compiler.tuner import WarmUpTask, warm_up

    path = str(compile_spec(spec_from_dict(PINNED), tmp_path))
    good = WarmUpTask(path, 2, 1, (32, 4, 1), "cpu")
    bad = WarmUpTask(path, 2, 1, (32, 4), "cpu")  # not a configuration: reported, not raised
    seen = []
    failures = warm_up([good, bad], jobs=2, advance=seen.append)
    assert list(failures) == [bad] and "config" in failures[bad] and len(seen) == 2
