"""Stage 2 of the pipeline: lower a validated spec to a plan of every constant the kernels need.

Plain Python, no templates, no torch: everything a template prints comes from here, so the decisions
(padding, tile shapes, the autotune space, the split-KV policy) can be unit-tested and read in one place.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .spec import DecodeTiles, MLASpec

__all__ = ["DecodePlan", "KernelPlan", "TileConfig", "lower", "next_pow2", "softmax_scale_of"]

#: dot operands need at least 16 rows; 64 rows fill one Hopper warpgroup MMA.
MIN_BLOCK_M = 16
MAX_BLOCK_M = 64
#: rows merged per program by the split-KV combine kernel
COMBINE_BLOCK_ROWS = 16


def next_pow2(value: int) -> int:
    return 1 << max(0, (int(value) - 1).bit_length())


def softmax_scale_of(spec: MLASpec) -> float:
    """1/sqrt(Dn+Dr), times DeepSeek-V3's YaRN mscale^2 when rope_scaling asks for it."""
    if spec.softmax_scale is not None:
        return float(spec.softmax_scale)
    scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5
    rope = spec.rope_scaling
    if rope is not None and rope.mscale_all_dim and rope.factor > 1:
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


@dataclass(frozen=True, order=True)
class TileConfig:
    """One point of an autotune space."""

    block_n: int
    num_warps: int
    num_stages: int

    def key(self) -> str:
        return f"n{self.block_n}-w{self.num_warps}-s{self.num_stages}"


@dataclass(frozen=True)
class DecodePlan:
    """Absorbed decode over the paged latent cache.

    Rows of a program are (query token, head) pairs, Sq folded into the head dimension, so one program
    serves up to ``max_block_m`` rows and its dots are tensor-core sized. Split-KV: the cache blocks of
    the whole batch are cut into ``num_parts`` equal runs (one program per run and row block), computed on
    the device from ``cache_seqlens``; ``num_parts = max(1, sm_count * parts_per_sm // row_blocks)``.
    """

    dc: int
    dr: int
    dc_pad: int
    dr_pad: int
    min_block_m: int
    max_block_m: int
    parts_per_sm: int
    combine_block_rows: int
    #: autotune space per block_m (as a sorted list of pairs so the plan stays hashable/printable)
    space: tuple[tuple[int, tuple[TileConfig, ...]], ...]
    #: configuration used when no tuned one is recorded for the GPU and bucket
    defaults: tuple[tuple[int, TileConfig], ...]
    #: configuration used under TRITON_INTERPRET (small tiles keep numpy fast)
    interpreter: TileConfig

    def block_ms(self) -> tuple[int, ...]:
        return tuple(m for m, _ in self.space)


@dataclass(frozen=True)
class KernelPlan:
    spec: MLASpec = field(repr=False)
    spec_hash: str
    module_name: str
    num_heads: int
    dtype: str
    page_size: int
    softmax_scale: float
    decode: DecodePlan | None

    def summary(self) -> dict[str, Any]:
        """The plan as plain data (what `mlagen show` prints)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("spec", "decode")}
        if self.decode is not None:
            dec = asdict(self.decode)
            dec["space"] = {m: [c.key() for c in cfgs] for m, cfgs in self.decode.space}
            dec["defaults"] = {m: c.key() for m, c in self.decode.defaults}
            dec["interpreter"] = self.decode.interpreter.key()
            out["decode"] = dec
        return out


def _pinned(values: tuple[int, ...], pin: int | None) -> tuple[int, ...]:
    return (pin,) if pin is not None else values


def _decode_space(block_m: int, dc_pad: int, tiles: DecodeTiles, pinned: bool) -> tuple[TileConfig, ...]:
    """Tile candidates for one row-block size.

    The accumulator is block_m x dc_pad fp32 held in registers, so wide latents need more warps; the
    cache tile is block_n x (dc_pad + dr_pad) and is multi-buffered in shared memory, so wide tiles with
    deep pipelines are dropped where they cannot fit the 227 KB of an H100 SM. Returns () when nothing
    fits (then this block_m is not offered), unless the user pinned knobs.
    """
    block_ns = _pinned((32, 64, 128), tiles.block_n)
    warps = _pinned((4, 8, 16) if dc_pad >= 1024 else (4, 8), tiles.num_warps)
    stages = _pinned((1, 2, 3, 4), tiles.num_stages)
    out = []
    for n in block_ns:
        for w in warps:
            for s in stages:
                acc_regs_per_thread = block_m * dc_pad // (32 * w)
                smem = s * n * (dc_pad + 64) * 2 + block_m * (dc_pad + 64) * 2
                if acc_regs_per_thread > 160 or smem > 220 * 1024:
                    continue
                out.append(TileConfig(n, w, s))
    if not out and pinned:  # a pinned combination that breaks the heuristics is still what the user asked
        out = [TileConfig(block_ns[0], warps[0], stages[0])]
    return tuple(sorted(out))


def _default_decode_config(block_m: int, dc_pad: int, space: tuple[TileConfig, ...]) -> TileConfig:
    """A reasonable untuned choice: 64-token tiles, enough warps for the accumulator, 2 stages."""
    want_warps = 8 if block_m * dc_pad >= 32 * 1024 else 4
    preference = [TileConfig(64, want_warps, 2), TileConfig(32, want_warps, 2), TileConfig(64, 4, 2)]
    for candidate in preference:
        if candidate in space:
            return candidate
    return space[0]


def lower_decode(spec: MLASpec) -> DecodePlan:
    dc, dr = spec.kv_lora_rank, spec.qk_rope_head_dim
    dc_pad, dr_pad = next_pow2(dc), next_pow2(dr)
    tiles = spec.tiles.decode
    pinned = any(v is not None for v in (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages))
    candidates = (tiles.block_m,) if tiles.block_m is not None else (16, 32, 64)
    space = tuple((m, cfgs) for m in candidates if (cfgs := _decode_space(m, dc_pad, tiles, pinned)))
    block_ms = tuple(m for m, _ in space)
    defaults = tuple((m, _default_decode_config(m, dc_pad, cfgs)) for m, cfgs in space)
    return DecodePlan(
        dc=dc,
        dr=dr,
        dc_pad=dc_pad,
        dr_pad=dr_pad,
        min_block_m=min(block_ms),
        max_block_m=max(block_ms),
        parts_per_sm=2,
        combine_block_rows=COMBINE_BLOCK_ROWS,
        space=space,
        defaults=defaults,
        interpreter=TileConfig(block_n=16, num_warps=4, num_stages=1),
    )


def lower(spec: MLASpec) -> KernelPlan:
    return KernelPlan(
        spec=spec,
        spec_hash=spec.content_hash(),
        module_name=spec.module_name,
        num_heads=spec.num_heads,
        dtype=spec.dtype,
        page_size=spec.page_size,
        softmax_scale=softmax_scale_of(spec),
        decode=lower_decode(spec) if "decode" in spec.kernels else None,
    )
