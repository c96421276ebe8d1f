"""The generated modules' switches: one frozen `Options` object, read from the `MLAGEN_*` variables in one place.

Every switch is a field of `Options`, its metadata a `Knob` (the variable, its allowed values, the value when
unset or blank, what it does); `KNOBS` lists them and is what `mlagen env` and the README's table show.
`Options.from_env` is the only reader of these variables: a value outside the allowed ones is a one-line
ValueError naming the variable (`env_knob`).

The options in force are `options()`: the environment as it is when first asked (mlagen_compiler.runtime asks
when it is imported, so a wrong value fails that import), unless replaced: `set_options(...)` for the rest of
the process, `use_options(...)` for a `with` block (tests and probes choose variants this way, e.g.
`with use_options(decode_tma=False):`), `reload_options()` to read the environment again. What a launch reads
is the options in force when it is planned or prepared: a schedule, a prepared launch keep theirs.

Standard library only (like launch_policy, which re-exports ENV_KNOBS and env_knob from here).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace

__all__ = [
    "KNOBS",
    "ENV_KNOBS",
    "Knob",
    "Options",
    "env_knob",
    "options",
    "reload_options",
    "set_options",
    "use_options",
]


@dataclass(frozen=True)
class Knob:
    """An option's environment variable: its name, allowed values, the value when unset or blank, meaning."""

    variable: str
    allowed: tuple[str, ...]
    default: str
    meaning: str
    integer: bool = False  # its option is an int (the allowed values are its texts)

    @property
    def switch(self) -> bool:
        """An on/off variable ("0" / "1", not an integer one): its option is a bool."""
        return self.allowed == ("0", "1") and not self.integer

    def value(self, text: str):
        """The option's value for the variable's text `text` (one of allowed)."""
        return text == "1" if self.switch else int(text) if self.integer else text

    def text(self, value) -> str:
        """The variable's text that asks for the option's value `value`."""
        return ("1" if value else "0") if self.switch else str(value)


def _choices(allowed):
    return ", ".join(allowed[:-1]) + " or " + allowed[-1]


def _option(variable, allowed, default, meaning, integer=False):
    knob = Knob(variable, tuple(allowed), default, meaning, integer)
    return field(default=knob.value(default), metadata={"knob": knob})


