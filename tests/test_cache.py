"""The content-addressed compile cache: hits and misses, what the key covers, damaged entries, many
processes compiling one spec at once (CPU only)."""

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import SMALL_SPEC
from typer.testing import CliRunner

import mlagen_compiler
from mlagen_compiler import cache
from mlagen_compiler.cache import CacheIntegrityWarning, cache_key, cached_module_path, list_entries
from mlagen_compiler.module_file import import_module_from_path, module_source
from mlagen_compiler.spec import load_spec, spec_from_dict

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {**SMALL_SPEC, "name": "cache-me", "num_heads": 8}
YAML = """\
# a small spec for the cache tests
name: cache-me
num_heads: 8
kv_lora_rank: 64
qk_rope_head_dim: 16
qk_nope_head_dim: 32
v_head_dim: 32
page_size: 16
dtype: float16
"""
# the same spec: other key order, comments, whitespace, quoting
YAML_REORDERED = """\
dtype:   "float16"    # fp16 this time
page_size: 16

v_head_dim: 32
qk_nope_head_dim: 32
qk_rope_head_dim: 16
kv_lora_rank: 64
num_heads: 8
name: 'cache-me'
"""


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(root))
    monkeypatch.setenv("MLAGEN_TUNING_DB", str(tmp_path / "no-user-tuning.json"))
    return root


def _entry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_cache_dir_from_env_and_platform(monkeypatch, tmp_path):
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "x"))
    assert cache.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("MLAGEN_CACHE_DIR")
    import platformdirs

    assert cache.cache_dir() == Path(platformdirs.user_cache_dir("mlagen", appauthor=False))


def test_miss_then_hit(cache_root):
    spec = spec_from_dict(FIELDS)
    first = cached_module_path(spec)
    assert first.built and first.path.is_relative_to(cache_root)
    assert first.path.read_text() == module_source(spec)
    mtime = first.path.stat().st_mtime_ns
    second = cached_module_path(spec)
    assert not second.built and second.path == first.path and second.path.stat().st_mtime_ns == mtime
    manifest = json.loads((first.path.parent / "manifest.json").read_text())
    assert manifest["sha256"] == hashlib.sha256(first.path.read_bytes()).hexdigest()
    assert manifest["key"] == first.key and manifest["spec_hash"] == spec.content_hash()


@pytest.mark.parametrize("shipped_db", [False, True], ids=["no-tuning-db", "shipped-tuning-db"])
def test_load_lowers_the_spec_once(cache_root, monkeypatch, shipped_db):
    # the tuned entries are looked up and the module rendered for one plan, on a miss and on a hit
    from mlagen_compiler import module_file, tuning_db
    from mlagen_compiler import plan as plan_stage

    lowered = []

    def counting_lower(spec):
        lowered.append(spec.name)
        return plan_stage.lower(spec)

    for stage in (cache, module_file, tuning_db):
        monkeypatch.setattr(stage, "lower", counting_lower)
    dbs = tuning_db.shipped_db_paths() if shipped_db else []
    for built in (True, False):
        lowered.clear()
        module = cache.load(spec_from_dict(FIELDS), tuning_dbs=dbs)
        assert lowered == ["cache-me"], f"cache {'miss' if built else 'hit'}: lowered {len(lowered)} times"
        assert FIELDS["num_heads"] == module.NUM_HEADS


def test_load_by_name_path_and_object_returns_working_module(cache_root, tmp_path):
    path = tmp_path / "cache-me.yaml"
    path.write_text(YAML)
    by_path = mlagen_compiler.load(path)
    assert by_path.SPEC["name"] == "cache-me" and callable(by_path.mla_decode)
    assert mlagen_compiler.load(spec_from_dict(FIELDS)) is by_path
    assert mlagen_compiler.load("cache-me", spec_dirs=[tmp_path]) is by_path
    bundled = mlagen_compiler.load("deepseek-v3-tp8")
    assert bundled.SPEC["name"] == "deepseek-v3-tp8" and Path(bundled.__file__).is_relative_to(cache_root)
    assert len(list_entries(cache_root)) == 2


