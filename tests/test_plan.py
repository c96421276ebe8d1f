from helpers import DEEPSEEK_V3_TP8_SPEC
from hypothesis import given
from hypothesis import strategies as st

from mlagen_compiler.plan import TileConfig, lower, next_pow2
from mlagen_compiler.spec import spec_from_dict


def spec(**over):
    return spec_from_dict({**DEEPSEEK_V3_TP8_SPEC, **over})


def test_next_pow2():
    assert [next_pow2(v) for v in (1, 2, 3, 16, 17, 192, 576, 1024)] == [1, 2, 4, 16, 32, 256, 1024, 1024]


@given(dc=st.integers(4, 64).map(lambda k: 16 * k), dr=st.integers(1, 8).map(lambda k: 16 * k))
def test_padding_is_pow2_and_covers(dc, dr):
    plan = lower(spec(kv_lora_rank=dc, qk_rope_head_dim=dr)).decode
    for real, padded in ((dc, plan.dc_pad), (dr, plan.dr_pad)):
        assert padded >= real and padded & (padded - 1) == 0 and padded < 2 * real


@given(dc=st.integers(4, 64).map(lambda k: 16 * k))
def test_space_fits_registers_and_shared_memory(dc):
    plan = lower(spec(kv_lora_rank=dc)).decode
    assert plan.block_ms()[0] == 16 and plan.block_ms() == tuple(sorted(plan.block_ms()))
    for block_m, configs in plan.space:
        assert configs, block_m
        for c in configs:
            assert block_m * plan.dc_pad // (32 * c.num_warps) <= 160
            assert c.num_stages * c.block_n * (plan.dc_pad + 64) * 2 + block_m * (plan.dc_pad + 64) * 2 <= 220 * 1024
        default = dict(plan.defaults)[block_m]
        assert default in configs


def test_wide_latent_needs_eight_warps_for_64_rows():
    plan = lower(spec(kv_lora_rank=512)).decode
    assert 4 not in {c.num_warps for c in dict(plan.space)[64]}
    assert dict(plan.defaults)[64].num_warps >= 8


def test_overrides_pin_the_space():
    plan = lower(spec(tiles={"decode": {"block_n": 32, "num_warps": 4, "num_stages": 3, "block_m": 32}})).decode
    assert plan.space == ((32, (TileConfig(32, 4, 3),)),)
    assert plan.min_block_m == plan.max_block_m == 32


def test_prefill_only_spec_has_no_decode_plan():
    plan = lower(spec(kernels=["prefill"]))
    assert plan.decode is None and plan.prefill is not None
    assert "prefill" in plan.summary() and "decode" not in plan.summary()


def test_prefill_plan_splits_qk_into_pow2_parts():
    plan = lower(spec(kernels=["decode", "prefill"])).prefill
    assert (plan.dn_pad, plan.dr_pad, plan.dv_pad) == (128, 64, 128)  # qk 192 = 128 + 64, v stays 128
    assert plan.default in plan.space and plan.interpreter.block_m == plan.interpreter.block_n == 16


@given(
    dn=st.integers(1, 16).map(lambda k: 16 * k),
    dr=st.integers(1, 8).map(lambda k: 16 * k),
    dv=st.integers(1, 16).map(lambda k: 16 * k),
)
def test_prefill_padding_and_space_fit(dn, dr, dv):
    from mlagen_compiler.plan import PREFILL_MAX_REGS_PER_THREAD, PREFILL_MAX_SMEM, prefill_smem_bytes

    plan = lower(spec(qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv, kernels=["prefill"])).prefill
    for real, padded in ((dn, plan.dn_pad), (dr, plan.dr_pad), (dv, plan.dv_pad)):
        assert padded >= real and padded & (padded - 1) == 0 and padded < 2 * real
    assert plan.space and plan.space == tuple(sorted(plan.space)) and plan.default in plan.space
    for c in plan.space:
        assert (c.block_m * plan.dv_pad + c.block_m * c.block_n) // (32 * c.num_warps) <= PREFILL_MAX_REGS_PER_THREAD
        assert prefill_smem_bytes(c, plan.dn_pad, plan.dr_pad, plan.dv_pad) <= PREFILL_MAX_SMEM


def test_prefill_smem_model_matches_what_triton_refused():
    """Triton 3.6 on an H100 asked for these many bytes for qk 128+64 / v 128 (2026-11-22)."""
    from mlagen_compiler.plan import PREFILL_MAX_SMEM, PrefillConfig, prefill_smem_bytes

    for config, asked in (((128, 64, 8, 4), 245760), ((128, 128, 8, 2), 245760), ((128, 128, 8, 3), 327680)):
        assert prefill_smem_bytes(PrefillConfig(*config), 128, 64, 128) == asked > PREFILL_MAX_SMEM
    assert prefill_smem_bytes(PrefillConfig(128, 64, 8, 3), 128, 64, 128) <= PREFILL_MAX_SMEM


def test_prefill_overrides_pin_the_space():
    tiles = {"prefill": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}}
    plan = lower(spec(kernels=["prefill"], tiles=tiles)).prefill
    assert [c.as_tuple() for c in plan.space] == [(64, 32, 4, 2)] and plan.default.as_tuple() == (64, 32, 4, 2)


def test_decode_only_spec_has_no_prefill_plan():
    plan = lower(spec(kernels=["decode"]))
    assert plan.prefill is None and plan.decode is not None
    assert "decode" in plan.summary() and "prefill" not in plan.summary()
