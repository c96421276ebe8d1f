"""`mlagen list`, `show`, `schema` and `spec-from-hf`: the registered specs, a spec's plan, the spec schema, and a
spec derived from a Hugging Face config.json (no transformers needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..plan import emitted_kinds, lower
from ..registry import registered_specs, resolve_spec, spec_dirs
from ..spec import SpecError, json_schema
from .common import SpecDirOption, UsageError, add_commands, check_spec_dirs

__all__ = ["register"]


def list_command(spec_dir: SpecDirOption = None) -> None:
    """Registered specs and the kernels each emits (name/kernel), then the spec directories searched."""
    extra = check_spec_dirs(spec_dir)
    header = f"{'name':<22} {'H':>4} {'Dc':>5} {'Dr':>4} {'Dn':>4} {'Dv':>4} {'Lq':>5} {'page':>5} {'dtype':<9} kernels"
    typer.echo(header)
    for name in registered_specs(extra):
        try:
            s = resolve_spec(name, extra)
        except SpecError as error:
            typer.echo(f"{name:<22} INVALID: {str(error).splitlines()[0]}")
            continue
        kernels = ", ".join(f"{s.name}/{k.name}" for k in emitted_kinds(s))
        lq = "-" if s.q_lora_rank is None else str(s.q_lora_rank)
        typer.echo(
            f"{s.name:<22} {s.num_heads:>4} {s.kv_lora_rank:>5} {s.qk_rope_head_dim:>4} {s.qk_nope_head_dim:>4} "
            f"{s.v_head_dim:>4} {lq:>5} {s.page_size:>5} {s.dtype:<9} {kernels}"
        )
    typer.echo("spec directories (later ones shadow earlier ones):")
    for directory in spec_dirs(extra):
        typer.echo(f"  {directory}{'' if directory.is_dir() else '  (missing)'}")


def show_command(
    spec: Annotated[str, typer.Argument(help="YAML spec file or registered name")],
    spec_dir: SpecDirOption = None,
) -> None:
    """Print the derived plan (every constant the kernels are rendered with) as JSON."""
    typer.echo(json.dumps(lower(resolve_spec(spec, check_spec_dirs(spec_dir))).summary(), indent=2, default=str))


def schema_command() -> None:
    """Print the JSON schema of a spec (for editor validation of YAML)."""
    typer.echo(json.dumps(json_schema(), indent=2, sort_keys=True))


def spec_from_hf_command(
    config: Annotated[Path, typer.Argument(help="a config.json, or a model directory holding one")],
    tp_size: Annotated[int, typer.Option("--tp-size", help="tensor-parallel ranks the heads are split over")] = 1,
    page_size: Annotated[int, typer.Option("--page-size", help="tokens per cache page (power of two)")] = 64,
    name: Annotated[str | None, typer.Option("--name", help="spec name (default <model_type>-tp<N>)")] = None,
    cache_dtype: Annotated[
        str | None,
        typer.Option("--cache-dtype", help="latent cache storage: float8_e4m3fn (default: the spec's dtype)"),
    ] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="YAML file to write (or stdout)")] = None,
) -> None:
    """Derive the MLA spec of a DeepSeek-V2/V3-style config (heads per rank, softmax scale with YaRN)."""
    from ..integrations.hf_config import read_hf_config, spec_from_config, spec_yaml

    if output is not None and output.is_dir():
        raise UsageError(f"-o {output}: is a directory; name the YAML file to write")
    spec = spec_from_config(
        read_hf_config(config), name=name, page_size=page_size, tp_size=tp_size, cache_dtype=cache_dtype
    )
    text = spec_yaml(spec, str(config))
    if output is None:
        typer.echo(text, nl=False)
        return
    output.write_text(text, encoding="utf-8")
    typer.echo(f"{spec.name}: wrote {output}", err=True)


def register(app: typer.Typer) -> None:
    """Add list, show, schema and spec-from-hf to `app`."""
    add_commands(
        app,
        {"list": list_command, "show": show_command, "schema": schema_command, "spec-from-hf": spec_from_hf_command},
    )
