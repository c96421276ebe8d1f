"""The tuning database (keys, read / merge / write, selection per spec, migration from schema 1) and how its
entries reach a generated module; the tuner's flow under the interpreter. Timing needs a GPU (`mlagen tune`)."""

import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import SMALL_SPEC
from typer.testing import CliRunner

import mlagen_compiler
from mlagen_compiler import tuning_db
from mlagen_compiler.cli import app
from mlagen_compiler.module_file import compile_spec, import_module_from_path, module_source
from mlagen_compiler.plan import lower
from mlagen_compiler.registry import registered_specs, resolve_spec
from mlagen_compiler.spec import spec_from_dict
from mlagen_compiler.tuning_db import TuningDBError, read_db, tuned_for_spec, write_db
from mlagen_compiler.tuning_search import (
    CASE_SETS,
    CASES,
    BucketResult,
    ConfigResult,
    TuneCase,
    decode_buckets,
    entries_from_results,
    make_inputs,
    parse_cases,
    prefill_buckets,
)

ROOT = Path(__file__).resolve().parent.parent
H100 = "NVIDIA H100 80GB HBM3"
FIELDS = {**SMALL_SPEC, "name": "tune-me"}
#: tests of the tuner's flow on CPU tensors, or pretending a GPU, under Triton's interpreter (CI's machines); on a
#: GPU the compiled kernels cannot read CPU tensors and the device is real: `mlagen tune` itself runs there
INTERPRETER_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="runs the tuner on CPU tensors or a pretended GPU: interpreter only"
)


def entry(spec, bucket="m16", config=(64, 4, 2), gpu=H100, triton=None, kernel="decode", arch="sm90", **extra):
    return {
        "kernel": kernel,
        "geometry": tuning_db.kernel_geometry(kernel, spec),
        "bucket": bucket,
        "arch": arch,
        "gpu": gpu,
        "triton": triton or tuning_db.triton_version(),
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
    assert json.loads(text)["schema"] == tuning_db.SCHEMA_VERSION == 2
    write_db(db, [a, b])
    assert db.read_text() == text  # deterministic
    a2 = {**a, "config": [32, 8, 2], "time_us": 5.0}
    c = entry(spec, "m16", gpu="NVIDIA H200")
    write_db(db, [a2, c])  # replaces the same key, adds a new one, keeps the rest
    assert read_db(db) == sorted([a2, b, c], key=tuning_db.entry_key)
    write_db(db, [c], merge=False)
    assert read_db(db) == [c]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".db.json*"))


V1_ENTRY = (
    '{"kernel": "decode", "spec": "x", "spec_hash": "h", "gpu": "g", "triton": "3", "bucket": "m16", "config": [1]}'
)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ('{"schema": 2}', "not a tuning database"),
        ('{"schema": 7, "entries": []}', "schema 7, expected 2$"),
        ('{"schema": 1, "entries": []}', "schema 1, expected 2; convert it with `mlagen tuning migrate FILE`"),
        (
            '{"schema": 2, "entries": [' + V1_ENTRY + "]}",
            r"entries\[0\]: a schema-1 entry keyed by spec hash \(x m16\); convert the file with `mlagen tuning",
        ),
        ('{"schema": 2, "entries": [{"kernel": "decode"}]}', "entry is missing geometry, bucket, arch, gpu"),
        (
            '{"schema": 2, "entries": [{"kernel": "decode", "geometry": "x", "bucket": "m16", "arch": "sm90", '
            '"gpu": "g", "triton": "3", "config": "fast"}]}',
            "config must be a list",
        ),
        (
            '{"schema": 2, "entries": [{"kernel": "decode", "geometry": "x", "bucket": "m16", "arch": "sm90", '
            '"gpu": "g", "triton": 3.6, "config": [64, 8, 2]}]}',
            r"entries\[0\]: triton must be a string, got 3\.6$",
        ),
    ],
)
def test_bad_databases_are_one_line_errors(tmp_path, content, fragment):
    db = tmp_path / "bad.json"
    db.write_text(content)
    with pytest.raises(TuningDBError, match=fragment) as info:
        read_db(db)
    assert str(info.value).startswith(f"{db}: ") and "\n" not in str(info.value)


