"""The supported Triton range: declared once, checked at import of a generated module, shown by the CLI."""

import re
import sys
import warnings
from pathlib import Path

import pytest
import tomllib
import triton
from typer.testing import CliRunner

from mlagen_compiler import import_module_from_path
from mlagen_compiler import triton_support as ts
from mlagen_compiler.cli import app

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_declares_the_supported_range():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if d.startswith("triton")] == [f"triton{ts.TRITON_REQUIREMENT}"]
    assert ">={}.{},<{}.{}".format(*ts.TRITON_MIN, *ts.TRITON_BELOW) == ts.TRITON_REQUIREMENT


def test_ci_environments_are_the_tested_releases_and_inside_the_range():
    pinned = []
    for path in sorted((ROOT / "requirements").glob("triton-*.txt")):
        (pin,) = re.findall(r"^triton==(\S+)$", path.read_text(), re.M)
        assert path.name == "triton-{}.{}.txt".format(*ts.release(pin))
        pinned.append(pin)
    assert sorted(pinned) == sorted(ts.TRITON_TESTED)
    assert all(ts.triton_supported(v) for v in pinned)


def test_this_run_uses_a_tested_triton():
    assert triton.__version__ in ts.TRITON_TESTED, f"triton {triton.__version__} is not one CI tests"


@pytest.mark.parametrize(
    ("version", "release", "supported"),
    [
        ("3.5.1", (3, 5), False),
        ("3.6.0", (3, 6), True),
        ("3.9.0+git1a2b3c4", (3, 9), True),
        ("3.10.0", (3, 10), False),
        ("4.0.0", (4, 0), False),
        ("nightly", None, False),
    ],
)
def test_release_and_range(version, release, supported):
    assert ts.release(version) == release
    assert ts.triton_supported(version) is supported
    assert (ts.unsupported_message(version) is None) is supported


def test_no_triton_is_unsupported_with_a_message():
    assert not ts.triton_supported(None)
    assert "no triton installation" in ts.unsupported_message(None)


def _import_fresh(path, name):
    sys.modules.pop(name, None)
    try:
        return import_module_from_path(path, name)
    finally:
        sys.modules.pop(name, None)


def test_generated_module_warns_once_at_import_outside_the_range(build_module, monkeypatch):
    path = Path(
        build_module(
            name="range", num_heads=2, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16
        ).__file__
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inside the range: no warning at all
        _import_fresh(path, "mlagen_range_inside")
    monkeypatch.setattr(triton, "__version__", "3.5.0")
    with pytest.warns(UserWarning) as record:
        module = _import_fresh(path, "mlagen_range_outside")
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and "found triton 3.5.0" in messages[0] and ts.TRITON_REQUIREMENT in messages[0]
    assert module.TRITON_VERSION == (3, 5)


def test_env_and_compile_say_whether_triton_is_supported(tmp_path, monkeypatch):
    runner = CliRunner()
    result = runner.invoke(app, ["env"])
    assert result.exit_code == 0
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("triton ")]
    assert triton.__version__ in line and f"inside the supported range {ts.TRITON_REQUIREMENT}" in line

    monkeypatch.setattr(ts, "triton_version", lambda: "3.2.0")
    result = runner.invoke(app, ["env"])
    assert "3.2.0  (OUTSIDE the supported range" in result.output
    result = runner.invoke(app, ["compile", "deepseek-v2-lite", "-o", str(tmp_path)])
    assert result.exit_code == 0
    warned = [ln for ln in result.output.splitlines() if ln.startswith("mlagen: warning:")]
    assert len(warned) == 1 and "found triton 3.2.0" in warned[0]
    assert (tmp_path / "deepseek_v2_lite.py").exists()
