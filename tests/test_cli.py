import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mlagen_compiler.cli import app
from mlagen_compiler.module_file import import_module_from_path

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_compile_writes_module_with_contract(tmp_path):
    result = run("compile", "deepseek-v3-tp8", "mistral-small-4", "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    module = import_module_from_path(tmp_path / "deepseek_v3_tp8.py")
    assert module.SPEC["name"] == "deepseek-v3-tp8" and module.SPEC["num_heads"] == 16
    assert callable(module.mla_decode)
    assert (tmp_path / "mistral_small_4.py").exists()


def test_list_and_show():
    listing = run("list")
    assert listing.exit_code == 0
    assert "deepseek-v3-tp8/decode" in listing.output and "mistral-small-4" in listing.output
    shown = run("show", "kimi-k2")
    assert shown.exit_code == 0 and '"num_heads": 64' in shown.output and '"dc_pad": 512' in shown.output
    # an fp8 cache: the plan names it, and the Gluon decode takes it, converted
    shown = run("show", "deepseek-v3-tp8-fp8")
    assert shown.exit_code == 0 and '"cache_dtype": "float8_e4m3fn"' in shown.output
    assert "gluon (float8_e4m3fn cache converted to float16 in shared memory; landed by TMA" in shown.output


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["compile", "deepseek-v3"], "did you mean"),
        (["show", "nope.yaml"], "cannot read spec file"),
        (["compile"], "no spec given"),
    ],
)
def test_errors_are_one_line_exit_2(args, fragment):
    result = run(*args)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mlagen: error:") and fragment in lines[0]
    assert "Traceback" not in result.output


def test_invalid_spec_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\nnum_heads: 300\nkv_lora_rank: 512\nqk_rope_head_dim: 64\nqk_nope_head_dim: 128\nv_head_dim: 128\n"
    )
    result = run("compile", str(bad), "-o", str(tmp_path))
    assert result.exit_code == 2 and "num_heads=300 is not allowed: must be in 1..256" in result.output


def test_verify_in_subprocess():
    """The real console entry point: prints a table and exits 0 when every case passes."""
    proc = subprocess.run(
        [sys.executable, "-m", "mlagen_compiler.cli", "verify", "deepseek-v2-lite"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "deepseek-v2-lite" in proc.stdout and "PASS" in proc.stdout and "0 failed" in proc.stdout
