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


# ---- no silent coercion, no overflow inside the kernels, no deleted files, no hang ---------------------


@pytest.mark.parametrize(
    ("replace", "fragment"),
    [
        ({"num_heads": "true"}, "num_heads: Input should be a valid integer (got True)"),
        ({"num_heads": "'16'"}, "num_heads: Input should be a valid integer (got '16')"),
        ({"num_heads": "16.0"}, "num_heads: Input should be a valid integer (got 16.0)"),
        ({"kv_lora_rank": "false"}, "kv_lora_rank: Input should be a valid integer (got False)"),
        ({"page_size": "'64'"}, "page_size: Input should be a valid integer (got '64')"),
        ({"q_lora_rank": "true"}, "q_lora_rank: Input should be a valid integer (got True)"),
        (
            {"tiles": "{decode: {num_warps: true}}"},
            "tiles.decode.num_warps: Input should be a valid integer (got True)",
        ),
        ({"tiles": "{prefill: {block_m: '64'}}"}, "tiles.prefill.block_m: Input should be a valid integer (got '64')"),
        ({"softmax_scale": "true"}, "softmax_scale: Input should be a valid number (got True)"),
        ({"softmax_scale": "'0.1'"}, "softmax_scale: Input should be a valid number (got '0.1')"),
        (
            {"rope_scaling": "{type: yarn, factor: '40', mscale_all_dim: 1.0}"},
            "rope_scaling.factor: Input should be a valid number (got '40')",
        ),
        (
            {"rope_scaling": "{type: yarn, factor: 40, mscale_all_dim: 1.0, original_max_position_embeddings: true}"},
            "rope_scaling.original_max_position_embeddings: Input should be a valid integer (got True)",
        ),
    ],
)
def test_spec_fields_take_their_own_type_only(tmp_path, capsys, replace, fragment):
    """A bool, a string or a float for an int (a bool or a string for a float) is an error naming the field,
    never converted (YAML `true` would be 1 head, '16' 16 heads)."""
    path = spec_file(tmp_path, "x.yaml", name="x", **replace)
    code, _, err = run_main(capsys, "show", str(path))
    assert code == 2 and one_error_line(err) == f"mlagen: error: {path}: {fragment}"


def test_an_exponent_without_a_dot_is_a_number(tmp_path):
    """YAML 1.1 reads 1e-1 as a string; the spec loader reads it as the number a user means."""
    path = spec_file(tmp_path, "x.yaml", name="x", rope_scaling="null")
    path.write_text(path.read_text() + "softmax_scale: 1e-1\n")
    assert mlagen_compiler.load_spec(path).softmax_scale == 0.1


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ("num_heads: 8\n", "key 'num_heads' is given twice (lines 5 and 22): give each key once"),
        ("tiles: {decode: {block_n: 32, block_n: 64}}\n", "key 'block_n' is given twice (lines 22 and 22)"),
    ],
)
def test_a_key_given_twice_is_refused(tmp_path, capsys, extra, fragment):
    path = tmp_path / "twice.yaml"
    path.write_text(LITE + extra)
    code, _, err = run_main(capsys, "show", str(path))
    assert code == 2 and f"mlagen: error: {path}: not valid YAML: {fragment}" in one_error_line(err)


def test_a_merge_key_may_be_overridden(tmp_path):
    """`<<: *base` then a key of its own is YAML's override, not a key given twice."""
    path = tmp_path / "merge.yaml"
    text = LITE + "tiles:\n  decode:\n    <<: {block_n: 32, num_warps: 4}\n    block_n: 64\n"
    path.write_text(text)
    assert mlagen_compiler.load_spec(path).tiles.decode.block_n == 64


def test_nested_yaml_aliases_do_not_hang_the_error(tmp_path, capsys):
    """A kilobyte of nested aliases holds 10**9 elements: the error shows the value cut short, at once."""
    import time

    levels = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, 9):
        levels.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    path = tmp_path / "bomb.yaml"
    path.write_text(LITE + "\n".join(levels) + "\n")
    start = time.monotonic()
    code, _, err = run_main(capsys, "show", str(path))
    assert time.monotonic() - start < 10
    line = one_error_line(err)
    assert code == 2 and f"{path}: a8: unknown field (allowed: " in line and len(line) < 20000


