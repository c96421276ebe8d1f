"""Bad input to the CLI, the spec loader, the compile cache and `load`: one-line errors naming the file,
field or argument (exit code 2 on the command line), never a traceback or a silently dropped input."""

import re
from pathlib import Path

import pytest
import yaml

import mlagen_compiler
from mlagen_compiler.cache import CacheError
from mlagen_compiler.cli import main

ROOT = Path(__file__).resolve().parents[1]
LITE = (ROOT / "specs" / "deepseek-v2-lite.yaml").read_text()


def run_main(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def spec_file(directory: Path, file_name: str, **replace: str) -> Path:
    """The deepseek-v2-lite spec with top-level fields replaced by YAML snippets (mappings included)."""
    fields = {**yaml.safe_load(LITE), **{key: yaml.safe_load(value) for key, value in replace.items()}}
    text = yaml.safe_dump(fields, sort_keys=False)
    path = directory / file_name
    path.write_text(text)
    return path


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlagen: error: "), err
    return lines[0]


def test_two_specs_with_one_name_are_refused(tmp_path, capsys):
    a = spec_file(tmp_path, "a.yaml", name="same")
    b = spec_file(tmp_path, "b.yaml", name="same", page_size="16")
    code, out, err = run_main(capsys, "compile", str(a), str(b), "-o", str(tmp_path / "out"))
    line = one_error_line(err)
    assert code == 2 and str(a) in line and str(b) in line and "'same'" in line
    assert not (tmp_path / "out").exists()  # nothing half-done


def test_the_same_spec_twice_compiles_once(tmp_path, capsys):
    a = spec_file(tmp_path, "a.yaml", name="same")
    code, out, err = run_main(capsys, "compile", str(a), str(a), "-o", str(tmp_path / "out"))
    assert code == 0 and out.count("wrote") == 1 and not err


@pytest.mark.parametrize(
    ("replace", "fragment"),
    [
        ({"softmax_scale": ".inf"}, "softmax_scale: Input should be a finite number (got inf)"),
        ({"softmax_scale": ".nan"}, "softmax_scale: Input should be a finite number (got nan)"),
        (
            {"rope_scaling": "{type: yarn, factor: .inf, mscale_all_dim: 1.0}"},
            "rope_scaling.factor: Input should be a finite number (got inf)",
        ),
        (
            {"rope_scaling": "{type: yarn, factor: 40, mscale_all_dim: .nan}"},
            "rope_scaling.mscale_all_dim: Input should be a finite number (got nan)",
        ),
    ],
)
def test_non_finite_numbers_in_a_spec_are_refused(tmp_path, capsys, replace, fragment):
    path = spec_file(tmp_path, "x.yaml", name="x", **replace)
    code, _, err = run_main(capsys, "compile", str(path), "-o", str(tmp_path / "out"))
    assert code == 2 and one_error_line(err) == f"mlagen: error: {path}: {fragment}"
    with pytest.raises(mlagen_compiler.SpecError, match="finite"):
        mlagen_compiler.load(path)


def test_binary_spec_file_names_the_file(tmp_path, capsys):
    path = tmp_path / "bin.yaml"
    path.write_bytes(bytes(range(128, 256)))
    code, _, err = run_main(capsys, "compile", str(path), "-o", str(tmp_path / "out"))
    assert code == 2 and f"{path}: not a YAML text file" in one_error_line(err)


def test_output_directory_that_is_a_file_names_the_option(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("keep me")
    code, _, err = run_main(capsys, "compile", "deepseek-v2-lite", "-o", str(target))
    assert code == 2 and one_error_line(err) == f"mlagen: error: -o {target}: exists and is not a directory"
    assert target.read_text() == "keep me"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["compile", "--bogus"], "No such option: --bogus (see 'mlagen compile --help')"),
        (["show"], "Missing argument 'spec'."),
        (["verify", "deepseek-v2-lite", "--seed", str(2**70)], "Invalid value for '--seed'"),
        (["verify", "deepseek-v2-lite", "--seed", "-1"], "Invalid value for '--seed'"),
        (["nosuchcommand"], "No such command 'nosuchcommand'"),
    ],
)
def test_usage_errors_are_one_line_exit_2(capsys, argv, fragment):
    code, _, err = run_main(capsys, *argv)
    assert code == 2 and fragment in one_error_line(err)


@pytest.mark.parametrize("bad", [None, 123, 4.5, ["deepseek-v2-lite"]])
def test_load_names_what_it_takes(bad):
    with pytest.raises(TypeError, match=r"^spec: expected a registered spec name, a YAML path or an MLASpec, got "):
        mlagen_compiler.load(bad)


def test_one_spec_directory_given_as_a_string(tmp_path, monkeypatch):
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec_file(tmp_path, "mine.yaml", name="mine", num_heads="2", kernels="[decode]")
    module = mlagen_compiler.load("mine", spec_dirs=str(tmp_path))
    assert module.SPEC["name"] == "mine" and module.NUM_HEADS == 2


@pytest.mark.parametrize(
    ("inside", "problem"), [(False, "is a file, not a directory"), (True, "cannot be written (Not a directory)")]
)
def test_unusable_cache_directory_is_one_line_naming_the_variable(tmp_path, monkeypatch, inside, problem):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    root = blocker / "cache" if inside else blocker
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(root))
    with pytest.raises(CacheError, match=re.escape(f"MLAGEN_CACHE_DIR={root} {problem}")):
        mlagen_compiler.load("deepseek-v2-lite")
    assert blocker.read_text() == "keep me"  # the user's file is never touched


@pytest.mark.parametrize(
    "name", ["MLAGEN_RAW_LAUNCH", "MLAGEN_DECODE_TMA", "MLAGEN_DIRECT_LAUNCH", "MLAGEN_DECODE_PDL"]
)
def test_module_switches_take_0_or_1_and_name_a_wrong_value(name):
    """A generated module's on/off environment variables: "0" / "1" import; anything else (e.g. "off", which
    would otherwise silently mean on) is a ValueError naming the variable and the value."""
    import os
    import subprocess
    import sys

    code = "import sys; sys.path.insert(0, 'generated'); import deepseek_v3_tp8"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLAGEN_")}
    for value in ("0", "1"):
        ok = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, name: value}, capture_output=True)
        assert ok.returncode == 0, ok.stderr.decode()[-2000:]
    bad = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, name: "off"}, capture_output=True)
    assert bad.returncode != 0
    assert f"ValueError: {name}: expected 0 or 1, got 'off'" in bad.stderr.decode()