@dataclass(frozen=True)
class Options:
    """The switches of the generated modules (each field's `Knob` names its variable)."""

    decode_backend: str = _option(
        "MLAGEN_DECODE_BACKEND", ("auto", "gluon", "triton"), "auto", "decode backend (auto: Gluon where it runs)"
    )
    decode_merge: str = _option(
        "MLAGEN_DECODE_MERGE", ("auto", "fused", "kernel"), "auto", "how decode merges split sequences"
    )
    decode_pdl: bool = _option(
        "MLAGEN_DECODE_PDL", ("0", "1"), "1", "combine launch as a programmatic dependent launch"
    )
    decode_partials: str = _option(
        "MLAGEN_DECODE_PARTIALS",
        ("auto", "float32", "dtype"),
        "auto",
        "dtype of split sequences' partial rows (dtype: the output's; auto: the launch policy's)",
    )
    decode_tma: bool = _option("MLAGEN_DECODE_TMA", ("0", "1"), "1", "decode cache tiles through TMA")
    prefill_backend: str = _option(
        "MLAGEN_PREFILL_BACKEND",
        ("auto", "gluon", "triton"),
        "auto",
        "prefill backend (auto: the Gluon kernel on Hopper where the plan takes the geometry, else the portable one)",
    )
    prefill_tma: bool = _option("MLAGEN_PREFILL_TMA", ("0", "1"), "1", "prefill key/value tiles through TMA")
    prefill_persistent: bool = _option(
        "MLAGEN_PREFILL_PERSISTENT",
        ("0", "1"),
        "0",
        "Gluon prefill: the persistent kernel (a program per SM looping over the tiles)",
    )
    prefill_tile_chunk: int = _option(
        "MLAGEN_PREFILL_TILE_CHUNK",
        tuple(str(chunk) for chunk in range(9)),
        "0",
        "Gluon prefill: N > 0, the persistent kernel with N consecutive tiles a program (a grid of tiles / N)",
        integer=True,
    )
    direct_launch: bool = _option(
        "MLAGEN_DIRECT_LAUNCH", ("0", "1"), "1", "launch compiled kernels without Triton's dispatch"
    )
    raw_launch: bool = _option("MLAGEN_RAW_LAUNCH", ("0", "1"), "1", "launch through the compiled C launcher")
    validate: bool = _option(
        "MLAGEN_VALIDATE", ("0", "1"), "0", "check index values on the GPU too (a synchronisation)"
    )
    poison_workspace: bool = _option("MLAGEN_POISON_WORKSPACE", ("0", "1"), "0", "fill workspaces with NaN (tests)")

    def __post_init__(self):
        for name, knob in _FIELD_KNOBS.items():
            value = getattr(self, name)
            if knob.switch:
                if value is not True and value is not False:
                    raise ValueError(f"{name}: expected True or False, got {value!r}")
            elif knob.integer:
                if type(value) is not int or str(value) not in knob.allowed:
                    raise ValueError(f"{name}: expected an int in {_choices(knob.allowed)}, got {value!r}")
            elif value not in knob.allowed:
                raise ValueError(f"{name}: expected {_choices(knob.allowed)}, got {value!r}")
        # a schedule cache keys on the options in force: hashed once
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, name) for name in _FIELD_KNOBS)))

    def __hash__(self):
        return self._hash

    def __reduce__(self):
        # rebuilt from its fields (the cached hash of strings is not valid in another process)
        return type(self), tuple(getattr(self, name) for name in _FIELD_KNOBS)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Options:
        """The options the variables in `environ` (default: os.environ) ask for; unset or blank: the default."""
        environ = os.environ if environ is None else environ
        values = {}
        for name, knob in _FIELD_KNOBS.items():
            text = env_knob(knob.variable, environ.get(knob.variable))
            values[name] = knob.value(text)
        return cls(**values)

    def environ(self) -> dict[str, str]:
        """The variables that ask for these options (e.g. for a child process)."""
        return {knob.variable: knob.text(getattr(self, name)) for name, knob in _FIELD_KNOBS.items()}


#: field name -> its Knob, in field order
_FIELD_KNOBS: dict[str, Knob] = {f.name: f.metadata["knob"] for f in fields(Options)}
#: variable -> (field name, Knob): every switch, in the order `mlagen env` and the README list them
KNOBS: dict[str, tuple[str, Knob]] = {knob.variable: (name, knob) for name, knob in _FIELD_KNOBS.items()}
#: variable -> (allowed values, the value when unset or blank, what it does)
ENV_KNOBS = {variable: (knob.allowed, knob.default, knob.meaning) for variable, (_, knob) in KNOBS.items()}


def env_knob(name: str, value: str | None) -> str:
    """The value of variable `name` (of KNOBS) given its text (None or blank: unset, then its default);
    anything else than its allowed values is a ValueError naming the variable and the value."""
    knob = KNOBS[name][1]
    value = knob.default if value is None or not value.strip() else value.strip()
    if value not in knob.allowed:
        raise ValueError(f"{name}: expected {_choices(knob.allowed)}, got {value!r}")
    return value


_active: Options | None = None


def options() -> Options:
    """The options in force (the environment's, read on the first call, unless set or swapped since)."""
    return _active if _active is not None else reload_options()


def set_options(new: Options) -> Options:
    """Put `new` in force for the rest of the process (or until set again); returns the options it replaced."""
    global _active
    if not isinstance(new, Options):
        raise TypeError(f"set_options: expected an Options, got {type(new).__name__}")
    previous, _active = options(), new
    return previous


def reload_options(environ: Mapping[str, str] | None = None) -> Options:
    """Read the variables again (from `environ`, default os.environ) and put what they ask for in force."""
    global _active
    _active = Options.from_env(environ)
    return _active


@contextlib.contextmanager
def use_options(new: Options | None = None, /, **changes) -> Iterator[Options]:
    """In force inside the block: `new` (default: the options in force) with `changes` (field=value)."""
    chosen = replace(new if new is not None else options(), **changes)
    previous = set_options(chosen)
    try:
        yield chosen
    finally:
        set_options(previous)