def test_a_huge_integer_is_a_yaml_error_naming_the_file(tmp_path, capsys):
    path = spec_file(tmp_path, "x.yaml", name="x")
    path.write_text(path.read_text().replace("num_heads: 16", "num_heads: " + "9" * 5000))
    code, _, err = run_main(capsys, "show", str(path))
    assert code == 2 and one_error_line(err).startswith(f"mlagen: error: {path}: not valid YAML: ")


@pytest.mark.parametrize(
    ("replace", "fragment"),
    [
        (
            {"softmax_scale": "1.0e+300"},
            "softmax_scale: softmax_scale=1e+300 is not allowed: must be in [2**-24, 2**14]",
        ),
        ({"softmax_scale": "1.0e-30"}, "softmax_scale: softmax_scale=1e-30 is not allowed: must be in [2**-24, 2**14]"),
        ({"softmax_scale": "0"}, "softmax_scale: softmax_scale=0.0 is not allowed: must be in [2**-24, 2**14]"),
        (
            {"rope_scaling": "{type: yarn, factor: 40, mscale_all_dim: 1.0e+200}"},
            "rope_scaling.mscale_all_dim: Input should be less than or equal to 10 (got 1e+200)",
        ),
        (
            {"rope_scaling": "{type: yarn, factor: 40, mscale_all_dim: -2.71}"},
            "rope_scaling.mscale_all_dim: Input should be greater than or equal to 0 (got -2.71)",
        ),
        (
            {"rope_scaling": "{type: yarn, factor: 1.0e+300, mscale_all_dim: 1.0}"},
            "rope_scaling.factor: Input should be less than or equal to 65536 (got 1e+300)",
        ),
    ],
)
def test_scales_that_would_overflow_in_the_kernels_are_refused(tmp_path, capsys, replace, fragment):
    """Finite values whose float32 scale inside the kernels would not be (or would vanish): refused, so no
    module with `inf` in it (unimportable) is ever written."""
    fields = {"rope_scaling": "null"} if "softmax_scale" in replace else {}
    path = spec_file(tmp_path, "x.yaml", name="x", **{**fields, **replace})
    code, _, err = run_main(capsys, "compile", str(path), "-o", str(tmp_path / "out"))
    assert code == 2 and one_error_line(err).startswith(f"mlagen: error: {path}: {fragment}")
    assert not (tmp_path / "out").exists()


def test_every_bounded_rope_scaling_gives_a_scale_in_bounds():
    """The field bounds alone keep the derived scale inside [SOFTMAX_SCALE_MIN, SOFTMAX_SCALE_MAX]."""
    from mlagen_compiler.spec import SOFTMAX_SCALE_MAX, SOFTMAX_SCALE_MIN

    fields = {**yaml.safe_load(LITE), "name": "x"}
    for dims in ((16, 16), (256, 128)):
        for factor, mscale_all_dim in ((65536, 10.0), (1e-9, 10.0), (2.0, 0.0)):
            spec = mlagen_compiler.spec_from_dict(
                {
                    **fields,
                    "qk_nope_head_dim": dims[0],
                    "qk_rope_head_dim": dims[1],
                    "rope_scaling": {"factor": factor, "mscale_all_dim": mscale_all_dim},
                }
            )
            assert SOFTMAX_SCALE_MIN <= spec.derived_softmax_scale() <= SOFTMAX_SCALE_MAX


@pytest.mark.parametrize("name", ["torch", "triton", "math", "os", "json", "typing-extensions", "numpy", "yaml"])
def test_a_spec_named_after_a_module_it_would_shadow_is_refused(tmp_path, capsys, name):
    path = spec_file(tmp_path, "x.yaml", name=name)
    code, _, err = run_main(capsys, "compile", str(path), "-o", str(tmp_path))
    module = name.replace("-", "_")
    assert code == 2 and f"{path}: name: name='{name}' is not allowed: its module {module}.py would shadow" in (
        one_error_line(err)
    )
    assert not (tmp_path / f"{module}.py").exists()