def test_concurrent_writers_keep_every_entry(tmp_path):
    db = tmp_path / "db.json"
    worker = textwrap.dedent(
        """
        import sys
        from mlagen_compiler.tuning_db import write_db
        i = int(sys.argv[2])
        entries = [{"kernel": "decode", "geometry": "g", "arch": "sm90", "gpu": f"gpu{i}", "triton": "3.6.0",
                    "bucket": f"m{j}", "config": [i, j, 1]} for j in range(20)]
        for e in entries:
            write_db(sys.argv[1], [e])
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(db), str(i)], env=env) for i in range(4)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    assert len(read_db(db)) == 4 * 20


def test_geometry_keys_name_what_the_kernels_depend_on():
    spec = spec_from_dict(FIELDS)
    assert tuning_db.kernel_geometry("decode", spec) == "dc64-dr16-page16-float16"
    assert tuning_db.kernel_geometry("prefill", spec) == "dn32-dr16-dv32-float16"
    # what the decode kernel does not depend on leaves its key alone, and the other way round
    same_decode = {"name": "other", "num_heads": 3, "qk_nope_head_dim": 64, "v_head_dim": 16, "q_lora_rank": 96}
    other = spec_from_dict({**FIELDS, **same_decode, "softmax_scale": 0.5})
    assert tuning_db.kernel_geometry("decode", other) == tuning_db.kernel_geometry("decode", spec)
    assert tuning_db.kernel_geometry("prefill", spec_from_dict({**FIELDS, "page_size": 64, "kv_lora_rank": 128})) == (
        tuning_db.kernel_geometry("prefill", spec)
    )
    for field, value in (
        ("kv_lora_rank", 128),
        ("qk_rope_head_dim", 32),
        ("page_size", 64),
        ("dtype", "bfloat16"),
        ("cache_dtype", "float8_e4m3fn"),
    ):
        changed = spec_from_dict({**FIELDS, field: value})
        assert tuning_db.kernel_geometry("decode", changed) != tuning_db.kernel_geometry("decode", spec), field
    # an fp8 cache has decode entries of its own; a 16-bit one keeps its key; prefill never reads the cache
    fp8 = spec_from_dict({**FIELDS, "cache_dtype": "float8_e4m3fn"})
    assert tuning_db.kernel_geometry("decode", fp8) == "dc64-dr16-page16-float16-float8_e4m3fn"
    assert tuning_db.kernel_geometry("decode", spec_from_dict({**FIELDS, "cache_dtype": "float16"})) == (
        "dc64-dr16-page16-float16"
    )
    assert tuning_db.kernel_geometry("prefill", fp8) == tuning_db.kernel_geometry("prefill", spec)
    with pytest.raises(ValueError, match="kernel 'combine': no tuning key"):
        tuning_db.kernel_geometry("combine", spec)


def test_selection_by_geometry_space_and_triton(tmp_path):
    spec = spec_from_dict(FIELDS)
    other = spec_from_dict({**FIELDS, "page_size": 32})
    m16 = space(spec, 16)
    installed = tuning_db.triton_version()
    entries = [
        entry(spec, "m16", m16[0]),
        entry(other, "m32", m16[1]),  # another geometry: ignored
        entry(spec, "m32", (999, 4, 2)),  # not in the space (stale database): ignored
        entry(spec, "m16", m16[1], gpu="NVIDIA H200", triton="0.1.0"),
        entry(spec, "m16", m16[2], gpu="NVIDIA H200", triton="0.2.0"),  # newest when the installed is absent
        entry(spec, "m64", m16[0], gpu="NVIDIA H200", triton="99.0.0"),
        entry(spec, "m64", space(spec, 64)[0], gpu="NVIDIA H200", triton=installed),  # installed wins
        entry(spec, "m64", space(spec, 64)[1], gpu="NVIDIA A100-SXM4-80GB", arch="sm80"),
        entry(spec, "prefix", (64, 32, 4, 1), kernel="prefill"),  # the spec emits no prefill: ignored
    ]
    db = tmp_path / "db.json"
    write_db(db, entries)
    tuned = tuned_for_spec(spec, [db])
    assert tuned == {
        "decode": {
            f"sm90|{H100}|m16": list(m16[0]),
            "sm90|NVIDIA H200|m16": list(m16[2]),
            "sm90|NVIDIA H200|m64": list(space(spec, 64)[0]),
            "sm80|NVIDIA A100-SXM4-80GB|m64": list(space(spec, 64)[1]),
            # each arch's family-wide row: the entry of its first device name
            "sm90|*|m16": list(m16[0]),
            "sm90|*|m64": list(space(spec, 64)[0]),
            "sm80|*|m64": list(space(spec, 64)[1]),
        }
    }
    assert tuned_for_spec(spec, []) == {}
    # a family-wide entry, where recorded, is the family's row
    write_db(db, [entry(spec, "m16", m16[3], gpu=tuning_db.FAMILY_WIDE)])
    assert tuned_for_spec(spec, [db])["decode"]["sm90|*|m16"] == list(m16[3])
    # a renamed spec with the same decode kernel gets the same table
    renamed = spec_from_dict({**FIELDS, "name": "renamed", "q_lora_rank": 96, "qk_nope_head_dim": 64})
    assert tuned_for_spec(renamed, [db]) == tuned_for_spec(spec, [db])


def test_later_databases_override_earlier(tmp_path):
    spec = spec_from_dict(FIELDS)
    m16 = space(spec, 16)
    shipped, user = tmp_path / "shipped.json", tmp_path / "user.json"
    write_db(shipped, [entry(spec, "m16", m16[0]), entry(spec, "m32", m16[0])])
    write_db(user, [entry(spec, "m16", m16[3])])
    assert tuned_for_spec(spec, [shipped, user])["decode"] == {
        f"sm90|{H100}|m16": list(m16[3]),
        f"sm90|{H100}|m32": list(m16[0]),
        "sm90|*|m16": list(m16[3]),
        "sm90|*|m32": list(m16[0]),
    }


def test_db_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("MLAGEN_TUNING_DB", str(tmp_path / "mine.json"))
    assert tuning_db.user_db_path() == tmp_path / "mine.json"
    assert tuning_db.default_db_paths() == tuning_db.shipped_db_paths()  # the user database does not exist yet
    write_db(tmp_path / "mine.json", [])
    assert tuning_db.default_db_paths()[-1] == tmp_path / "mine.json"
    monkeypatch.delenv("MLAGEN_TUNING_DB")
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert tuning_db.user_db_path() == tmp_path / "cache" / "tuning.json"
    shipped = tuning_db.shipped_db_paths()
    assert ROOT / "tuning" / "h100.json" in shipped
    bundled = [resolve_spec(name) for name in registered_specs()]
    for path in shipped:
        for e in read_db(path):  # every shipped entry is still usable by a bundled spec
            users = [s.name for s in bundled if tuning_db.select_entries(s, [e])]
            assert users, f"{path}: {e['kernel']} {e['geometry']} {e['bucket']} {e['config']} fits no bundled spec"


def test_bucket_names_agree_with_generated_module(build_module):
    module = build_module(**FIELDS, kernels=["decode", "prefill"])
    spec = spec_from_dict({**FIELDS, "kernels": ["decode", "prefill"]})
    valid = tuning_db._valid_configs(spec)
    names = {module.decode_bucket(m, small) for m in module.DECODE_SPACE for small in (False, True)}
    assert names == set(valid["decode"])
    for m, cfgs in module.DECODE_SPACE.items():
        for small in (False, True):
            assert valid["decode"][module.decode_bucket(m, small)] == {tuple(c) for c in cfgs}
    assert set(tuning_db.PREFILL_BUCKETS) == {"causal", "prefix"}
    gluon_buckets = {module.prefill_gluon_bucket(causal) for causal in (True, False)}
    assert gluon_buckets == {"gluon-causal", "gluon-prefix"} and module.PREFILL_GLUON_ELIGIBLE
    assert set(valid["prefill"]) == set(tuning_db.PREFILL_BUCKETS) | gluon_buckets
    for bucket, configs in valid["prefill"].items():
        space = module.PREFILL_GLUON_SPACE if bucket in gluon_buckets else module.PREFILL_SPACE
        assert configs == {tuple(c) for c in space}


def _pretend_gpu(monkeypatch, module, arch, name):
    """Run the module's launch-time selection as on a GPU of `arch` called `name` (still on the CPU)."""
    monkeypatch.setattr(module, "_INTERPRET", False)
    monkeypatch.setattr(module, "_gpu_key", lambda device: (arch, name))
    monkeypatch.setattr(module, "_sm_count", lambda device: 132)


def test_db_entry_reaches_module_and_schedule(tmp_path, monkeypatch):
    spec = spec_from_dict(FIELDS)
    default16 = dataclasses.astuple(dict(lower(spec).decode.defaults)[16])
    chosen, for_h200 = [c for c in space(spec, 16) if c != default16][:2]
    db = tmp_path / "db.json"
    write_db(db, [entry(spec, "m16", chosen), entry(spec, "m16", for_h200, gpu="NVIDIA H200")])
    tuned = tuned_for_spec(spec, [db])
    source = module_source(spec, tuned)
    assert source != module_source(spec)
    module = import_module_from_path(compile_spec(spec, tmp_path / "tuned", tuned))
    tuned_table = module.DECODE_TUNED
    assert tuned_table == {
        ("sm90", H100, "m16"): chosen,
        ("sm90", "NVIDIA H200", "m16"): for_h200,
        ("sm90", "*", "m16"): chosen,
    }
    cuda = torch.device("cuda", 0)  # never touched: num_parts given, GPU pretended
    _pretend_gpu(monkeypatch, module, "sm90", H100)
    assert module.get_decode_schedule(64, 1, cuda, num_parts=2).config == chosen  # H=16, Sq=1: bucket m16
    assert module.get_decode_schedule(64, 2, cuda, num_parts=2).config == module.DECODE_DEFAULTS[32]  # untuned
    # the latency regime (few sequences) has its own bucket, so the large-batch winner does not leak in
    assert module.get_decode_schedule(4, 1, cuda, num_parts=2).config == module.DECODE_SMALL_DEFAULTS[16]
    _pretend_gpu(monkeypatch, module, "sm90", "NVIDIA H200")  # its own entry first
    assert module.get_decode_schedule(64, 1, cuda, num_parts=2).config == for_h200
    _pretend_gpu(monkeypatch, module, "sm90", "NVIDIA H100 PCIe")  # unknown device of a known family
    assert module.get_decode_schedule(64, 1, cuda, num_parts=2).config == chosen
    _pretend_gpu(monkeypatch, module, "sm80", "NVIDIA A100-SXM4-80GB")  # unknown family: the default
    assert module.get_decode_schedule(64, 1, cuda, num_parts=2).config == module.DECODE_DEFAULTS[16]
    monkeypatch.undo()
    # under the interpreter (no GPU): the interpreter's configuration, never a tuned one
    assert module.get_decode_schedule(4, 1, torch.device("cpu")).config == module.DECODE_INTERPRETER_CONFIG


def test_prefill_entries_reach_prefill_config(tmp_path, monkeypatch):
    fields = {**FIELDS, "kernels": ["prefill"]}
    spec = spec_from_dict(fields)
    configs = [c.as_tuple() for c in lower(spec).prefill.space if c != lower(spec).prefill.default]
    causal, prefix = configs[:2]
    db = tmp_path / "db.json"
    write_db(db, [entry(spec, "causal", causal, kernel="prefill"), entry(spec, "prefix", prefix, kernel="prefill")])
    module = import_module_from_path(compile_spec(spec, tmp_path / "tuned", tuned_for_spec(spec, [db])))
    cuda = torch.device("cuda", 0)
    _pretend_gpu(monkeypatch, module, "sm90", "NVIDIA H100 NVL")
    assert module.prefill_config(cuda, "causal") == causal and module.prefill_config(cuda, "prefix") == prefix
    _pretend_gpu(monkeypatch, module, "sm100", "NVIDIA B200")
    assert module.prefill_config(cuda, "causal") == module.PREFILL_DEFAULT


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
    assert tuned is not untuned and tuned_table == {("sm90", H100, "m32"): chosen, ("sm90", "*", "m32"): chosen}
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
    shipped = tuned_for_spec(spec, tuning_db.shipped_db_paths())
    assert shipped["decode"]  # the shipped database has entries for this spec
    assert (tmp_path / "shipped" / "deepseek_v3_tp8.py").read_text() == module_source(spec, shipped)
    assert "'Some GPU'" in (tmp_path / "all" / "deepseek_v3_tp8.py").read_text()
    assert (tmp_path / "none" / "deepseek_v3_tp8.py").read_text() == module_source(spec)


def test_renamed_copy_of_a_bundled_spec_compiles_to_the_same_kernels_and_tables(tmp_path):
    """The bundled module and a renamed copy's differ only in lines naming the spec or its hash."""
    copy_dir = tmp_path / "specs"
    copy_dir.mkdir()
    text = (ROOT / "specs" / "deepseek-v3-tp8.yaml").read_text()
    assert "name: deepseek-v3-tp8\n" in text
    (copy_dir / "my-model.yaml").write_text(text.replace("name: deepseek-v3-tp8\n", "name: my-model\n"))
    args = ["compile", "my-model", "--spec-dir", str(copy_dir), "-o", str(tmp_path), "--tuning", "shipped"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    original, copy = resolve_spec("deepseek-v3-tp8"), resolve_spec("my-model", [copy_dir])
    # (the custom-op namespace names the spec as an identifier: dashes become underscores)
    naming = (original.name, copy.name, original.content_hash(), copy.content_hash(),
              original.name.replace("-", "_"), copy.name.replace("-", "_"))  # fmt: skip
    bundled = (ROOT / "generated" / "deepseek_v3_tp8.py").read_text().splitlines()
    renamed = (tmp_path / "my_model.py").read_text().splitlines()
    assert len(bundled) == len(renamed)
    differing = [(a, b) for a, b in zip(bundled, renamed, strict=True) if a != b]
    assert differing  # the name and hash are in the module
    for a, b in differing:
        assert any(n in a for n in naming) and any(n in b for n in naming), (a, b)
    assert any(line.startswith("DECODE_TUNED = {('sm90'") for line in renamed)  # tuned tables, the same ones


def _v1_entry(spec_name, bucket, config, candidates, gpu=H100, **extra):
    """A schema-1 entry (keyed by the spec's hash) of a bundled spec, as `mlagen tune` wrote them."""
    spec = resolve_spec(spec_name)
    return {
        "kernel": "decode",
        "spec": spec_name,
        "spec_hash": spec.content_hash(),
        "gpu": gpu,
        "triton": "3.6.0",
        "bucket": bucket,
        "config": list(config),
        "default_config": [32, 4, 3],
        "candidates": [[list(c), t] for c, t in candidates],
        "seqlen_q": 1,
        **extra,
    }


def test_migration_derives_keys_from_the_named_specs_and_pools_shared_keys(tmp_path):
    default, other = (32, 4, 3), (64, 8, 2)
    old = [
        _v1_entry("mistral-small-4", "m32", (128, 4, 2), [((128, 4, 2), 184.0), ((32, 4, 3), 202.8)]),
        # deepseek-v3-tp8 and deepseek-v2-lite have one decode kernel: their measurements are pooled
        _v1_entry("deepseek-v3-tp8", "m16", default, [(default, 270.0), (other, 285.0)]),
        _v1_entry("deepseek-v2-lite", "m16", other, [(other, 286.0), (default, 295.0)]),
    ]
    v1 = tmp_path / "v1.json"
    v1.write_text(json.dumps({"schema": 1, "entries": old}))
    with pytest.raises(TuningDBError, match="schema 1, expected 2"):
        read_db(v1)
    result = CliRunner().invoke(app, ["tuning", "migrate", str(v1), "-o", str(tmp_path / "v2.json")])
    assert result.exit_code == 0, result.output
    mistral, deepseek = read_db(tmp_path / "v2.json")
    assert tuning_db.entry_key(mistral) == ("decode", "dc256-dr64-page64-bfloat16", "m32", "sm90", H100, "3.6.0")
    assert mistral["config"] == [128, 4, 2]  # a key measured once keeps its configuration
    assert tuning_db.entry_key(deepseek)[:4] == ("decode", "dc512-dr64-page64-bfloat16", "m16", "sm90")
    # geometric means: default sqrt(270 * 295) = 282.2 < other sqrt(285 * 286) = 285.5
    assert deepseek["config"] == list(default) and deepseek["time_us"] == round((270.0 * 295.0) ** 0.5, 2)
    assert [m["spec"] for m in deepseek["measured_with"]] == ["deepseek-v3-tp8", "deepseek-v2-lite"]
    assert [m["config"] for m in deepseek["migrated_from"]] == [list(default), list(other)]
    # nothing lost on the way: the migrated database reaches the modules of every spec with that kernel
    for name in ("deepseek-v3-tp8", "deepseek-v2-lite", "deepseek-v3-tp1"):
        tuned = tuned_for_spec(resolve_spec(name), [tmp_path / "v2.json"])
        assert tuned["decode"][f"sm90|{H100}|m16"] == list(default)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (dict(gpu="Mystery GPU 9000"), "unknown GPU 'Mystery GPU 9000': give its family, e.g. --gpu-arch"),
        (dict(spec_hash="0" * 64), "spec 'deepseek-v3-tp8' has changed since"),
        (dict(spec="no-such-spec"), "entries\\[0\\]: spec 'no-such-spec': "),
    ],
)
def test_migration_errors_name_the_entry(tmp_path, change, fragment):
    v1 = tmp_path / "v1.json"
    v1.write_text(
        json.dumps({"schema": 1, "entries": [{**_v1_entry("deepseek-v3-tp8", "m16", (32, 4, 3), []), **change}]})
    )
    with pytest.raises(TuningDBError, match=fragment) as info:
        tuning_db.migrate_db(v1)
    assert str(info.value).startswith(f"{v1}: entries[0]") and "\n" not in str(info.value)
    result = CliRunner().invoke(app, ["tuning", "migrate", str(v1), "--gpu-arch", "Mystery GPU 9000=sm90"])
    if "gpu" in change:  # the family given on the command line
        assert result.exit_code == 0, result.output
        assert read_db(v1)[0]["arch"] == "sm90"
    else:
        assert result.exit_code == 2 and result.output.count("\n") == 1


