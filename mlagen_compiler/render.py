"""Stage 3 of the pipeline: render a KernelPlan into the source of a standalone Python module.

One cached Jinja environment with StrictUndefined; the templates receive numbers and literals computed
here or in the plan, never re-derive them. Output is deterministic: same plan + templates + version gives
the same bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pprint
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from . import launch_policy
from ._version import __version__
from .paths import template_dir
from .plan import KernelPlan, emitted_kinds
from .spec import SOFTMAX_SCALE_CALL_MAX, brief_repr
from .triton_support import TRITON_BELOW, TRITON_MIN, unsupported_message

__all__ = ["render_module", "templates_digest"]


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def generator_sources() -> list[Path]:
    """The files that decide a generated module's content besides the spec and tuning: every template, and the pipeline
    stages that fill them (spec validation, the plan's constants, rendering, the launch policy that checks tuned
    configurations); and the runtime the module imports (runtime.py, launch_policy.py, options.py, cache_format.py),
    whose names, private ones included, are its interface. A change to any of them makes a new cache entry even
    within one mlagen version (an editable install), so that a cached module never meets a runtime it was not built
    for."""
    package = Path(__file__).resolve().parent
    stages = [
        package / name for name in ("spec.py", "plan.py", "render.py", "runtime.py", "options.py", "cache_format.py")
    ]
    return [*sorted(template_dir().glob("*.jinja")), *stages, Path(launch_policy.__file__)]


def templates_digest() -> str:
    """Hash of the generator_sources' bytes: part of what decides a generated module's content."""
    digest = hashlib.sha256()
    for path in generator_sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _literal(value: Any) -> str:
    """A deterministic Python literal (sorted dict keys), wrapped to the generated file's width."""
    return pprint.pformat(value, width=100, sort_dicts=True)


def _table_literal(value: Any) -> str:
    """A launch table as _literal writes it, but filled: a list's items, and a dict's entries where each fits on a
    line, run on up to 88 columns (with the longest table name in front, within 120) instead of one a line (a tile
    space would take 40 lines)."""
    text = pprint.pformat(value, width=88, compact=True, sort_dicts=True)
    if not isinstance(value, dict) or "\n" not in text:
        return text
    entries = [f"{key!r}: {pprint.pformat(value[key], width=88, compact=True)}," for key in sorted(value)]
    if any("\n" in entry for entry in entries):
        return text
    lines = ["{" + entries[0]]
    for entry in entries[1:]:
        if len(lines[-1]) + 1 + len(entry) > 88:
            lines.append(" " + entry)
        else:
            lines[-1] += " " + entry
    return "\n".join(lines)[:-1] + "}"


def tuning_source(tuned: dict[str, Any] | None) -> str:
    """One line for the generated header: how many tuned configurations it carries and which GPUs measured them."""
    tables = {kernel: table for kernel, table in (tuned or {}).items() if table}
    if not tables:
        return "none (the plan's untuned defaults)"
    gpus = sorted({key.split("|")[1] for table in tables.values() for key in table} - {"*"})
    counts = ", ".join(f"{kernel} {len(table)}" for kernel, table in sorted(tables.items()))
    return f"{counts} (tuning database entries measured on {', '.join(gpus) or 'an unnamed GPU'})"


def _checked_tuned(tuned: Any) -> dict[str, Any]:
    """Tuned configurations as render takes them ({kernel: {"<arch>|<gpu>|<bucket>": config}}), each checked as
    a launch would take it: a bad one is a ValueError naming where it is, never a module that fails at a call."""
    if tuned is None:
        return {}
    if not isinstance(tuned, Mapping):
        raise ValueError(f"tuned: expected {{kernel: {{'<arch>|<gpu>|<bucket>': config}}}}, got {brief_repr(tuned)}")
    for kernel, table in tuned.items():
        if not isinstance(table, Mapping):
            raise ValueError(
                f"tuned[{kernel!r}]: expected a mapping of '<arch>|<gpu>|<bucket>' keys, got {brief_repr(table)}"
            )
        for key, config in table.items():
            parts = key.split("|") if isinstance(key, str) else []
            if len(parts) != 3 or not all(parts):
                raise ValueError(f"tuned[{kernel!r}]: key {brief_repr(key)} is not '<arch>|<gpu>|<bucket>'")
            try:
                launch_policy.check_tuned_config(kernel, parts[2], config)
            except ValueError as error:
                raise ValueError(f"tuned[{kernel!r}][{key!r}]: {error}") from None
    return dict(tuned)


def render_context(plan: KernelPlan, tuned: dict[str, Any] | None = None) -> dict[str, Any]:
    tuned = _checked_tuned(tuned)
    spec = plan.spec
    context: dict[str, Any] = {
        "version": __version__,
        "spec_name": spec.name,
        "spec_hash": plan.spec_hash,
        "templates_hash": templates_digest(),
        "tuning_source": tuning_source(tuned),
        "spec_literal": _literal(spec.to_flat_dict()),
        "num_heads": plan.num_heads,
        "dc": spec.kv_lora_rank,
        "dr": spec.qk_rope_head_dim,
        "dn": spec.qk_nope_head_dim,
        "dv": spec.v_head_dim,
        "page_size": plan.page_size,
        "dtype": plan.dtype,
        "cache_dtype": plan.cache_dtype,
        "cache_format": plan.cache_format,
        "softmax_scale": repr(plan.softmax_scale),
        "softmax_scale_max": repr(SOFTMAX_SCALE_CALL_MAX),
        "triton_min": repr(TRITON_MIN),
        "triton_below": repr(TRITON_BELOW),
        "triton_warning": repr(unsupported_message("{installed}")),
        "kinds": [kind for kind in emitted_kinds(plan.spec)],
    }
    for kind in context["kinds"]:
        kind_plan = plan.kernels[kind.name]
        context[kind.name] = kind_plan
        tables = kind_plan.template_tables((tuned or {}).get(kind.name, {}))
        context.update({name: _table_literal(value) for name, value in tables.items()})
    context["op_kinds"] = [kind.name for kind in context["kinds"]]
    context["ops_namespace"] = ops_namespace(spec.name, context)
    return context


def ops_namespace(spec_name: str, context: dict[str, Any]) -> str:
    """The torch.library namespace of a module's custom ops: `mlagen_<spec name>_<hash>`, a valid identifier.

    The hash covers every rendered string of the context (spec hash, templates digest, mlagen version,
    tuned-configuration tables, ...), so two modules share a namespace only if their sources are the same:
    torch.library.custom_op silently replaces an op registered under the same name, which would make one
    module's ops run another's kernels.
    """
    strings = {key: value for key, value in context.items() if isinstance(value, str)}
    digest = hashlib.sha256(json.dumps(strings, sort_keys=True).encode()).hexdigest()[:12]
    stem = re.sub(r"[^a-z0-9]+", "_", spec_name.lower()).strip("_")[:32]
    return f"mlagen_{stem}_{digest}"


def render_module(plan: KernelPlan, tuned: dict[str, Any] | None = None) -> str:
    """Source of the generated module for `plan`.

    tuned: optional {"decode": {"<arch>|<gpu name>|<bucket>": [block_n, num_warps, num_stages]}} rendered in
    as the module's recorded configurations (and "prefill": {"<arch>|<gpu name>|<causal or prefix>":
    [block_m, block_n, num_warps, num_stages]}); see `tuning_db.tuned_for_spec`.
    """
    return _environment().get_template("module.py.jinja").render(**render_context(plan, tuned))
