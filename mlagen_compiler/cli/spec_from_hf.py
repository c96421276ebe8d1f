"""`mlagen spec-from-hf`: a spec YAML from a Hugging Face config.json (no transformers needed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer, one_line_errors: Callable, usage_error: type[Exception]) -> None:
    """Add spec-from-hf to `app` (helpers passed in from cli.py to avoid an import cycle)."""

    @app.command("spec-from-hf")
    @one_line_errors
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
            raise usage_error(f"-o {output}: is a directory; name the YAML file to write")
        spec = spec_from_config(
            read_hf_config(config), name=name, page_size=page_size, tp_size=tp_size, cache_dtype=cache_dtype
        )
        text = spec_yaml(spec, str(config))
        if output is None:
            typer.echo(text, nl=False)
            return
        output.write_text(text, encoding="utf-8")
        typer.echo(f"{spec.name}: wrote {output}", err=True)
