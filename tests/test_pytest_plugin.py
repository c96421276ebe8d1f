"""The pytest plugin (mlagen_compiler.pytest_plugin), run as a user runs it: pytest in a fresh process.

`--mlagen-spec` on a spec of the user's own collects a property test per kernel and passes; `--mlagen-module`
on a generated module with one constant changed fails, reporting Hypothesis's shrunk case and a one-line
reproducer that fails again on its own. The shapes are the smallest geometry the kernels take, so each
run costs seconds in Triton's interpreter.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from mlagen_compiler import compile_spec, load_spec

pytest_plugins = ["pytester"]

USER_SPEC = """\
name: my-mla
num_heads: 2
kv_lora_rank: 64
qk_rope_head_dim: 16
qk_nope_head_dim: 32
v_head_dim: 32
page_size: 4
dtype: bfloat16
kernels: [decode, prefill]
"""
#: every kernel reports natural-log LSEs through this constant: a wrong value fails every non-empty case
CONSTANT = "_LN2 = tl.constexpr(0.6931471805599453)"
#: the property tests a module with decode and prefill gets (decode: the portable backend in the interpreter)
PROPERTY_TESTS = ["test_decode", "test_prefill", "test_chunked_prefill", "test_merge_attn_states", "test_cache_write"]


@pytest.fixture
def user_dir(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(pytester.path / "mlagen-cache"))
    pytester.makefile(".yaml", **{"my-spec": USER_SPEC})
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", *args, timeout=600)


def test_plugin_does_nothing_unless_asked(user_dir: pytest.Pytester) -> None:
    user_dir.makepyfile(test_own="def test_own():\n    pass\n")
    result = user_dir.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "mlagen: property tests" not in result.stdout.str()


def test_users_own_spec_collects_every_kernel_and_passes(user_dir: pytest.Pytester) -> None:
    result = run(user_dir, "--mlagen-spec", "my-spec.yaml", "--mlagen-examples", "4")
    result.assert_outcomes(passed=len(PROPERTY_TESTS))
    result.stdout.fnmatch_lines(["*mlagen: property tests of my-mla*4 Hypothesis examples per test*"])
    for name in PROPERTY_TESTS:
        result.stdout.fnmatch_lines([f"*{name}[[]my-mla*PASSED*"])


def test_bad_arguments_are_one_line_errors(user_dir: pytest.Pytester) -> None:
    result = run(user_dir, "--mlagen-spec", "no-such-spec")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--mlagen-spec: 'no-such-spec': spec 'no-such-spec': no such file or registered*"])
    result = run(user_dir, "--mlagen-spec", "my-spec.yaml", "--mlagen-examples", "0")
    result.stderr.fnmatch_lines(["*--mlagen-examples: 0; expected a whole number >= 1*"])


def test_module_with_one_constant_changed_fails_with_the_shrunk_case(user_dir: pytest.Pytester) -> None:
    """The generated module passes; a copy with _LN2 changed fails decode, shrunk to one sequence of one token,
    and the reported reproducer fails on its own."""
    original = compile_spec(load_spec(user_dir.path / "my-spec.yaml"), user_dir.path / "generated")
    source = original.read_text()
    assert source.count(CONSTANT) == 1
    edited = user_dir.path / "edited_mla.py"
    edited.write_text(source.replace(CONSTANT, "_LN2 = tl.constexpr(0.75)"))

    result = run(user_dir, "--mlagen-module", str(original), "--mlagen-module", str(edited), "-k", "decode")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*test_decode[[]my_mla-triton[]] PASSED*", "*test_decode[[]edited_mla-triton[]] FAILED*"]
    )
    output = result.stdout.str()
    # the shrunk case: one sequence holding one token, one new token
    shapes = re.search(r"decode my-mla: .* \| batch=(\d+) Sq=(\d+) lengths=\[(\d+)\]", output)
    assert shapes is not None, output
    assert shapes.groups() == ("1", "1", "1"), shapes.group(0)
    reproducer = re.search(r"reproduce: (.*)", output)
    assert reproducer is not None, output
    words = shlex.split(reproducer.group(1))
    assert words[-3:-1] == ["python", "-c"], words
    assert "DecodeProblem(seqlens=(1,), seqlen_q=1" in words[-1]
    replay = subprocess.run([sys.executable, "-c", words[-1]], capture_output=True, text=True, timeout=300)
    assert replay.returncode == 1 and "AssertionError" in replay.stderr, replay.stderr[-2000:]
