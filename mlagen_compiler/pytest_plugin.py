"""pytest plugin (the `pytest11` entry point `mlagen`): property tests of generated modules, when asked.

    pytest --mlagen-spec my-spec.yaml            # a YAML path or a registered name; repeatable
    pytest --mlagen-module vendored/mla.py       # a generated (or vendored) module file; repeatable
    pytest --mlagen-spec my-spec.yaml --mlagen-examples 50

Without these options the plugin does nothing. With them it collects `mlagen_compiler/pytest_properties.py`
for each module: one Hypothesis property per kernel the module holds (see that file), each against
`mlagen_compiler.reference`. Given no test paths, pytest runs only these; given paths, these besides.
The budget is a Hypothesis profile of `mlagen_compiler.testing` (MLAGEN_HYPOTHESIS_PROFILE: dev, the
default, ci or fuzz; or pytest's --hypothesis-profile), and --mlagen-examples N sets the examples per test.
Without a GPU the kernels run in Triton's interpreter on small shapes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType

import pytest

#: the collected test file
PROPERTIES_FILE = Path(__file__).with_name("pytest_properties.py")
#: the profile the plugin runs: the chosen one without Hypothesis's explain phase (which reruns a failing
#: case dozens of times under coverage tracing: minutes at the interpreter's speed), and with
#: --mlagen-examples its max_examples replaced
PLUGIN_PROFILE = "mlagen-plugin"


@dataclasses.dataclass(frozen=True)
class Target:
    """A module under test: `arg` loads it again (load_target: a spec or a module path), `name` is its test id."""

    arg: str
    name: str
    module: ModuleType


TARGETS = pytest.StashKey[list[Target]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mlagen", "mlagen: property tests of generated MLA modules")
    group.addoption(
        "--mlagen-spec",
        action="append",
        default=[],
        metavar="SPEC",
        help="property-test the module of SPEC (a YAML path or a registered spec name); repeatable",
    )
    group.addoption(
        "--mlagen-module",
        action="append",
        default=[],
        metavar="PATH",
        help="property-test a generated (or vendored) module file; repeatable",
    )
    group.addoption(
        "--mlagen-examples",
        type=int,
        default=None,
        metavar="N",
        help="Hypothesis examples per mlagen property test (default: the profile's, MLAGEN_HYPOTHESIS_PROFILE)",
    )


def _targets(config: pytest.Config) -> list[Target]:
    from .spec import SpecError
    from .testing import load_target

    targets = []
    for option in ("--mlagen-spec", "--mlagen-module"):
        for arg in config.getoption(option.lstrip("-").replace("-", "_")):
            path = Path(arg)
            is_file = option == "--mlagen-module" or path.suffix in (".yaml", ".yml") or path.is_file()
            if option == "--mlagen-module" and path.suffix != ".py":
                raise pytest.UsageError(f"--mlagen-module: '{arg}' is not a .py file; expected a generated module file")
            if option == "--mlagen-spec" and path.suffix == ".py":
                raise pytest.UsageError(f"--mlagen-spec: '{arg}' is a module file; pass it as --mlagen-module")
            load_arg = str(path.resolve()) if is_file else arg
            try:
                module = load_target(load_arg)
            except (SpecError, FileNotFoundError, ImportError, SyntaxError) as error:
                raise pytest.UsageError(f"{option}: '{arg}': {error}") from error
            name = module.SPEC["name"] if option == "--mlagen-spec" else path.stem
            targets.append(Target(load_arg, name, module))
    return targets


@pytest.hookimpl(trylast=True)  # after Hypothesis's plugin loads a --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    if not (config.getoption("mlagen_spec") or config.getoption("mlagen_module")):
        if config.getoption("mlagen_examples") is not None:
            raise pytest.UsageError("--mlagen-examples: give the modules to test with --mlagen-spec or --mlagen-module")
        return
    try:
        from hypothesis import Phase, settings

        from .testing import load_hypothesis_profile, prepare_environment
    except ImportError as error:
        needs = f"--mlagen-spec / --mlagen-module need {error.name}: pip install 'mlagen[test]'"
        raise pytest.UsageError(needs) from error

    examples = config.getoption("mlagen_examples")
    if examples is not None and examples < 1:
        raise pytest.UsageError(f"--mlagen-examples: {examples}; expected a whole number >= 1")
    device = prepare_environment()  # before any generated module is imported
    if device.type != "cuda":  # Triton's interpreter on numpy 2.x (harmless)
        config.addinivalue_line(
            "filterwarnings", "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
        )
    if not config.getoption("hypothesis_profile", None):
        try:
            load_hypothesis_profile()
        except ValueError as error:
            raise pytest.UsageError(str(error)) from error
    phases = tuple(phase for phase in settings.default.phases if phase is not Phase.explain)
    budget = {} if examples is None else {"max_examples": examples}
    settings.register_profile(PLUGIN_PROFILE, parent=settings.default, phases=phases, **budget)
    settings.load_profile(PLUGIN_PROFILE)
    config.stash[TARGETS] = _targets(config)
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.append(str(PROPERTIES_FILE))
    else:  # no test paths given: only the property tests
        config.args = [str(PROPERTIES_FILE)]


def targets(config: pytest.Config) -> list[Target]:
    """The modules this session tests (empty when the plugin is not asked)."""
    return config.stash.get(TARGETS, [])


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not targets(config):
        return []
    import torch
    from hypothesis import settings

    where = f"on {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "in Triton's CPU interpreter"
    names = ", ".join(f"{t.name} ({t.arg})" for t in targets(config))
    return [
        f"mlagen: property tests of {names}; kernels run {where}; "
        f"{settings.default.max_examples} Hypothesis examples per test"
    ]
