"""Every `MLAGEN_*` environment variable in one table: its value, what it takes and whether it is valid.

Two kinds: the generated modules' switches (the fields of `options.Options`, each naming its variable in
`options.KNOBS`, read by `Options.from_env` alone and checked there by `env_knob`) and the compiler's paths
(cache directory, spec directories, user tuning database), checked here with the same rules their readers
apply; then the integrations' and the tests' variables. `mlagen env` prints `knob_states()`; a variable named
`MLAGEN_*` that nothing reads (a typo) is listed as such. `readme_table()` is the README's table of them all
(tests/test_bad_input.py checks that the README shows it).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .options import KNOBS, env_knob
from .paths import CACHE_DIR_ENV
from .registry import SPEC_PATH_ENV
from .tuning_db import TUNING_DB_ENV, read_db

__all__ = ["KnobState", "knob_states", "readme_table"]

#: read by the test suite (tests/conftest.py, tests/test_bad_values_isolated.py) and the benchmark jobs only
TEST_KNOBS = {
    "MLAGEN_HYPOTHESIS_PROFILE": "hypothesis profile of the tests (dev, ci)",
    "MLAGEN_ISOLATE": "tests: 'spawn' runs each isolated case in a fresh interpreter",
    "MLAGEN_TEST_VLLM": "scripts/test.sh: 0 leaves out the vLLM integration's run in .venv-vllm",
    "MLAGEN_BENCH_COMMIT": "benchmarks/harness.py: the commit a copy of the tree without .git records results as",
}

#: read by the integrations: name -> (allowed values, meaning); unset is the first value's behaviour
INTEGRATION_KNOBS = {
    # (the name is mlagen_compiler.integrations.vllm.UNTESTED_ENV; that module imports vLLM, so it is not imported here)
    "MLAGEN_VLLM_ALLOW_UNTESTED": (("0", "1"), "vLLM backend: 1 lets a vLLM release other than the tested ones run"),
}


@dataclass(frozen=True)
class KnobState:
    name: str
    #: the variable's text, None when unset
    value: str | None
    #: what mlagen uses (the default when unset)
    effective: str
    #: '' when valid, else what is wrong (one line naming the variable)
    problem: str
    meaning: str


def _not_a_file_above(path: Path) -> str:
    """'' when `path` can be a directory's or a file's place: no ancestor of it is a file."""
    for parent in path.parents:
        if parent.exists():
            return "" if parent.is_dir() else f"{parent} is a file, not a directory"
    return ""


def _cache_dir_problem(value: str) -> str:
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a directory"
    return _not_a_file_above(path)


def _spec_path_problem(value: str) -> str:
    bad = [entry for entry in value.split(os.pathsep) if entry and not Path(entry).expanduser().is_dir()]
    if not bad:
        return ""
    return f"not a directory: {', '.join(bad)} (entries are directories of spec YAML files, {os.pathsep}-separated)"


def _tuning_db_problem(value: str) -> str:
    path = Path(value).expanduser()
    if path.is_dir():
        return f"{path} is a directory: name the tuning database's JSON file"
    problem = _not_a_file_above(path)
    if problem or not path.exists():
        return problem
    try:
        read_db(path)
    except (OSError, ValueError) as error:
        return " ".join(str(error).splitlines())
    return ""


#: the compiler's path variables: name -> (check of a set value, default shown when unset, meaning)
_PATH_KNOBS: dict[str, tuple[Callable[[str], str], str, str]] = {
    CACHE_DIR_ENV: (_cache_dir_problem, "the platform's user cache directory", "compile cache and user tuning db"),
    SPEC_PATH_ENV: (_spec_path_problem, "(none)", "directories of user specs"),
    TUNING_DB_ENV: (_tuning_db_problem, "<cache dir>/tuning.json", "the user tuning database (mlagen tune)"),
}


def knob_states(environ: Mapping[str, str] | None = None) -> list[KnobState]:
    """The state of every known MLAGEN_* variable, then of every unknown one that is set."""
    environ = os.environ if environ is None else environ
    states = []
    for name, (_, knob) in KNOBS.items():
        value = environ.get(name)
        try:
            effective, problem = env_knob(name, value), ""
        except ValueError as error:
            effective, problem = knob.default, str(error)
        states.append(KnobState(name, value, effective, problem, f"{knob.meaning} ({', '.join(knob.allowed)})"))
    for name, (check, default, meaning) in _PATH_KNOBS.items():
        value = environ.get(name)
        problem = check(value) if value else ""
        states.append(KnobState(name, value, value or default, f"{name}: {problem}" if problem else "", meaning))
    for name, (allowed, meaning) in INTEGRATION_KNOBS.items():
        value = environ.get(name)
        problem = "" if value in (None, "", *allowed) else f"{name}: expected {' or '.join(allowed)}, got {value!r}"
        states.append(KnobState(name, value, value or allowed[0], problem, f"{meaning} ({', '.join(allowed)})"))
    for name, meaning in TEST_KNOBS.items():
        value = environ.get(name)
        states.append(KnobState(name, value, value or "(default)", "", meaning))
    known = [*KNOBS, *_PATH_KNOBS, *INTEGRATION_KNOBS, *TEST_KNOBS]
    for name in sorted(n for n in environ if n.startswith("MLAGEN_") and n not in known):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
        hint = f"; did you mean {close[0]}?" if close else ""
        states.append(KnobState(name, environ[name], "(ignored)", f"{name}: not a variable mlagen reads{hint}", ""))
    return states


def readme_table() -> str:
    """The README's table of every variable (Markdown): the switches (options.KNOBS), the paths, the
    integrations' and the tests' variables, in the order `mlagen env` lists them."""

    def values(allowed):
        return " / ".join(f"`{value}`" for value in allowed)

    rows = ["| variable | values | default | what it does |", "| --- | --- | --- | --- |"]
    for name, (_, knob) in KNOBS.items():
        rows.append(f"| `{name}` | {values(knob.allowed)} | `{knob.default}` | {knob.meaning} |")
    for name, (_, default, meaning) in _PATH_KNOBS.items():
        rows.append(f"| `{name}` | a path | {default} | {meaning} |")
    for name, (allowed, meaning) in INTEGRATION_KNOBS.items():
        rows.append(f"| `{name}` | {values(allowed)} | `{allowed[0]}` | {meaning} |")
    for name, meaning in TEST_KNOBS.items():
        rows.append(f"| `{name}` | | | {meaning} |")
    return "\n".join(rows) + "\n"