def test_cache_clear_removes_only_entries(tmp_path, monkeypatch, capsys):
    """A folder a user put under the cache's modules/ (no manifest.json) is neither an entry nor removed."""
    root = tmp_path / "cache"
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(root))
    mlagen_compiler.load("deepseek-v2-lite")
    mine = root / "modules" / "my-notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (root / "modules" / "a-file").write_text("keep me too")
    code, out, _ = run_main(capsys, "cache", "info")
    assert code == 0 and "1 module(s)" in out and "damaged" not in out
    assert f"not a cache entry (no manifest.json; left alone by `mlagen cache clear`): {mine}" in out
    code, out, _ = run_main(capsys, "cache", "clear")
    assert code == 0 and "removed 1 cached module(s)" in out and "kept 2 path(s)" in out
    assert (mine / "notes.txt").read_text() == "keep me"
    assert (root / "modules" / "a-file").read_text() == "keep me too"
    assert {p.name for p in (root / "modules").iterdir()} == {"a-file", "my-notes"}


@pytest.mark.parametrize("command", ["info", "clear"])
def test_a_cache_directory_that_is_a_file_is_named(tmp_path, monkeypatch, capsys, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(blocker))
    code, _, err = run_main(capsys, "cache", command)
    expected = f"mlagen: error: MLAGEN_CACHE_DIR={blocker} is a file, not a directory: point MLAGEN_CACHE_DIR at a"
    assert code == 2 and one_error_line(err).startswith(expected)
    assert blocker.read_text() == "keep me"


HF_BASE = {
    "model_type": "deepseek_v3", "num_attention_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0},
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            {"num_attention_heads": "sixteen"},
            "config: num_attention_heads='sixteen' is not allowed: must be an integer",
        ),
        ({"num_attention_heads": True}, "config: num_attention_heads=True is not allowed: must be an integer"),
        ({"num_attention_heads": 128.7}, "config: num_attention_heads=128.7 is not allowed: must be an integer"),
        ({"kv_lora_rank": 512.0}, "config: kv_lora_rank=512.0 is not allowed: must be an integer"),
        ({"q_lora_rank": False}, "config: q_lora_rank=False is not allowed: must be an integer"),
        ({"qk_rope_head_dim": "64"}, "config: qk_rope_head_dim='64' is not allowed: must be an integer"),
        (
            {"rope_scaling": {"type": "yarn", "factor": None, "mscale_all_dim": 1.0}},
            "config: rope_scaling.factor=None is not allowed: must be a finite number",
        ),
        (
            {"rope_scaling": {"type": "yarn", "factor": True, "mscale_all_dim": 1.0}},
            "config: rope_scaling.factor=True is not allowed: must be a finite number",
        ),
        (
            {"rope_scaling": {"type": "yarn", "factor": 40, "mscale_all_dim": "1"}},
            "config: rope_scaling.mscale_all_dim='1' is not allowed: must be a finite number",
        ),
        (
            {"rope_scaling": {"type": None, "factor": 40, "mscale_all_dim": 1.0}},
            "config: rope_scaling.rope_type=None is not allowed: must be a string",
        ),
    ],
)
def test_spec_from_hf_refuses_wrong_types(tmp_path, capsys, change, fragment):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HF_BASE, **change}))
    code, out, err = run_main(capsys, "spec-from-hf", str(path))
    assert code == 2 and not out and one_error_line(err) == f"mlagen: error: {fragment}"