def test_key_ignores_yaml_formatting(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(YAML)
    b.write_text(YAML_REORDERED)
    assert cache_key(load_spec(a)) == cache_key(load_spec(b)) == cache_key(spec_from_dict(FIELDS))


def test_key_covers_what_changes_the_output(monkeypatch):
    spec = spec_from_dict(FIELDS)
    base = cache_key(spec)
    assert cache_key(spec) == base  # deterministic
    assert cache_key(spec_from_dict({**FIELDS, "page_size": 32})) != base
    assert cache_key(spec_from_dict({**FIELDS, "dtype": "bfloat16"})) != base
    assert cache_key(spec_from_dict({**FIELDS, "softmax_scale": 0.125})) != base
    assert cache_key(spec, {"decode": {"NVIDIA H100 80GB HBM3|m16": [64, 4, 2]}}) != base
    assert cache_key(spec, triton="9.9.9") != base
    monkeypatch.setattr(cache, "__version__", "99.0")
    assert cache_key(spec) != base
    monkeypatch.undo()
    monkeypatch.setattr(cache, "templates_digest", lambda: "0" * 64)
    assert cache_key(spec) != base


def test_template_change_makes_a_new_entry(cache_root, monkeypatch):
    spec = spec_from_dict(FIELDS)
    first = cached_module_path(spec)
    monkeypatch.setattr(cache, "templates_digest", lambda: "f" * 64)
    second = cached_module_path(spec)
    assert second.built and second.path != first.path


def _replace_with_directory(path: Path) -> None:
    path.unlink()
    (path / "stray").mkdir(parents=True)


def _replace_with_file(path: Path) -> None:
    import shutil

    shutil.rmtree(path)
    path.write_text("not a directory")


@pytest.mark.parametrize(
    ("damage", "warning"),
    [
        ("truncate", "damaged .*does not match its recorded sha256"),
        ("edit", "damaged .*does not match its recorded sha256"),
        ("drop_manifest", "damaged .*manifest.json is missing"),
        ("garble_manifest", "damaged .*manifest.json is unreadable"),
        ("manifest_is_directory", "damaged .*manifest.json is a directory"),
        ("module_is_directory", "damaged .*cache_me.py is a directory"),
        ("entry_is_file", "damaged .*the entry is a file"),
        ("modules_is_file", "modules is not a directory; replacing it"),
        # both are damaged: the lock folder is replaced, then the entry rebuilt under it
        (
            "locks_is_file_and_entry_lost",
            ("locks is not a directory; replacing it", "damaged .*manifest.json is missing"),
        ),
    ],
)
def test_damaged_entry_is_rebuilt_with_warning(cache_root, damage, warning):
    spec = spec_from_dict(FIELDS)
    good = cached_module_path(spec)
    original = good.path.read_bytes()
    manifest = good.path.parent / "manifest.json"
    if damage == "truncate":
        good.path.write_bytes(original[: len(original) // 2])
    elif damage == "edit":
        good.path.write_bytes(original.replace(b"SOFTMAX_SCALE = ", b"SOFTMAX_SCALE = 2 * "))
    elif damage == "drop_manifest":
        manifest.unlink()
    elif damage == "garble_manifest":
        manifest.write_text("{not json")
    elif damage == "manifest_is_directory":
        _replace_with_directory(manifest)
    elif damage == "module_is_directory":
        _replace_with_directory(good.path)
    elif damage == "entry_is_file":
        _replace_with_file(good.path.parent)
    elif damage == "modules_is_file":
        _replace_with_file(cache_root / "modules")
    else:  # an intact entry needs no lock; a lost one must be rebuilt under it
        _replace_with_file(cache_root / "locks")
        manifest.unlink()
    expected = (warning,) if isinstance(warning, str) else warning
    with pytest.warns(CacheIntegrityWarning) as record:
        again = cached_module_path(spec)
    messages = [str(entry.message) for entry in record]
    for pattern in expected:
        assert any(re.search(pattern, message) for message in messages), (pattern, messages)
    unexpected = [message for message in messages if not any(re.search(p, message) for p in expected)]
    assert not unexpected, unexpected
    assert again.built and again.path == good.path
    assert good.path.read_bytes() == original
    assert json.loads(manifest.read_text())["sha256"] == hashlib.sha256(original).hexdigest()
    module = import_module_from_path(good.path, f"mlagen_test_damaged_{damage}")
    assert module.SPEC["name"] == "cache-me"


def test_load_warns_and_rebuilds_truncated_entry(cache_root):
    module = mlagen_compiler.load(spec_from_dict(FIELDS))
    path = Path(module.__file__)
    path.write_text(path.read_text()[:100])
    with pytest.warns(CacheIntegrityWarning):
        mlagen_compiler.load(spec_from_dict(FIELDS))
    assert path.read_text() == module_source(spec_from_dict(FIELDS))


WORKER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from mlagen_compiler.cache import cached_module_path
    from mlagen_compiler.spec import load_spec

    spec_path, go, ready = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    spec = load_spec(spec_path)
    ready.touch()
    while not go.exists():
        time.sleep(0.001)
    result = cached_module_path(spec)
    print(json.dumps({"path": str(result.path), "built": result.built}))
    """
)


def test_eight_processes_compile_one_spec_once(cache_root, tmp_path):
    spec_path = tmp_path / "cache-me.yaml"
    spec_path.write_text(YAML)
    go = tmp_path / "go"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "always"}
    procs = []
    for i in range(8):
        ready = tmp_path / f"ready-{i}"
        cmd = [sys.executable, "-c", WORKER, str(spec_path), str(go), str(ready)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{i}").exists() for i in range(8)):
        assert time.monotonic() < deadline, "workers did not start"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.01)
    go.touch()  # everyone starts at once
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "Traceback" not in err and "Warning" not in err, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert len({o["path"] for o in outputs}) == 1
    assert sum(o["built"] for o in outputs) == 1, outputs  # the lock and the re-check: built exactly once
    path = Path(outputs[0]["path"])
    spec = load_spec(spec_path)
    assert path.read_text() == module_source(spec)
    entries = list_entries(cache_root)
    assert len(entries) == 1 and cache.entry_is_intact(entries[0])
    leftovers = [p for p in _entry_files(cache_root) if p.suffix == ".tmp" or p.name.startswith(".")]
    assert not leftovers, leftovers
    assert import_module_from_path(path, "mlagen_test_concurrent").SPEC["name"] == "cache-me"


def test_cli_cache_info_and_clear(cache_root):
    from mlagen_compiler.cli import app

    runner = CliRunner()
    mlagen_compiler.load(spec_from_dict(FIELDS))
    info = runner.invoke(app, ["cache", "info"])
    assert info.exit_code == 0, info.output
    assert str(cache_root) in info.output and "1 module(s)" in info.output and "cache-me" in info.output
    cleared = runner.invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 1" in cleared.output
    assert list_entries(cache_root) == []
    assert "0 module(s)" in runner.invoke(app, ["cache", "info"]).output
    # and the next load compiles again
    assert cached_module_path(spec_from_dict(FIELDS)).built


def test_cli_env(cache_root):
    from mlagen_compiler.cli import app

    result = CliRunner().invoke(app, ["env"])
    assert result.exit_code == 0, result.output
    for fragment in ("mlagen", "torch", "triton", "gpu", str(cache_root), "tuning (shipped)", "h100.json"):
        assert fragment in result.output
