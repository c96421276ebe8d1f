"""The spec registry: bundled specs by name with the kernels they emit, user spec directories (argument
and MLAGEN_SPEC_PATH), and errors that list the close matches."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlagen_compiler.cli import app
from mlagen_compiler.paths import bundled_spec_dir
from mlagen_compiler.registry import registered_specs, resolve_kernel, resolve_spec, spec_dirs
from mlagen_compiler.spec import MLASpec, SpecError

BUNDLED = [
    "deepseek-v2",
    "deepseek-v2-lite",
    "deepseek-v3-tp1",
    "deepseek-v3-tp2",
    "deepseek-v3-tp4",
    "deepseek-v3-tp8",
    "deepseek-v3-tp8-fp8",
    "kimi-k2",
    "mistral-small-4",
    "mistral-small-4-fp8",
]
USER_SPEC = """\
name: {name}
num_heads: {heads}
kv_lora_rank: 256
qk_rope_head_dim: 32
qk_nope_head_dim: 64
v_head_dim: 64
kernels: [decode]
"""


def user_dir(tmp_path: Path, name="my-model", heads=40, file_name=None) -> Path:
    directory = tmp_path / "specs"
    directory.mkdir(exist_ok=True)
    (directory / f"{file_name or name}.yaml").write_text(USER_SPEC.format(name=name, heads=heads))
    return directory


def test_bundled_specs_are_registered_by_name():
    known = registered_specs()
    assert set(BUNDLED) <= set(known)
    for name in BUNDLED:
        spec = resolve_spec(name)
        assert spec.name == name and known[name].parent == bundled_spec_dir()
        assert "decode" in spec.kernels


def test_name_kernel_and_path_and_object():
    spec, kernel = resolve_kernel("deepseek-v3-tp8/decode")
    assert spec.name == "deepseek-v3-tp8" and kernel == "decode"
    assert resolve_kernel("deepseek-v3-tp8") == (spec, None)
    assert resolve_spec(bundled_spec_dir() / "deepseek-v3-tp8.yaml") == spec
    assert resolve_spec(spec) is spec and isinstance(spec, MLASpec)


@pytest.mark.parametrize(
    ("arg", "fragments"),
    [
        ("deepseek-v3", ["did you mean", "deepseek-v3-tp8", "deepseek-v3-tp4"]),
        ("kimi-k3/decode", ["did you mean kimi-k2"]),
        ("zzzzzz", ["registered: deepseek-v2, deepseek-v2-lite"]),
        ("deepseek-v3-tp8/prefil", ["does not emit a 'prefil' kernel", "deepseek-v3-tp8/decode"]),
        ("missing.yaml", ["cannot read spec file"]),
    ],
)
def test_unknown_names_list_close_matches(arg, fragments):
    with pytest.raises(SpecError) as info:
        resolve_spec(arg)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_user_directory_by_argument_and_environment(tmp_path, monkeypatch):
    directory = user_dir(tmp_path)
    monkeypatch.delenv("MLAGEN_SPEC_PATH", raising=False)
    with pytest.raises(SpecError, match="no such file or registered spec"):
        resolve_spec("my-model")
    assert resolve_spec("my-model", [directory]).num_heads == 40
    assert spec_dirs([directory])[-1] == directory
    monkeypatch.setenv("MLAGEN_SPEC_PATH", f"{tmp_path / 'nowhere'}:{directory}")
    assert resolve_spec("my-model").num_heads == 40
    assert "my-model" in registered_specs()


def test_user_spec_shadows_bundled(tmp_path):
    directory = user_dir(tmp_path, name="kimi-k2", heads=7)
    assert resolve_spec("kimi-k2").num_heads == 64
    assert resolve_spec("kimi-k2", [directory]).num_heads == 7


def test_file_name_must_match_name_field(tmp_path):
    directory = user_dir(tmp_path, name="inner-name", file_name="outer-name")
    with pytest.raises(SpecError, match="registered as 'outer-name' but its name field is 'inner-name'"):
        resolve_spec("outer-name", [directory])


def test_cli_list_shows_kernels_and_directories(tmp_path):
    directory = user_dir(tmp_path)
    result = CliRunner().invoke(app, ["list", "--spec-dir", str(directory)])
    assert result.exit_code == 0, result.output
    for name in BUNDLED:
        assert f"{name}/decode" in result.output
    assert "my-model/decode" in result.output
    assert str(bundled_spec_dir()) in result.output and str(directory) in result.output


def test_cli_spec_dir_on_commands(tmp_path):
    directory = user_dir(tmp_path)
    runner = CliRunner()
    shown = runner.invoke(app, ["show", "my-model", "--spec-dir", str(directory)])
    assert shown.exit_code == 0 and '"num_heads": 40' in shown.output
    out = tmp_path / "out"
    compiled = runner.invoke(app, ["compile", "my-model", "--spec-dir", str(directory), "-o", str(out)])
    assert compiled.exit_code == 0 and (out / "my_model.py").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["show", "my-modle"], "did you mean my-model"),
        (["list", "--spec-dir", "/no/such/dir"], "not a directory"),
        (["compile", "deepseek-v3-tp8/encode"], "does not emit a 'encode' kernel"),
    ],
)
def test_cli_registry_errors_are_one_line(tmp_path, args, fragment):
    directory = user_dir(tmp_path)
    if args[0] == "show":
        args = [*args, "--spec-dir", str(directory)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mlagen: error:") and fragment in lines[0], result.output