def test_tune_without_gpu_is_one_line_error():
    result = CliRunner().invoke(app, ["tune", "deepseek-v3-tp8", "--cases", "quick"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mlagen: error:") and "needs a CUDA GPU" in lines[0]
    bad = CliRunner().invoke(app, ["tune", "deepseek-v3-tp8", "--cases", "b1-s1"])
    assert bad.exit_code == 2 and "unknown case 'b1-s1'" in bad.output


def test_parse_cases():
    assert [c.name for c in parse_cases("quick")] == ["b64-s4k", "b1-s8k", "pf-b1-s4k-p28k"]
    assert [c.name for c in parse_cases("b64-s4k,standard,b16-s16k")] == [
        "b64-s4k",
        "b16-s16k",
        "b128-s8k",
        "b1-s8k",
        "b4-s16k",
        "pf-b1-s4k-p28k",
        "pf-b4-s8k-p8k",
    ]
    for name in CASE_SETS:  # every set tunes large and latency-regime decode batches, and prefill
        kinds = {(c.kernel, c.batch <= 8) for c in parse_cases(name)}
        assert {("decode", False), ("decode", True), ("prefill", True)} <= kinds, name
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
        assert c.mean_seqlen >= 4096 and (c.batch >= 16 or c.batch <= 8 or c.kernel == "prefill")


def test_decode_buckets_cover_sq_1_2_4_and_the_latency_regime(build_module):
    module = build_module(**FIELDS)  # H = 16: Sq 1, 2, 4 -> 16, 32, 64 rows
    large, small = CASES["b128-s8k"], CASES["b1-s8k"]
    buckets = decode_buckets(module, [large, small, CASES["pf-b1-s4k-p28k"]], torch.device("cpu"))
    assert [(b.bucket, b.seqlen_q, b.cases) for b in buckets] == [
        ("m16", 1, (large,)),
        ("m16-small", 1, (small,)),  # few sequences: 16-row blocks whatever Sq, so reached once
        ("m32", 2, (large,)),
        ("m64", 4, (large,)),
    ]
    small_bucket = buckets[1]
    assert small_bucket.default == tuple(module.DECODE_SMALL_DEFAULTS[16]) and small_bucket.block_m == 16
    wide = build_module(**{**FIELDS, "num_heads": 128})
    assert [(b.bucket, b.seqlen_q) for b in decode_buckets(wide, [large, small], torch.device("cpu"))] == [
        ("m64", 1),
        ("m64-small", 1),
    ]


def test_prefill_buckets_causal_and_prefix(build_module):
    module = build_module(**FIELDS, kernels=["decode", "prefill"])
    plain = TuneCase("p", 2, 64, kernel="prefill")
    buckets = prefill_buckets(module, [CASES["b1-s8k"], plain, CASES["pf-b1-s4k-p28k"]])
    assert [(b.bucket, b.cases) for b in buckets] == [
        ("causal", (plain, CASES["pf-b1-s4k-p28k"])),
        ("prefix", (CASES["pf-b1-s4k-p28k"],)),  # only cases with a prefix
    ]
    assert buckets[0].default == tuple(module.PREFILL_DEFAULT)
    assert prefill_buckets(build_module(**FIELDS), [plain]) == []  # no prefill kernel


def _result(default, times):
    results = [ConfigResult(cfg, "ok" if t is not None else "failed", {"c": t} if t else {}) for cfg, t in times]
    case = TuneCase("c", 16, 4096)
    geometry = tuning_db.kernel_geometry("decode", spec_from_dict(FIELDS))
    return BucketResult("tune-me", 16, "decode", geometry, "m16", 1, "sm90", H100, "3.6.0", [case], default, results)


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
    assert tuning_db.entry_key(e) == ("decode", "dc64-dr16-page16-float16", "m16", "sm90", H100, "3.6.0")
    assert e["config"] == list(a) and e["time_us"] == 80.0 and e["default_time_us"] == 100.0
    assert e["measured_with"] == [{"spec": "tune-me", "num_heads": 16, "seqlen_q": 1}]
    assert e["candidates"][0] == [list(a), 80.0] and e["skipped"][0][:2] == [[128, 8, 1], "failed"]
    write_db(tmp_path / "db.json", entries)
    assert read_db(tmp_path / "db.json") == entries


PINNED = {
    **FIELDS,
    "name": "tune-pinned",
    "num_heads": 2,
    "kernels": ["decode", "prefill"],
    "tiles": {
        "decode": {"block_m": 16, "num_warps": 4, "num_stages": 1},
        "prefill": {"block_m": 64, "num_warps": 4, "num_stages": 1},
    },
}
#: a serving-size batch (m16) and a latency-regime one (m16-small) of decode, and a prefill case
TINY_CASES = [TuneCase("tiny", 9, 40), TuneCase("tiny-few", 3, 40), TuneCase("tiny-pf", 2, 24, False, "prefill", 20)]


def _fake_clock(module, bucket, inputs, config, **_):
    """do_bench needs CUDA: larger key tiles (block_n, third from the end of either kind) are 'faster'."""
    return 100.0 - config[-3] / 8


@INTERPRETER_ONLY
def test_tune_flow_under_interpreter(tmp_path, monkeypatch, capsys):
    """The whole `mlagen tune` flow after the GPU check, on the CPU: real kernel runs checked against the
    reference, a fake clock instead of do_bench, database written and picked up, each kernel tuned once."""
    from mlagen_compiler import tuning_search
    from mlagen_compiler.cli import tuning as cli_tuning

    spec = spec_from_dict(PINNED)
    copy = spec_from_dict({**PINNED, "name": "tune-pinned-copy", "q_lora_rank": 64})  # the same kernels
    monkeypatch.setattr(tuning_search, "time_config", _fake_clock)
    db = tmp_path / "db.json"

    def tune():
        return tuning_search.tune_specs([spec, copy], TINY_CASES, db_path=db, jobs=0, device=torch.device("cpu"))

    report = tune()
    cli_tuning.print_tune_report(report)
    out = capsys.readouterr()
    assert report.ok, out.err
    entries = {(e["kernel"], e["bucket"]): e for e in read_db(db)}
    assert set(entries) == {("decode", "m16"), ("decode", "m16-small"), ("prefill", "causal"), ("prefill", "prefix")}
    assert len(report.shared) == 4 and all("same kernel as tune-pinned" in line for line in report.shared)
    for (kernel, _), e in entries.items():
        assert e["arch"] == e["gpu"] == "interpreter" and e["geometry"] == tuning_db.kernel_geometry(kernel, spec)
        assert e["measured_with"][0]["spec"] == "tune-pinned" and e["config"][-3] == 128 and e["time_us"] == 84.0
    decode_default = dataclasses.astuple(dict(lower(spec).decode.defaults)[16])
    small_default = dataclasses.astuple(dict(lower(spec).decode.small_batch_defaults)[16])
    assert entries["decode", "m16"]["default_config"] == list(decode_default)
    assert entries["decode", "m16-small"]["default_config"] == list(small_default)
    assert entries["prefill", "causal"]["default_config"] == list(lower(spec).prefill.default.as_tuple())
    space16 = [list(dataclasses.astuple(c)) for c in dict(lower(spec).decode.space)[16]]
    assert [c[0] for c in entries["decode", "m16"]["candidates"]] == sorted(space16, key=lambda c: -c[0])
    default_us = 100.0 - decode_default[0] / 8
    assert "tune-pinned" in out.out and f"{default_us / 84:.3f}x" in out.out and "wrote 4 entries" in out.out
    # a configuration giving wrong results is never chosen, and the run says so
    real_check = tuning_search._check_config
    monkeypatch.setattr(
        tuning_search,
        "_check_config",
        lambda module, bucket, inputs, cfg, ref: (
            "bad" if cfg[-3] == 128 else real_check(module, bucket, inputs, cfg, ref)
        ),
    )
    report = tune()
    cli_tuning.print_tune_report(report)
    out = capsys.readouterr()
    assert not report.ok and "WRONG RESULTS: tune-pinned decode m16 (128, 4, 1)" in out.err
    assert "WRONG RESULTS: tune-pinned prefill causal (64, 128, 4, 1)" in out.err
    assert all(e["config"][-3] == 64 for e in read_db(db))  # the fastest that is right


@INTERPRETER_ONLY
def test_tune_flow_fp8_cache_under_interpreter(tmp_path, monkeypatch):
    """`mlagen tune` of an fp8-cache spec: its decode runs on fp8 inputs with their kv_scale, checked against
    the dequantised reference, and lands under its own geometry key, beside the 16-bit spec's entries."""
    from mlagen_compiler import tuning_search

    fields = {**PINNED, "name": "tune-fp8", "kernels": ["decode"]}
    fp8, plain = spec_from_dict({**fields, "cache_dtype": "float8_e4m3fn"}), spec_from_dict(fields)
    monkeypatch.setattr(tuning_search, "time_config", _fake_clock)
    db = tmp_path / "db.json"
    for spec in (plain, fp8):
        report = tuning_search.tune_specs([spec], TINY_CASES[:1], db_path=db, jobs=0, device=torch.device("cpu"))
        assert report.ok
    geometries = sorted(e["geometry"] for e in read_db(db))
    assert geometries == ["dc64-dr16-page16-float16", "dc64-dr16-page16-float16-float8_e4m3fn"]
    for spec in (plain, fp8):  # each spec takes its own entries only
        assert {e["geometry"] for e in tuning_db.select_entries(spec, read_db(db))} == {
            tuning_db.kernel_geometry("decode", spec)
        }
    inputs = make_inputs(import_module_from_path(compile_spec(fp8, tmp_path)), [5, 9], 1, torch.Generator(), "cpu")
    assert inputs["kv_cache"].dtype == torch.float8_e4m3fn and inputs["kv_scale"].dtype == torch.float32


@INTERPRETER_ONLY
def test_an_h200_takes_the_hopper_family_entries_until_mlagen_tune_records_its_own(tmp_path, monkeypatch):
    """Issue 44: on an "NVIDIA H200" the module looks up ("sm90", "NVIDIA H200"); with only H100 entries shipped it
    takes the family's ("sm90", "*") rows, which are the H100's. `mlagen tune` on it records its winners under its
    own name; shipped beside the H100's (tuning/h200.json), they win on the H200, bucket by bucket, and change
    nothing for the H100 or another Hopper device, which keep the H100's."""
    from mlagen_compiler import runtime, tuning_search

    h200 = "NVIDIA H200"
    # the key a module computes on an H200 (what torch reports there), and on an H100
    monkeypatch.setattr(runtime, "_INTERPRET", False)
    monkeypatch.setattr(runtime, "_GPU_CAPABILITY", {})
    monkeypatch.setattr(runtime, "_GPU_KEY", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: h200)
    assert runtime._gpu_key(torch.device("cuda", 0)) == ("sm90", h200)
    monkeypatch.undo()

    spec = spec_from_dict({**PINNED, "name": "tune-h200", "kernels": ["decode"]})
    shipped = tmp_path / "tuning"
    monkeypatch.setattr(tuning_db, "shipped_tuning_dir", lambda: shipped)
    monkeypatch.setenv("MLAGEN_TUNING_DB", str(tmp_path / "no-user-db.json"))
    configs = dict(zip((16, 32, 64, 128), space(spec, 16), strict=True))  # (block_n, 4, 1); the default is n16
    h100 = {"m16": configs[32], "m16-small": configs[64]}
    write_db(shipped / "h100.json", [entry(spec, bucket, config) for bucket, config in h100.items()])

    builds = itertools.count()

    def schedules_on(name, arch="sm90"):
        """{bucket: config} that the module compiled from the shipped databases picks on GPU `name`."""
        path = compile_spec(spec, tmp_path / f"build{next(builds)}", tuned_for_spec(spec))
        module = import_module_from_path(path)
        with monkeypatch.context() as patch:
            _pretend_gpu(patch, module, arch, name)
            cuda = torch.device("cuda", 0)  # never touched: num_parts given, GPU pretended
            return {
                "m16": module.get_decode_schedule(9, 1, cuda, num_parts=2).config,  # 9 sequences: serving size
                "m16-small": module.get_decode_schedule(3, 1, cuda, num_parts=2).config,  # the latency regime
            }

    default = {"m16": configs[16], "m16-small": configs[16]}
    assert schedules_on(h200) == schedules_on(H100) == schedules_on("NVIDIA H100 PCIe") == h100  # the family's
    assert schedules_on("NVIDIA B200", "sm100") == default  # another family: the plan's defaults

    # `mlagen tune` on the H200 (its key pretended; the fake clock makes block_n 128 the winner), written where the
    # shipped databases live: first only the latency bucket, then the other
    monkeypatch.setattr(runtime, "_gpu_key", lambda device: ("sm90", h200))
    monkeypatch.setattr(tuning_search, "time_config", _fake_clock)

    def tune(bucket):
        report = tuning_search.tune_specs(
            [spec], TINY_CASES[:2], db_path=shipped / "h200.json", jobs=0, device=torch.device("cpu"),
            buckets_wanted=[bucket],
        )  # fmt: skip
        assert report.ok and [(e["arch"], e["gpu"], e["bucket"]) for e in report.entries] == [("sm90", h200, bucket)]

    tune("m16-small")
    assert tuning_db.shipped_db_paths() == [shipped / "h100.json", shipped / "h200.json"]
    # its own entry where it has one, the family's (the H100's) where it has none
    assert schedules_on(h200) == {"m16": h100["m16"], "m16-small": configs[128]}
    tune("m16")
    assert schedules_on(h200) == {"m16": configs[128], "m16-small": configs[128]}
    # the H100 keeps its own; another Hopper device keeps the family's rows, the H100's (its name sorts first)
    assert schedules_on(H100) == schedules_on("NVIDIA H100 PCIe") == h100
    module_table = tuned_for_spec(spec)["decode"]
    assert module_table["sm90|*|m16"] == list(h100["m16"]) and module_table[f"sm90|{h200}|m16"] == list(configs[128])


@INTERPRETER_ONLY
def test_warm_up_compiles_in_worker_processes(tmp_path):
    from mlagen_compiler.tuning_search import WarmUpTask, warm_up

    module_path = compile_spec(spec_from_dict(PINNED), tmp_path)
    module = import_module_from_path(module_path)
    (decode,) = decode_buckets(module, TINY_CASES[:1], torch.device("cpu"))
    causal = prefill_buckets(module, TINY_CASES[2:])[0]
    good = WarmUpTask(str(module_path), decode, 2, (32, 4, 1), "cpu")
    good_prefill = WarmUpTask(str(module_path), causal, 2, (64, 32, 4, 1), "cpu")
    bad = WarmUpTask(str(module_path), decode, 2, (32, 4), "cpu")  # not a configuration: reported, not raised
    seen = []
    failures = warm_up([good, good_prefill, bad], jobs=2, advance=seen.append)
    # (a candidate stands for the tuned entry: its error names tuned=)
    assert list(failures) == [bad] and "tuned: expected (block_n" in failures[bad] and len(seen) == 3


def test_gluon_entries_reach_the_gluon_schedule(tmp_path, monkeypatch):
    """A database entry of bucket "gluon" (block_n, second warpgroup's registers, stages) is taken by the
    Gluon backend's schedule on its GPU and nowhere else; entries outside the plan's space are dropped."""
    from helpers import DEEPSEEK_V3_TP8_SPEC

    spec = spec_from_dict({**DEEPSEEK_V3_TP8_SPEC, "name": "tune-gluon"})
    gluon_plan = lower(spec).decode.gluon
    assert gluon_plan.eligible and gluon_plan.default in gluon_plan.space
    chosen = next(c for c in gluon_plan.space if c != gluon_plan.default)
    stale = (64, 4, 2)  # the old (block_n, warps, stages) form: not in the space
    db = tmp_path / "db.json"
    write_db(db, [entry(spec, "gluon", chosen), entry(spec, "gluon", stale, gpu="NVIDIA H200")])
    tuned = tuned_for_spec(spec, [db])
    assert tuned["decode"] == {f"sm90|{H100}|gluon": list(chosen), "sm90|*|gluon": list(chosen)}
    module = import_module_from_path(compile_spec(spec, tmp_path / "tuned", tuned))
    cuda = torch.device("cuda", 0)  # never touched: GPU and backend pretended
    _pretend_gpu(monkeypatch, module, "sm90", H100)
    monkeypatch.setattr(module, "decode_backend", lambda *args, **kwargs: ("gluon", ""))
    assert module.get_decode_schedule(128, 1, cuda, num_parts=2).config == chosen
    _pretend_gpu(monkeypatch, module, "sm100", "NVIDIA B200")  # no entry for its family: the default
    assert module.get_decode_schedule(128, 1, cuda, num_parts=2).config == gluon_plan.default
    # a forced configuration must be one of the Gluon space's, named in the error
    with pytest.raises(ValueError, match=r"^config: the Gluon decode takes \(block_n, registers, stages\)"):
        module.get_decode_schedule(128, 1, cuda, num_parts=2, config=(64, 4, 2), backend="gluon")
    assert module.get_decode_schedule(128, 1, cuda, num_parts=2, config=list(chosen), backend="gluon").config == chosen
    # the tuner times the Gluon bucket where the backend runs, on the serving-size cases only
    buckets = decode_buckets(module, [CASES["b128-s8k"], CASES["b1-s8k"]], cuda)
    gluon_bucket = next(b for b in buckets if b.bucket == "gluon")
    assert gluon_bucket.configs == gluon_plan.space and gluon_bucket.default == gluon_plan.default
    assert gluon_bucket.cases == (CASES["b128-s8k"],) and gluon_bucket.seqlen_q == 1
    monkeypatch.undo()
    assert all(b.bucket != "gluon" for b in decode_buckets(module, [CASES["b128-s8k"]], torch.device("cpu")))


#: a geometry whose serving batches take the Gluon decode's long blocks: two row blocks (H128, Sq = 1), Dc 256, a
#: 16-bit cache (no bundled spec has it: Mistral-Small-4 has one row block, DeepSeek's Dc 512 fits no long block)
LONG_BLOCKS = dict(
    name="tune-long-blocks", num_heads=128, kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=64,
    v_head_dim=128, page_size=64, dtype="bfloat16", kernels=["decode"],
)  # fmt: skip


def _recorded_decode_schedules(monkeypatch, module):
    """The schedules mla_decode is called with (the call itself does nothing: Gluon does not run here)."""
    schedules = []
    monkeypatch.setattr(module, "mla_decode", lambda *args, schedule, **kwargs: schedules.append(schedule))
    return schedules


@INTERPRETER_ONLY
@pytest.mark.parametrize(
    ("name", "blocks"),
    [
        ("mistral-small-4-fp8", "landing ring"),  # fp8 at Dc 256, pages of 64
        (LONG_BLOCKS["name"], "long blocks"),
        ("mistral-small-4", "as tuned"),  # 16-bit, one row block: the candidate's own blocks
    ],
)
def test_the_tuner_times_each_gluon_candidate_as_production_runs_it_tuned(tmp_path, monkeypatch, name, blocks):
    """The Gluon bucket's candidates are checked, compiled (warm_up, through the same call) and timed in the
    schedule a production call (no config) plans with the candidate as the tuned entry it would ship as: the
    launch policy's fp8 landing ring (Mistral-Small-4's fp8 cache) or long blocks replace the candidate's stages
    or block_n there too. A forced config= still streams exactly its tile, the ring and the long blocks off."""
    from mlagen_compiler import tuning_search
    from mlagen_compiler.tuning_search import decode_candidate_schedule

    spec = spec_from_dict(LONG_BLOCKS) if name == LONG_BLOCKS["name"] else resolve_spec(name)
    gluon_plan = lower(spec).decode.gluon
    chosen = next(c for c in gluon_plan.space if c != gluon_plan.default)
    plain = import_module_from_path(compile_spec(spec, tmp_path / "plain"))
    # production: a module compiled from a database whose Gluon entry is the candidate
    db = tmp_path / "db.json"
    write_db(db, [entry(spec, "gluon", chosen)])
    shipped = import_module_from_path(compile_spec(spec, tmp_path / "tuned", tuned_for_spec(spec, [db])))
    tuned_table = shipped.DECODE_TUNED
    assert tuned_table == {("sm90", H100, "gluon"): chosen, ("sm90", "*", "gluon"): chosen}
    cpu = torch.device("cpu")  # a GPU and the Gluon backend pretended
    for module in (plain, shipped):
        _pretend_gpu(monkeypatch, module, "sm90", H100)
        monkeypatch.setattr(module, "decode_backend", lambda *args, **kwargs: ("gluon", ""))
    (bucket,) = (b for b in decode_buckets(plain, [CASES["b128-s8k"]], cpu) if b.bucket == "gluon")
    batch = bucket.cases[0].batch
    assert batch > plain.DECODE_SMALL_BATCH  # a serving batch: no short blocks
    inputs = make_inputs(plain, [3] * batch, 1, torch.Generator().manual_seed(0), cpu)
    launched = _recorded_decode_schedules(monkeypatch, plain)
    assert chosen in bucket.configs
    for config in (chosen, *(c for c in bucket.configs if c != chosen)):  # first the database's entry, then each
        timed = decode_candidate_schedule(plain, bucket, inputs["q"], config)
        if config != chosen:
            monkeypatch.setitem(shipped.DECODE_TUNED, ("sm90", H100, "gluon"), config)
        production = shipped.get_decode_schedule(batch, 1, cpu)
        assert repr(timed) == repr(production), config
        block_n, registers, stages = config
        if blocks == "landing ring":
            assert timed.land_slots == plain.DECODE_GLUON_LAND_RING_SLOTS > 1, timed
            assert timed.config == (block_n, registers, plain.DECODE_GLUON_LAND_RING_STAGES), timed
        elif blocks == "long blocks":
            assert timed.config == (plain.DECODE_GLUON_LONG_BLOCK_N, registers, plain.DECODE_GLUON_LONG_BLOCK_STAGES)
            assert timed.config[0] == 128 and timed.land_slots == 1, timed
        else:
            assert timed.config == config and timed.land_slots == 1, timed
        # a user's config forces exactly that tile: no ring, no long blocks
        forced = plain.get_decode_schedule(batch, 1, cpu, config=config, backend="gluon")
        assert forced.config == config and forced.land_slots == 1, forced
        # the checked and the timed call launch that schedule (warm_up compiles through the timed call)
        tuning_search._check_config(plain, bucket, inputs, config, tuning_search._reference(plain, bucket, inputs))
        tuning_search._timed_call(plain, bucket, inputs, config)()
        assert [repr(s) for s in launched] == [repr(timed)] * 2, config
        launched.clear()
    with pytest.raises(ValueError, match=r"^tuned: give config \(a forced tile\) or tuned, not both"):
        plain.get_decode_schedule(batch, 1, cpu, config=chosen, tuned=chosen, backend="gluon")
    with pytest.raises(ValueError, match=r"^tuned: the Gluon decode takes \(block_n, registers, stages\)"):
        plain.get_decode_schedule(batch, 1, cpu, tuned=(64, 4, 2), backend="gluon")


@INTERPRETER_ONLY
@pytest.mark.parametrize("name", ["mistral-small-4-fp8", "mistral-small-4"])
def test_candidates_the_launch_policy_makes_one_kernel_are_timed_once(tmp_path, monkeypatch, name):
    """On the fp8 landing ring's path (Mistral-Small-4's fp8 cache) the ring's stages replace each Gluon candidate's,
    so the 12 candidates are 4 launches, one per register count: each is checked and timed once and its twins take
    its time, so the winner's stages are those that run, never a timing's noise. Where every candidate is its own
    launch (the 16-bit cache), each is timed."""
    from mlagen_compiler import tuning_search

    module = import_module_from_path(compile_spec(resolve_spec(name), tmp_path))
    cpu = torch.device("cpu")  # a GPU and the Gluon backend pretended; nothing is launched
    _pretend_gpu(monkeypatch, module, "sm90", H100)
    monkeypatch.setattr(module, "decode_backend", lambda *args, **kwargs: ("gluon", ""))
    timed = []

    def clock(module, bucket, inputs, config, **_):  # more stages 'faster': what noise could rank
        timed.append(config)
        return 100.0 + config[1] / 8 - config[2]

    monkeypatch.setattr(tuning_search, "time_config", clock)
    monkeypatch.setattr(tuning_search, "_check_config", lambda *args: "")
    monkeypatch.setattr(tuning_search, "_reference", lambda *args: None)
    case = TuneCase("serving", module.DECODE_SMALL_BATCH + 8, 64, False)
    (bucket,) = (b for b in decode_buckets(module, [case], cpu) if b.bucket == "gluon")
    (result,) = tuning_search.tune_module(module, [bucket], device=cpu)
    registers = sorted({config[1] for config in bucket.configs})
    if name.endswith("fp8"):
        ring = module.DECODE_GLUON_LAND_RING_STAGES
        assert timed == [next(c for c in bucket.configs if c[1] == r) for r in registers]
        assert all(c[2] == ring for c in timed)  # (the space's first of each register count: the ring's stages)
        scores = {r.config: r.score_us for r in result.results}
        assert all(scores[c] == scores[(c[0], c[1], ring)] for c in bucket.configs)
        assert result.chosen == (64, registers[0], ring)
    else:
        assert timed == list(bucket.configs)
        assert result.chosen == (64, registers[0], max(c[2] for c in bucket.configs))


@INTERPRETER_ONLY
def test_the_tuner_times_portable_candidates_with_the_tile_as_given(tmp_path, monkeypatch):
    """The portable kernel's buckets: a candidate standing for the tuned entry plans the schedule config= forces
    (the portable kernel's blocks do not depend on whether a tile was given), on a GPU and under the interpreter,
    whose own configuration a production call takes instead of a tuned one."""
    from mlagen_compiler.tuning_search import decode_candidate_schedule

    spec = resolve_spec("mistral-small-4-fp8")
    module = import_module_from_path(compile_spec(spec, tmp_path))
    cpu = torch.device("cpu")
    for pretend in (True, False):
        with monkeypatch.context() as patch:
            if pretend:
                _pretend_gpu(patch, module, "sm90", H100)
            cases = [CASES["b128-s8k"], CASES["b4-s16k"]]
            buckets = [b for b in decode_buckets(module, cases, cpu) if b.bucket != "gluon"]
            assert {b.bucket.endswith("-small") for b in buckets} == {True, False}  # both regimes
            for bucket in buckets:
                q = torch.empty(bucket.cases[0].batch, bucket.seqlen_q, module.NUM_HEADS, 320, dtype=module.DTYPE)
                for config in bucket.configs:
                    timed = decode_candidate_schedule(module, bucket, q, config)
                    forced = module.get_decode_schedule(*q.shape[:2], cpu, config=config, backend="triton")
                    assert repr(timed) == repr(forced) and timed.config == config, (bucket.bucket, config)


def test_parse_buckets():
    from mlagen_compiler.tuning_search import parse_buckets

    assert parse_buckets("gluon, m16,m64-small,causal") == ["gluon", "m16", "m64-small", "causal"]
    bad_lists = (("m16,warp", "unknown bucket 'warp'"), (" , ", "no bucket given"), ("m", "unknown bucket 'm' "))
    for bad, fragment in bad_lists:
        with pytest.raises(ValueError, match=f"^--buckets: {fragment}"):
            parse_buckets(bad)
    result = CliRunner().invoke(app, ["tune", "--buckets", "gluon,nope", "deepseek-v3-tp8"])
    assert result.exit_code == 2 and "--buckets: unknown bucket 'nope'" in result.output


def test_config_labels_name_what_each_number_is():
    from mlagen_compiler.cli.tuning import _config_text

    assert _config_text("decode", (32, 4, 3)) == "n32w4s3"
    assert _config_text("decode", (64, 168, 2), "gluon") == "n64r168s2"  # registers, not warps
    assert _config_text("prefill", (128, 64, 8, 3), "causal") == "m128n64w8s3"


def _record_gluon_prefill_launches(monkeypatch, module):
    """The Gluon prefill's kernel replaced by a recorder (it cannot run here): its launches' (CAUSAL, BLOCK_N,
    STAGES), last first out."""
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **constexprs: launched.append(
                (constexprs["CAUSAL"], constexprs["BLOCK_N"], constexprs["STAGES"])
            )

    monkeypatch.setattr(module, "_mla_prefill_gluon_kernel", Recorder())
    return launched


@INTERPRETER_ONLY
def test_gluon_prefill_entries_reach_the_gluon_launch(tmp_path, monkeypatch):
    """Entries of buckets "gluon-causal" and "gluon-prefix" (block_n, stages) are taken by the Gluon prefill's
    causal and prefix launches on their GPU family and nowhere else; entries outside the plan's space are dropped;
    a forced configuration must be one of the space's, named in the one-line error."""
    from helpers import DEEPSEEK_V3_TP8_SPEC

    spec = spec_from_dict({**DEEPSEEK_V3_TP8_SPEC, "name": "tune-gluon-prefill", "kernels": ["prefill"]})
    plan = lower(spec).prefill.gluon
    assert plan.eligible and plan.default in plan.space
    causal_pick, prefix_pick = [c for c in plan.space if c != plan.default][:2]
    stale = (128, 4)  # does not fit shared memory: never in the space
    assert stale not in plan.space
    db = tmp_path / "db.json"
    write_db(
        db,
        [
            entry(spec, "gluon-causal", causal_pick, kernel="prefill"),
            entry(spec, "gluon-prefix", prefix_pick, kernel="prefill"),
            entry(spec, "gluon-causal", stale, kernel="prefill", gpu="NVIDIA H200"),
        ],
    )
    tuned = tuned_for_spec(spec, [db])
    assert tuned["prefill"] == {
        f"sm90|{H100}|gluon-causal": list(causal_pick),
        "sm90|*|gluon-causal": list(causal_pick),
        f"sm90|{H100}|gluon-prefix": list(prefix_pick),
        "sm90|*|gluon-prefix": list(prefix_pick),
    }
    module = import_module_from_path(compile_spec(spec, tmp_path / "tuned", tuned))
    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    assert (plan.space, plan.default) == (module.PREFILL_GLUON_SPACE, module.PREFILL_GLUON_DEFAULT)
    launched = _record_gluon_prefill_launches(monkeypatch, module)
    tokens, heads = 8, module.NUM_HEADS
    dn, dr, dv = module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM
    q = torch.zeros(tokens, heads, dn + dr, dtype=module.DTYPE)
    k_nope, k_pe = torch.zeros(tokens, heads, dn, dtype=module.DTYPE), torch.zeros(tokens, dr, dtype=module.DTYPE)
    v, out = torch.zeros(tokens, heads, dv, dtype=module.DTYPE), torch.zeros(tokens, heads, dv, dtype=module.DTYPE)
    cu = torch.tensor([0, tokens], dtype=torch.int32)

    def launch(causal, **config):
        """(CAUSAL, BLOCK_N, STAGES) of one Gluon launch (sections given: no L2 size asked of the CPU)."""
        module._launch_prefill_gluon(q, k_nope, k_pe, v, cu, cu, tokens, out, None, 0.1, causal, 1, **config)
        return launched.pop()

    _pretend_gpu(monkeypatch, module, "sm90", H100)
    assert launch(True) == (True, *causal_pick) and launch(False) == (False, *prefix_pick)
    assert launch(False, config=list(causal_pick)) == (False, *causal_pick)  # forced (the tuner's)
    _pretend_gpu(monkeypatch, module, "sm90", "NVIDIA H200")  # its entry is stale: the family's
    assert launch(True) == (True, *causal_pick)
    _pretend_gpu(monkeypatch, module, "sm100", "NVIDIA B200")  # no entry for its family: the default
    assert launch(True) == (True, *plan.default) and launch(False) == (False, *plan.default)
    allowed = re.escape(str(list(plan.space)))
    for bad in ((128, 64, 8, 2), (128, 4), "128x2"):
        with pytest.raises(ValueError, match=rf"^config: the Gluon prefill takes \(block_n, stages\) in {allowed}, "):
            launch(True, config=bad)
    assert not launched


def test_tuned_gluon_prefill_configs_are_checked_as_launches_take_them():
    from mlagen_compiler.launch_policy import check_tuned_config

    assert check_tuned_config("prefill", "gluon-causal", [64, 3]) == (64, 3)
    assert check_tuned_config("prefill", "gluon-prefix", (128, 2)) == (128, 2)
    for bad in ((128, 64, 8, 2), (128, 0), (128, True)):
        with pytest.raises(ValueError, match=r"^config: expected \(block_n, stages\) of ints >= 1, got "):
            check_tuned_config("prefill", "gluon-causal", bad)
    with pytest.raises(ValueError, match=r"^config: expected \(block_m, block_n"):
        check_tuned_config("prefill", "causal", (128, 2))  # the portable kernel's bucket: its own kind
    spec = spec_from_dict({**FIELDS, "kernels": ["prefill"]})
    with pytest.raises(ValueError, match=r"^tuned\['prefill'\]\['sm90\|\*\|gluon-prefix'\]: config: expected"):
        module_source(spec, {"prefill": {"sm90|*|gluon-prefix": [64, 4, 2]}})


@INTERPRETER_ONLY
def test_gluon_prefill_buckets_where_the_gluon_prefill_runs(tmp_path, monkeypatch):
    """The tuner's Gluon prefill buckets: built where the Gluon prefill runs (Hopper, a geometry it takes) on the
    prefill cases over its space, left out elsewhere with the reason; each configuration checked with the Gluon
    backend forced (reaching the Gluon launch of mla_prefill and both launches of chunked prefill) and timed
    through _launch_prefill_gluon; the winners' entries reach the module's table."""
    from mlagen_compiler import tuning_search
    from mlagen_compiler.cli.tuning import _config_text
    from mlagen_compiler.tuning_search import gluon_prefill_unavailable, parse_buckets

    spec = spec_from_dict({**PINNED, "name": "tune-gluon-prefill-small", "kernels": ["prefill"]})
    plan = lower(spec).prefill.gluon
    module = import_module_from_path(compile_spec(spec, tmp_path / "module"))
    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    new_only = TuneCase("tiny-pf-new", 2, 24, False, "prefill")
    cases = [TINY_CASES[2], new_only, TINY_CASES[0]]  # with a prefix, without, and a decode case
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # cuda never touched: the GPU pretended
    portable = ["causal", "prefix"]

    def bucket_names(device):
        return [b.bucket for b in prefill_buckets(module, cases, device)]

    # where it cannot run: the portable buckets only, and why
    assert bucket_names(None) == bucket_names(cuda) == portable and gluon_prefill_unavailable(module, None)
    interpreting = "backend: 'gluon' cannot run here: TRITON_INTERPRET=1: Triton's interpreter cannot run Gluon kernels"
    assert gluon_prefill_unavailable(module, cuda) == interpreting
    _pretend_gpu(monkeypatch, module, "sm90", H100)
    assert gluon_prefill_unavailable(module, cpu) == "backend: 'gluon' cannot run here: not a CUDA device"
    assert bucket_names(cpu) == portable
    monkeypatch.setattr(module, "_gpu_capability", lambda device: (8, 0))
    assert "compute capability 8.0" in gluon_prefill_unavailable(module, cuda) and bucket_names(cuda) == portable
    odd = spec_from_dict({**FIELDS, "name": "no-gluon-prefill", "qk_nope_head_dim": 48, "kernels": ["prefill"]})
    odd_module = import_module_from_path(compile_spec(odd, tmp_path / "odd"))
    assert "geometry not taken by the Gluon prefill: Dn = 48" in gluon_prefill_unavailable(odd_module, cuda)
    # on Hopper: both Gluon buckets, over the plan's space, on the cases that reach their launch
    monkeypatch.setattr(module, "_gpu_capability", lambda device: (9, 0))
    assert gluon_prefill_unavailable(module, cuda) == ""
    buckets = {b.bucket: b for b in prefill_buckets(module, cases, cuda)}
    assert list(buckets) == [*portable, "gluon-causal", "gluon-prefix"]
    for name, reached in (("gluon-causal", (TINY_CASES[2], new_only)), ("gluon-prefix", (TINY_CASES[2],))):
        bucket = buckets[name]
        assert (bucket.kernel, bucket.configs, bucket.default, bucket.cases) == ("prefill", plan.space, plan.default,
                                                                                 reached)  # fmt: skip
    assert parse_buckets("gluon-causal,gluon-prefix,causal") == ["gluon-causal", "gluon-prefix", "causal"]
    assert _config_text("prefill", (64, 3), "gluon-prefix") == "n64s3"

    # the check and the timed call reach the Gluon launch with the configuration (the portable kernel in the
    # interpreter stands in for it, so the check compares real results with the reference)
    seen = []

    def gluon_stand_in(q, k_nope, k_pe, v, cu_q, cu_k, max_seqlen_q, out, lse, scale, causal, sections=None,
                       config=None, launch=None, warpgroups=None):  # fmt: skip
        # (the tuner times the two-warpgroup kernel, whose tile the buckets hold; mla_prefill leaves it to the option)
        assert warpgroups in (None, 2)
        seen.append((causal, k_nope.shape[0], tuple(config)))
        with monkeypatch.context() as interpreting:
            interpreting.setattr(module, "_INTERPRET", True)  # (the interpreter's upcast dots)
            module._launch_prefill(q, k_nope, k_pe, v, cu_q, cu_k, max_seqlen_q, out, lse, scale, causal,
                                   module.PREFILL_INTERPRETER_CONFIG, launch=launch)  # fmt: skip

    monkeypatch.setattr(module, "_launch_prefill_gluon", gluon_stand_in)
    config = plan.space[-1]
    inputs = tuning_search._bucket_inputs(module, buckets["gluon-prefix"], [24, 24], 20, torch.Generator(), cpu)
    assert tuning_search._check_config(module, buckets["gluon-prefix"], inputs, config, None) == ""
    # mla_prefill (causal), then chunked prefill's prefix launch and causal launch, all with the forced config
    assert [(causal, c) for causal, _, c in seen] == [(True, config), (False, config), (True, config)]
    seen.clear()
    tuning_search._timed_call(module, buckets["gluon-prefix"], inputs, config)()
    tuning_search._timed_call(module, buckets["gluon-causal"], inputs, config)()
    assert seen == [(False, 40, config), (True, 48, config)]  # the prefixes' keys, then the new tokens'

    # tune_module on the Gluon buckets (the default and one other configuration; a fake clock that makes the other
    # faster), its entries written and picked up by a module built from them
    pick = next(c for c in plan.space if c != plan.default)
    monkeypatch.setattr(
        tuning_search, "time_config", lambda module, bucket, inputs, config, **_: 50.0 if config == pick else 100.0
    )
    gluon_buckets = [
        dataclasses.replace(buckets[b], configs=(plan.default, pick)) for b in ("gluon-causal", "gluon-prefix")
    ]
    results = tuning_search.tune_module(module, gluon_buckets, device=cpu)
    assert [(r.kernel, r.bucket, r.chosen) for r in results] == [
        ("prefill", "gluon-causal", pick),
        ("prefill", "gluon-prefix", pick),
    ]
    db = tmp_path / "db.json"
    write_db(db, entries_from_results(results))
    built = import_module_from_path(compile_spec(spec, tmp_path / "from-db", tuned_for_spec(spec, [db])))
    tuned = built.PREFILL_TUNED
    assert tuned == {("sm90", gpu, bucket): pick for gpu in (H100, "*") for bucket in ("gluon-causal", "gluon-prefix")}