def test_spec_from_hf_refuses_a_key_given_twice(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"num_attention_heads": 16, ' + __import__("json").dumps(HF_BASE)[1:])
    code, _, err = run_main(capsys, "spec-from-hf", str(path))
    assert code == 2 and "key 'num_attention_heads' is given twice in one object" in one_error_line(err)


def test_every_mlagen_variable_read_is_in_the_one_table():
    """Each MLAGEN_* name the compiler or a template reads is a knob `mlagen env` lists (and checks)."""
    from mlagen_compiler.knobs import knob_states

    listed = {state.name for state in knob_states({})}
    sources = [*ROOT.glob("mlagen_compiler/**/*.py"), *ROOT.glob("templates/*.jinja")]
    read = {name for path in sources for name in re.findall(r"[\"'](MLAGEN_[A-Z_]+)[\"']", path.read_text())}
    assert read and read <= listed, sorted(read - listed)


def test_the_readme_table_of_variables_is_the_one_table():
    """The README's environment-variable table is knobs.readme_table(), made from options.KNOBS and the rest."""
    from mlagen_compiler.knobs import readme_table

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Environment variables") :]
    table = section[section.index("| variable |") :]
    table = table[: table.index("\n\n") + 1]
    assert table == readme_table()


GARBAGE = {
    "MLAGEN_DECODE_BACKEND": ("cuda", "MLAGEN_DECODE_BACKEND: expected auto, gluon or triton, got 'cuda'"),
    "MLAGEN_DECODE_MERGE": ("yes", "MLAGEN_DECODE_MERGE: expected auto, fused or kernel, got 'yes'"),
    "MLAGEN_DECODE_PDL": ("on", "MLAGEN_DECODE_PDL: expected 0 or 1, got 'on'"),
    "MLAGEN_DECODE_TMA": ("true", "MLAGEN_DECODE_TMA: expected 0 or 1, got 'true'"),
    "MLAGEN_PREFILL_TMA": ("2", "MLAGEN_PREFILL_TMA: expected 0 or 1, got '2'"),
    "MLAGEN_PREFILL_PERSISTENT": ("yes", "MLAGEN_PREFILL_PERSISTENT: expected 0 or 1, got 'yes'"),
    "MLAGEN_PREFILL_TILE_CHUNK": ("16", "MLAGEN_PREFILL_TILE_CHUNK: expected 0, 1, 2, 3, 4, 5, 6, 7 or 8, got '16'"),
    "MLAGEN_DIRECT_LAUNCH": ("off", "MLAGEN_DIRECT_LAUNCH: expected 0 or 1, got 'off'"),
    "MLAGEN_RAW_LAUNCH": ("no", "MLAGEN_RAW_LAUNCH: expected 0 or 1, got 'no'"),
    "MLAGEN_VALIDATE": ("yes", "MLAGEN_VALIDATE: expected 0 or 1, got 'yes'"),
    "MLAGEN_POISON_WORKSPACE": ("nan", "MLAGEN_POISON_WORKSPACE: expected 0 or 1, got 'nan'"),
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_mlagen_env_names_each_invalid_module_knob(monkeypatch, capsys, name):
    """The generated modules would refuse the value at import or call; `mlagen env` says so first."""
    value, problem = GARBAGE[name]
    monkeypatch.setenv(name, value)
    code, out, _ = run_main(capsys, "env")
    lines = [line for line in out.splitlines() if line.strip().startswith(name + " ")]
    assert code == 0 and len(lines) == 1 and f"INVALID: {problem}" in lines[0] and value in lines[0]
    knob_lines = [line for line in out.splitlines() if line.startswith("  MLAGEN_")]
    assert sum("INVALID" in line for line in knob_lines) == 1  # the others are ok


def test_mlagen_env_checks_the_path_knobs_and_names_unknown_variables(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me")
    bad_db = tmp_path / "db.json"
    bad_db.write_text("{not json")
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(a_file))
    monkeypatch.setenv("MLAGEN_SPEC_PATH", str(a_file))
    monkeypatch.setenv("MLAGEN_TUNING_DB", str(bad_db))
    monkeypatch.setenv("MLAGEN_VALIDTE", "1")
    code, out, _ = run_main(capsys, "env")
    invalid = {line.split()[0]: line for line in out.splitlines() if "INVALID" in line and line.startswith("  ")}
    assert code == 0 and set(invalid) == {"MLAGEN_CACHE_DIR", "MLAGEN_SPEC_PATH", "MLAGEN_TUNING_DB", "MLAGEN_VALIDTE"}
    assert f"MLAGEN_CACHE_DIR: {a_file} is a file, not a directory" in invalid["MLAGEN_CACHE_DIR"]
    assert f"MLAGEN_SPEC_PATH: not a directory: {a_file}" in invalid["MLAGEN_SPEC_PATH"]
    assert f"MLAGEN_TUNING_DB: {bad_db}" in invalid["MLAGEN_TUNING_DB"]
    assert "not a variable mlagen reads; did you mean MLAGEN_VALIDATE?" in invalid["MLAGEN_VALIDTE"]
    assert a_file.read_text() == "keep me"


def test_a_blank_module_knob_is_its_default():
    from mlagen_compiler.launch_policy import ENV_KNOBS, env_knob

    for name, (_, default, _) in ENV_KNOBS.items():
        assert env_knob(name, None) == env_knob(name, "") == env_knob(name, "  ") == default
        with pytest.raises(ValueError, match=f"^{name}: expected "):
            env_knob(name, "garbage")


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_compile_never_replaces_a_file_it_did_not_generate(tmp_path, capsys, kind):
    mine = tmp_path / "deepseek_v2_lite.py"
    if kind == "file":
        mine.write_text("# my own helpers\n")
    else:
        mine.mkdir()
    code, _, err = run_main(capsys, "compile", "deepseek-v2-lite", "-o", str(tmp_path))
    assert code == 2 and one_error_line(err).startswith(
        f"mlagen: error: {mine}: exists and is not a module mlagen generated"
    )
    assert kind == "directory" or mine.read_text() == "# my own helpers\n"
    mine.unlink() if kind == "file" else mine.rmdir()
    assert run_main(capsys, "compile", "deepseek-v2-lite", "-o", str(tmp_path))[0] == 0
    assert run_main(capsys, "compile", "deepseek-v2-lite", "-o", str(tmp_path))[0] == 0  # its own: replaced


@pytest.mark.parametrize(
    ("tuned", "message"),
    [
        ({"decode": {"sm90|H100|m16": "xx"}}, "tuned['decode']['sm90|H100|m16']: config: expected (block_n: a power"),
        ({"decode": 5}, "tuned['decode']: expected a mapping of '<arch>|<gpu>|<bucket>' keys, got 5"),
        ({"decode": {"sm90|m16": [32, 4, 2]}}, "tuned['decode']: key 'sm90|m16' is not '<arch>|<gpu>|<bucket>'"),
        ({"decode": {"sm90|H|m16": [1e300, 4, 2]}}, "tuned['decode']['sm90|H|m16']: config: expected (block_n"),
        ({"decode": {"sm90|H|m16": [32, True, 2]}}, "tuned['decode']['sm90|H|m16']: config: expected (block_n"),
        ({"decode": {"sm90|H|gluon": [64, 0, 2]}}, "tuned['decode']['sm90|H|gluon']: config: expected (block_n, regis"),
        (
            {"prefill": {"sm90|H|causal": [16, 16, 3, 1]}},
            "tuned['prefill']['sm90|H|causal']: config: expected (block_m",
        ),
        ({"attention": {"sm90|H|causal": [16, 16, 4, 1]}}, "tuned['attention']['sm90|H|causal']: kernel: expected"),
    ],
)
def test_load_checks_tuned_configurations(tmp_path, monkeypatch, tuned, message):
    """A tuned configuration rendered into a module must be one a launch takes: else an error at load naming
    where it is, not a module that fails at its first call on the GPU."""
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        mlagen_compiler.load("deepseek-v2-lite", tuned=tuned)


def test_a_tuning_database_entry_is_checked_where_it_is_read_and_where_it_is_rendered(tmp_path, monkeypatch):
    """An entry's config must be a list of ints (not bools) where the file is read; whether a launch takes it
    is checked where it is rendered into a module (load names the tuned key)."""
    import json

    from mlagen_compiler.tuning_db import TuningDBError, read_db, shipped_db_paths

    good = read_db(shipped_db_paths()[0])[0]
    path = tmp_path / "db.json"
    path.write_text(json.dumps({"schema": 2, "entries": [{**good, "config": [64, True, 2]}]}))
    with pytest.raises(TuningDBError, match=re.escape(f"{path}: entries[0]: config must be a list of integers")):
        read_db(path)
    path.write_text('{"schema": 2, "schema": 2, "entries": []}')
    with pytest.raises(TuningDBError, match="key 'schema' is given twice in one object"):
        read_db(path)


@pytest.mark.parametrize(
    "replace",
    [
        {"rope_scaling": "{type: yarn, factor: 65536, mscale_all_dim: 10}"},
        {"rope_scaling": "null", "softmax_scale": "16384"},
        {"rope_scaling": "null", "softmax_scale": "5.9604644775390625e-08"},
    ],
)
def test_a_spec_at_its_bounds_compiles_to_an_importable_module(tmp_path, capsys, replace):
    """What spec.py promises: every spec it accepts compiles into a module that imports, its scale finite."""
    import math

    from mlagen_compiler.module_file import import_module_from_path

    path = spec_file(tmp_path, "edge.yaml", name="edge", **replace)
    code, _, err = run_main(capsys, "compile", str(path), "-o", str(tmp_path / "out"))
    assert code == 0, err
    module = import_module_from_path(tmp_path / "out" / "edge.py")
    assert math.isfinite(module.SOFTMAX_SCALE) and 0 < module.SOFTMAX_SCALE <= 2**14
