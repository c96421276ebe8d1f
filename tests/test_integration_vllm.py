"""mlagen's vLLM attention backend (`mlagen_compiler.integrations.vllm`) with real vLLM objects.

Runs only where vLLM is installed (`.venv-vllm`, made by `scripts/setup.sh vllm`; `scripts/test.sh` runs this
file there); elsewhere the whole file is skipped. The objects are vLLM's own: a VllmConfig from a tiny
DeepSeek-V3 config.json written here, a world of one process (gloo), vLLM's MLAAttention layer with its
kv_b_proj, MLAAttention.forward (cache update, the split into decodes and prefills, the absorbed query and
W_UV in vLLM's code), the backend's metadata builder on vLLM's CommonAttentionMetadata. Only the kernels are
mlagen's, run in Triton's interpreter (`TRITON_INTERPRET=1`, set by conftest.py without a GPU). On a GPU
(where vLLM is importable) the same tests run the compiled kernels, and one more captures a decode step of the
layer in a CUDA graph and replays it on the next step's inputs, as vLLM's full graphs do.

Without a GPU vLLM logs "Triton is installed but 0 active driver(s) found ... Disabling Triton": that swaps
only vLLM's own handle (`vllm.triton_utils.triton`) for a placeholder. The generated modules import `triton`
themselves and the interpreter needs no driver, so nothing has to be restored (a test checks the placeholder
is in place, so a vLLM that starts patching `triton` itself would be noticed here).

What the CPU cannot show, and so is left to the GPU rig: vLLM's engine (scheduler, model runner, CUDA graph
capture and replay), its platform's choice of backend by name, `vllm._C` (absent from this wheel's CPU
import), and timing. vLLM cannot know a compute capability without a GPU either: its MLA prefill selector then
imports FlashAttention unconditionally, so without a GPU the tests state Hopper's (9.0) on the platform object.
And its MLA metadata builder puts the chunked-context bookkeeping in pinned host memory, which needs a CUDA
driver: without a GPU the tests give that module a torch whose empty / zeros leave out pin_memory. That torch
also NaN-fills the floating-point tensors the module allocates with `empty` (the layer's output among them),
on every device, so an output row the backend leaves unwritten fails.
"""

from __future__ import annotations

import json
import socket
import types
from dataclasses import dataclass

import pytest
import torch

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed here (its tests run in .venv-vllm: scripts/setup.sh vllm)"
)

from vllm.config import (  # noqa: E402
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import MLAAttention  # noqa: E402
from vllm.model_executor.layers.linear import ReplicatedLinear  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402

from mlagen_compiler.integrations import vllm as backend  # noqa: E402
from mlagen_compiler.options import use_options  # noqa: E402
from mlagen_compiler.reference import attention, causal_mask, dequantize_cache, quantize_latent  # noqa: E402
from mlagen_compiler.verify import LSE_TOLERANCE, compare  # noqa: E402

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
# a small DeepSeek-V3 geometry that runs quickly in the interpreter
HEADS, DC, DR, DN, DV = 4, 64, 16, 32, 32
SCALE = 0.19  # not (Dn + Dr) ** -0.5: the backend must use the scale vLLM gives the layer
LAYER = "model.layers.0.self_attn.attn"
NUM_BLOCKS = 12


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config.json of a tiny DeepSeek-V3 (what vLLM's ModelConfig reads; no weights are loaded)."""
    directory = tmp_path_factory.mktemp("tiny-deepseek-v3")
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "kv_lora_rank": DC,
        "q_lora_rank": None,
        "qk_rope_head_dim": DR,
        "qk_nope_head_dim": DN,
        "v_head_dim": DV,
        "num_hidden_layers": 1,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def hopper_platform():
    """Without a GPU, vLLM's platform object told it runs on compute capability 9.0 (see the module doc)."""
    if DEVICE.type == "cuda":
        yield
        return
    platform = type(current_platform)
    original = platform.__dict__.get("get_device_capability")
    platform.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
    yield
    if original is None:
        del platform.get_device_capability
    else:
        platform.get_device_capability = original


class _PoisoningTorch(types.ModuleType):
    """torch for vLLM's MLA layer module: floating-point tensors from `empty` (the layer's output buffer among
    them) come NaN-filled, so a row the backend leaves unwritten fails the comparison; without a GPU, empty /
    zeros leave out pin_memory (pinning host memory needs a CUDA driver)."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory: bool = False, **kwargs) -> torch.Tensor:
        tensor = torch.empty(*args, pin_memory=pin_memory and DEVICE.type == "cuda", **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    @staticmethod
    def zeros(*args, pin_memory: bool = False, **kwargs) -> torch.Tensor:
        return torch.zeros(*args, pin_memory=pin_memory and DEVICE.type == "cuda", **kwargs)


@pytest.fixture(scope="module")
def poisoned_layer_buffers():
    """vLLM's MLA layer module allocating through _PoisoningTorch (see the module doc)."""
    from vllm.model_executor.layers.attention import mla_attention

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mla_attention, "torch", _PoisoningTorch("torch"))
        yield


@pytest.fixture(scope="module")
def world(hopper_platform, poisoned_layer_buffers):
    """vLLM's process groups for one process (tensor, data, pipeline and context parallel size 1)."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    base = VllmConfig(device_config=DeviceConfig(device=DEVICE.type))
    with set_current_vllm_config(base):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
    backend.register()


def _vllm_config(model_dir, *, block_size: int, cache_dtype: str) -> VllmConfig:
    """The configuration `LLM(model_dir, attention_backend="CUSTOM", block_size=..., kv_cache_dtype=...)` gives."""
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512)
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
        device_config=DeviceConfig(device=DEVICE.type),
        attention_config=AttentionConfig(backend="CUSTOM"),
    )


def _kv_b_proj(kv_lora_rank: int = DC) -> ReplicatedLinear:
    """The tests' layer's W_UK and W_UV as vLLM holds them: one bfloat16 projection of the latent to H * (Dn + Dv)."""
    return ReplicatedLinear(kv_lora_rank, HEADS * (DN + DV), bias=False, params_dtype=torch.bfloat16)


def _mla_layer(config: VllmConfig, kv_b_proj: ReplicatedLinear, *, prefix: str, kv_lora_rank: int = DC) -> MLAAttention:
    """vLLM's MLAAttention of the tests' geometry (HEADS, DN, DR, DV, SCALE, no query LoRA) on MlagenBackend,
    built under the current vLLM config; kv_lora_rank: DC, or a width the spec refuses."""
    return MLAAttention(
        num_heads=HEADS,
        scale=SCALE,
        qk_nope_head_dim=DN,
        qk_rope_head_dim=DR,
        v_head_dim=DV,
        q_lora_rank=None,
        kv_lora_rank=kv_lora_rank,
        kv_b_proj=kv_b_proj,
        cache_config=config.cache_config,
        prefix=prefix,
        attn_backend=backend.MlagenBackend,
    )


@dataclass
class Sequence:
    """One request's latents for every position: q [S, H, Dn+Dr], c_kv [S, Dc], k_pe [S, Dr]."""

    q: torch.Tensor
    c_kv: torch.Tensor
    k_pe: torch.Tensor
    pages: list[int]


class Rig:
    """vLLM's MLAAttention on MlagenBackend with a paged cache, stepped through prefill and decode."""

    def __init__(self, model_dir, *, block_size: int, cache_dtype: str, lengths: list[int], seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.config = _vllm_config(model_dir, block_size=block_size, cache_dtype=cache_dtype)
        self.block_size = block_size
        self.fp8 = cache_dtype.startswith("fp8")
        # built on the device as vLLM's model loader builds layers (the layer's k_scale lands there too)
        with set_current_vllm_config(self.config), torch.device(DEVICE):
            kv_b_proj = _kv_b_proj()
            kv_b_proj.weight.data.copy_(self._randn(HEADS * (DN + DV), DC) * DC**-0.5)
            self.layer = _mla_layer(self.config, kv_b_proj, prefix=LAYER)
            # the backend chose mlagen's stand-in prefill backend (vLLM's FlashAttention one refuses Dn 32)
            assert isinstance(self.layer.prefill_backend, backend.MlagenPrefillBackend)
            self.layer.process_weights_after_loading(torch.bfloat16)
            self.kv_scale = 0.0 if not self.fp8 else 0.02
            if self.fp8:
                self.layer._k_scale.fill_(self.kv_scale)
            spec = self.layer.get_kv_cache_spec(self.config)
            self.builder = backend.MlagenMetadataBuilder(spec, [LAYER], self.config, DEVICE)
        weight = kv_b_proj.weight.detach().cpu().view(HEADS, DN + DV, DC)
        self.w_uk, self.w_uv = weight[:, :DN].double(), weight[:, DN:].double()
        # the cache as vLLM allocates it: [num_blocks, block_size, Dc+Dr], bytes for fp8; unused rows poisoned
        storage = torch.uint8 if self.fp8 else torch.bfloat16
        self.cache = torch.empty(NUM_BLOCKS, block_size, DC + DR, dtype=storage, device=DEVICE)
        if self.fp8:
            self.cache.fill_(0x7F)  # e4m3's NaN
        else:
            self.cache.fill_(float("nan"))
        self.layer.kv_cache = self.cache
        pages = torch.randperm(NUM_BLOCKS, generator=self.generator).tolist()
        self.sequences = []
        for length in lengths:
            needed = -(-length // block_size)
            taken, pages = pages[:needed], pages[needed:]
            self.sequences.append(
                Sequence(
                    q=self._randn(length, HEADS, DN + DR).to(torch.bfloat16),
                    c_kv=self._randn(length, DC).to(torch.bfloat16),
                    k_pe=self._randn(length, DR).to(torch.bfloat16),
                    pages=taken,
                )
            )
        self.max_pages = max(len(s.pages) for s in self.sequences)

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, device="cpu")  # data on the CPU, moved when used

    def step(
        self, requests: list[tuple[int, int, int]], padding: int = 0, graph_requests: int = 0
    ) -> tuple[torch.Tensor, object]:
        """One forward of the layer (see `inputs`); returns the output rows of the real tokens [T, H*Dv] (on
        the CPU) and the metadata."""
        common, inputs = self.inputs(requests, padding, graph_requests)
        with set_current_vllm_config(self.config):
            if graph_requests:
                metadata = self.builder.build_for_cudagraph_capture(common)
            else:
                metadata = self.builder.build(0, common)
        num_tokens = sum(n for _, _, n in requests)
        return self.forward(metadata, *inputs)[:num_tokens].cpu(), metadata

    def forward(self, metadata, q, c_kv, k_pe, slot_mapping) -> torch.Tensor:
        """MLAAttention.forward in vLLM's forward context: the output [rows, H*Dv] on the device."""
        with (
            set_current_vllm_config(self.config),
            set_forward_context({LAYER: metadata}, self.config, slot_mapping={LAYER: slot_mapping}),
        ):
            return self.layer(q, c_kv, k_pe.unsqueeze(1), output_shape=(q.shape[0], HEADS * DV))

    def inputs(
        self, requests: list[tuple[int, int, int]], padding: int = 0, graph_requests: int = 0
    ) -> tuple[CommonAttentionMetadata, tuple[torch.Tensor, ...]]:
        """vLLM's CommonAttentionMetadata and the layer's inputs (q, c_kv, k_pe, slot mapping) for requests
        (sequence, first position, new tokens), decodes first as vLLM orders them; `padding` extra token
        rows (slot -1). graph_requests: pad the batch as vLLM pads a batch for a full CUDA graph, to that
        many requests (the extra ones: no tokens, length 0, block table rows of page 0; the padding rows
        count as tokens), for build_for_cudagraph_capture."""
        lengths = [n for _, _, n in requests]
        num_reqs = max(len(requests), graph_requests)
        starts = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
        starts = torch.cat([starts, starts[-1:].expand(num_reqs - len(requests))])
        seq_lens = torch.tensor([first + n for _, first, n in requests], dtype=torch.int32)
        seq_lens = torch.cat([seq_lens, torch.zeros(num_reqs - len(requests), dtype=torch.int32)])
        table = torch.zeros(num_reqs, self.max_pages, dtype=torch.int32)
        slots, q, c_kv, k_pe = [], [], [], []
        for row, (index, first, count) in enumerate(requests):
            seq = self.sequences[index]
            table[row, : len(seq.pages)] = torch.tensor(seq.pages, dtype=torch.int32)
            for position in range(first, first + count):
                slots.append(seq.pages[position // self.block_size] * self.block_size + position % self.block_size)
            q.append(seq.q[first : first + count])
            c_kv.append(seq.c_kv[first : first + count])
            k_pe.append(seq.k_pe[first : first + count])
        num_tokens = len(slots)
        q = torch.cat([*q, self._randn(padding, HEADS, DN + DR).to(torch.bfloat16)])
        c_kv = torch.cat([*c_kv, self._randn(padding, DC).to(torch.bfloat16)])
        k_pe = torch.cat([*k_pe, self._randn(padding, DR).to(torch.bfloat16)])
        slot_mapping = torch.tensor(slots + [-1] * padding, dtype=torch.int64)
        counted = num_tokens + padding if graph_requests else num_tokens
        slot_mapping = slot_mapping.to(DEVICE)
        common = CommonAttentionMetadata(
            query_start_loc=starts.to(DEVICE),
            query_start_loc_cpu=starts,
            seq_lens=seq_lens.to(DEVICE),
            num_reqs=num_reqs,
            num_actual_tokens=counted,
            max_query_len=max(lengths),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=table.to(DEVICE),
            slot_mapping=slot_mapping[:counted],
            seq_lens_cpu_upper_bound=seq_lens,
        )
        return common, (q.to(DEVICE), c_kv.to(DEVICE), k_pe.to(DEVICE), slot_mapping)

    def latents_seen(self, index: int, end: int, cached_before: int, from_cache: bool) -> torch.Tensor:
        """The latent rows [c_kv ; k_pe] of positions 0..end-1 of a sequence as the attention reads them: an
        fp8 cache's rows dequantised where they come from the cache (every row for decode, the context rows
        for prefill, which attends to its own new tokens in MHA form, unquantised)."""
        seq = self.sequences[index]
        rows = torch.cat([seq.c_kv[:end], seq.k_pe[:end]], dim=-1).double()
        if self.fp8:
            quantised = dequantize_cache(quantize_latent(rows, self.kv_scale, torch.float8_e4m3fn), self.kv_scale)
            limit = end if from_cache else cached_before
            rows[:limit] = quantised[:limit].double()
        return rows

    def reference(self, requests: list[tuple[int, int, int]], decodes: int) -> torch.Tensor:
        """float64 MLA in decompressed form, causal over each sequence's positions: [T, H*Dv]."""
        outputs = []
        for row, (index, first, count) in enumerate(requests):
            rows = self.latents_seen(index, first + count, first, from_cache=row < decodes)
            c_kv, k_pe = rows[:, :DC], rows[:, DC:]
            k_nope = torch.einsum("sc,hnc->shn", c_kv, self.w_uk)
            keys = torch.cat([k_nope, k_pe[:, None, :].expand(-1, HEADS, -1)], dim=-1)
            values = torch.einsum("sc,hvc->shv", c_kv, self.w_uv)
            q = self.sequences[index].q[first : first + count].double()
            out, _ = attention(q, keys, values, SCALE, causal_mask(count, first + count))
            outputs.append(out.reshape(count, HEADS * DV))
        return torch.cat(outputs)

    def check_cache(self, written: dict[int, int]) -> None:
        """Rows written so far (sequence -> positions) hold [c_kv ; k_pe] (fp8: quantised with k_scale), the
        others still hold the poison."""
        cache = self.cache.cpu()
        expected = torch.zeros(NUM_BLOCKS, self.block_size, dtype=torch.bool)
        for index, count in written.items():
            seq = self.sequences[index]
            for position in range(count):
                page, offset = seq.pages[position // self.block_size], position % self.block_size
                expected[page, offset] = True
                row = torch.cat([seq.c_kv[position], seq.k_pe[position]])
                if self.fp8:
                    stored = cache[page, offset].view(torch.float8_e4m3fn)
                    assert torch.equal(
                        stored.view(torch.uint8),
                        quantize_latent(row, self.kv_scale, torch.float8_e4m3fn).view(torch.uint8),
                    )
                else:
                    assert torch.equal(cache[page, offset], row)
        untouched = cache[~expected]
        if self.fp8:
            assert bool((untouched == 0x7F).all()), "a cache row outside the slot mapping was written"
        else:
            assert bool(untouched.isnan().all()), "a cache row outside the slot mapping was written"


def _check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    _, _, message = compare(out, ref, "bfloat16")
    assert not message, f"{what}: {message}"


@pytest.mark.parametrize(
    ("cache_dtype", "block_size"),
    [("auto", 16), ("fp8", 16), ("auto", 4)],
    ids=["bf16-block16", "fp8-block16", "bf16-block4"],
)
def test_layer_steps_match_reference(world, model_dir, cache_dtype, block_size):
    """A prompt in two chunks beside a short one, a mixed decode + chunk step, uniform 2-token decode steps
    (speculative / MTP) and padded 1-token steps: every output equals float64 MLA within bf16 tolerance, and
    the cache holds exactly the written rows."""
    rig = Rig(model_dir, block_size=block_size, cache_dtype=cache_dtype, lengths=[25, 15], seed=7)

    # a prompt chunk (12 tokens) and a whole short prompt (9 tokens), nothing cached before
    step = [(0, 0, 12), (1, 0, 9)]
    out, metadata = rig.step(step)
    assert metadata.num_decodes == 0 and metadata.prefill_groups is None
    _check(out, rig.reference(step, decodes=0), "prefill")
    rig.check_cache({0: 12, 1: 9})

    # sequence 1 decodes one token while sequence 0's next chunk (8 tokens) attends to its cached 12
    step = [(1, 9, 1), (0, 12, 8)]
    out, metadata = rig.step(step)
    assert (metadata.num_decodes, metadata.num_prefills) == (1, 1)
    assert [group.num_prefix_tokens for group in metadata.prefill_groups] == [12]
    _check(out, rig.reference(step, decodes=1), "decode + chunked prefill")
    rig.check_cache({0: 20, 1: 10})

    # uniform 2-token decode steps, as with one speculative token (vLLM then raises the threshold to 2)
    rig.builder.reorder_batch_threshold = 2
    step = [(0, 20, 2), (1, 10, 2)]
    out, metadata = rig.step(step)
    assert metadata.num_decodes == 2 and metadata.decode.schedule.seqlen_q == 2
    _check(out, rig.reference(step, decodes=2), "2-token decode")
    rig.check_cache({0: 22, 1: 12})

    # 1-token decode with two padding rows (slot -1): nothing of theirs reaches the cache
    rig.builder.reorder_batch_threshold = 1
    step = [(0, 22, 1), (1, 12, 1)]
    out, metadata = rig.step(step, padding=2)
    _check(out, rig.reference(step, decodes=2), "1-token decode")
    rig.check_cache({0: 23, 1: 13})
    schedule = metadata.decode.schedule
    out, metadata = rig.step([(0, 23, 1), (1, 13, 1)])
    assert metadata.decode.schedule is schedule, "a batch shape's schedule is planned once and reused"
    _check(out, rig.reference([(0, 23, 1), (1, 13, 1)], decodes=2), "1-token decode again")

    # a batch padded as for a full CUDA graph: 2 requests + 2 padding requests of length 0, 2 padding tokens
    step = [(0, 24, 1), (1, 14, 1)]
    out, metadata = rig.step(step, padding=2, graph_requests=4)
    assert metadata.num_decodes == 4 and metadata.decode.schedule.batch_size == 4
    _check(out, rig.reference(step, decodes=2), "decode padded for a CUDA graph")
    rig.check_cache({0: 25, 1: 15})


@pytest.mark.parametrize(
    ("step", "limit", "groups", "written"),
    [
        (
            [(0, 8, 6), (1, 10, 6), (2, 4, 3), (3, 0, 5)],
            14,
            [(0, 1, 0, 6, 8), (1, 4, 6, 20, 14)],
            {0: 14, 1: 16, 2: 7, 3: 5},
        ),
        (
            [(0, 8, 6), (1, 10, 6), (3, 0, 5)],
            9,
            [(0, 1, 0, 6, 8), (1, 2, 6, 12, 10), (2, 3, 12, 17, 0)],
            {0: 14, 1: 16, 2: 4, 3: 5},
        ),
    ],
    ids=["two-groups", "new-prompt-alone"],
)
def test_chunked_prefill_in_groups(world, model_dir, step, limit, groups, written):
    """Prefill requests after cached contexts run in groups of whole requests whose contexts fit
    prefix_tokens_per_call (vLLM's prefill workspace in use; a few tokens here), new prompts among them or in
    a group of their own (then plain prefill): the outputs equal float64 MLA all the same."""
    rig = Rig(model_dir, block_size=4, cache_dtype="auto", lengths=[14, 16, 7, 5], seed=13)
    rig.step([(0, 0, 8), (1, 0, 10), (2, 0, 4)])
    rig.builder.prefix_tokens_per_call = limit
    out, metadata = rig.step(step)
    planned = [(g.first, g.last, g.first_token, g.last_token, g.num_prefix_tokens) for g in metadata.prefill_groups]
    assert planned == groups
    for group in metadata.prefill_groups:
        requests = step[group.first : group.last]
        assert group.prefix_lens.tolist() == [first for _, first, _ in requests]
        assert group.cu_seqlens.tolist() == [0, *torch.tensor([n for *_, n in requests]).cumsum(0).tolist()]
    _check(out, rig.reference(step, decodes=0), "chunked prefill in groups")
    rig.check_cache(written)


def test_prefill_stays_vllms_only_where_its_choice_runs(world, model_dir, monkeypatch):
    """With no mla_prefill_backend named, vLLM's own prefill is kept where its selection finds one for the model
    (the layers of the other tests have Dn 32, which vLLM's FlashAttention refuses: mlagen prefills them)."""
    from vllm.v1.attention.backends.mla.prefill import selector

    config = _vllm_config(model_dir, block_size=16, cache_dtype="auto")
    monkeypatch.setattr(selector, "get_mla_prefill_backend", lambda vllm_config: backend.MlagenPrefillBackend)
    assert backend._vllm_prefill_runs(config)

    def refuse(vllm_config):
        raise ValueError("No valid MLA prefill backend found")

    monkeypatch.setattr(selector, "get_mla_prefill_backend", refuse)
    assert not backend._vllm_prefill_runs(config)


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_warm_up_calls_every_entry_point_once_per_process(world, model_dir, monkeypatch, cache_dtype):
    """The engine-start warm-up (on a GPU the builder runs it; here called directly): decode at every batch size
    and query length, cache writes at 1 / 16 / 17 tokens, prefill and chunked prefill with host integers on both
    sides of Triton's divisibility-by-16 specialisation; a second call does nothing."""
    rig = Rig(model_dir, block_size=4, cache_dtype=cache_dtype, lengths=[5], seed=3)
    module = rig.builder.module
    calls: dict[str, int] = {}
    max_seqlens: dict[str, list[int]] = {}

    def counted(name: str):
        original = getattr(module, name)

        def counting(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            if name in ("mla_prefill", "mla_chunked_prefill"):
                max_seqlens.setdefault(name, []).append(args[5])
            return original(*args, **kwargs)

        return counting

    for name in ("mla_decode", "mla_prefill", "mla_chunked_prefill", "mla_cache_write"):
        monkeypatch.setattr(module, name, counted(name))
    with set_current_vllm_config(rig.config):
        for _ in range(2):
            rig.layer.impl.warm_up(module, DEVICE, max_batch=2, seqlens_q=(1, 2), block_table_width=3)
    assert calls == {"mla_decode": 4, "mla_cache_write": 3, "mla_prefill": 2, "mla_chunked_prefill": 2}
    for name, values in max_seqlens.items():
        assert sorted(value % 16 == 0 for value in values) == [False, True], (name, values)


def test_decode_lse_layout(world, model_dir):
    """forward_mqa's LSE where vLLM asks for it (decode context parallelism): [tokens, H], natural log,
    as vLLM's own MLA backends return it, for a 2-token step; the output rows as without it."""
    rig = Rig(model_dir, block_size=8, cache_dtype="auto", lengths=[11, 6], seed=3)
    rig.step([(0, 0, 9), (1, 0, 4)])
    rig.builder.reorder_batch_threshold = 2
    step = [(0, 9, 2), (1, 4, 2)]
    _, metadata = rig.step(step)
    impl, layer = rig.layer.impl, rig.layer
    q = torch.cat([rig.sequences[0].q[9:11], rig.sequences[1].q[4:6]])
    w_uk_t = layer.W_UK_T.detach().float().cpu()
    q_latent = torch.einsum("thn,hnc->thc", q[..., :DN].float(), w_uk_t).to(torch.bfloat16)
    q_absorbed = (q_latent.to(DEVICE), q[..., DN:].to(DEVICE))
    impl.need_to_return_lse_for_decode = True
    out, lse = impl.forward_mqa(q_absorbed, rig.cache, metadata, layer)
    impl.need_to_return_lse_for_decode = False
    plain, none = impl.forward_mqa(q_absorbed, rig.cache, metadata, layer)
    assert none is None and torch.equal(out, plain)
    assert lse.shape == (4, HEADS) and lse.dtype == torch.float32
    out, lse = out.cpu(), lse.cpu()
    for row, (index, first, count) in enumerate(step):
        rows = rig.latents_seen(index, first + count, first, from_cache=True)
        keys = rows[None].expand(HEADS, -1, -1).transpose(0, 1)  # [S, H, Dc+Dr]: one latent key for all heads
        query = torch.cat([q_latent[2 * row : 2 * row + 2], q[2 * row : 2 * row + 2, :, DN:]], dim=-1).double()
        ref_out, ref_lse = attention(query, keys, keys[..., :DC], SCALE, causal_mask(count, first + count))
        _check(out[2 * row : 2 * row + 2], ref_out, "decode latent output")
        torch.testing.assert_close(lse[2 * row : 2 * row + 2].double(), ref_lse.T, **LSE_TOLERANCE)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_decode_step_replays_from_cuda_graph(world, model_dir, cache_dtype):
    """A decode step of the layer (cache write, absorbed decode, W_UV) captured in a CUDA graph on metadata
    from build_for_cudagraph_capture, padded to 4 requests as vLLM pads it, then replayed on the next two
    steps' inputs copied into the captured buffers (the schedule and its workspace stay the captured ones):
    each replay equals float64 MLA and writes exactly its rows."""
    rig = Rig(model_dir, block_size=64, cache_dtype=cache_dtype, lengths=[70, 40], seed=11)
    rig.step([(0, 0, 60), (1, 0, 30)])
    # conftest's MLAGEN_VALIDATE=1 reads index values back: not capturable
    with use_options(validate=False):
        step = [(0, 60, 1), (1, 30, 1)]
        common, buffers = rig.inputs(step, padding=2, graph_requests=4)
        with set_current_vllm_config(rig.config):
            metadata = rig.builder.build_for_cudagraph_capture(common)
        _check(rig.forward(metadata, *buffers)[:2].cpu(), rig.reference(step, decodes=2), "eager warm-up")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rig.forward(metadata, *buffers)
        for position in (61, 62):  # the next steps, in place of the captured inputs
            step = [(0, position, 1), (1, position - 30, 1)]
            next_common, next_inputs = rig.inputs(step, padding=2, graph_requests=4)
            for kept, new in zip(
                (*buffers, common.seq_lens, common.block_table_tensor),
                (*next_inputs, next_common.seq_lens, next_common.block_table_tensor),
                strict=True,
            ):
                kept.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            _check(out[:2].cpu(), rig.reference(step, decodes=2), f"replay at {position}")
        rig.check_cache({0: 63, 1: 33})


def test_decode_schedules_kept(world, model_dir):
    """A batch shape's schedule (and its workspace) is planned once: those of captured CUDA graphs stay for
    good, those of other shapes only for the EAGER_SCHEDULES_KEPT newest shapes (vLLM's batches take
    hundreds of shapes)."""
    rig = Rig(model_dir, block_size=16, cache_dtype="auto", lengths=[6, 6], seed=5)
    _, metadata = rig.step([(0, 0, 1), (1, 0, 1)], padding=2, graph_requests=4)
    captured = metadata.decode.schedule
    builder = rig.builder
    shapes = [(batch, 1) for batch in range(5, 5 + 2 * backend.EAGER_SCHEDULES_KEPT)]
    first = builder._schedule(*shapes[0])
    assert builder._schedule(*shapes[0]) is first
    for shape in shapes[1:]:
        builder._schedule(*shape)
    assert list(builder._eager_schedules) == shapes[-backend.EAGER_SCHEDULES_KEPT :]
    assert builder._schedule(*shapes[0]) is not first
    assert builder._schedule(4, 1) is captured and (4, 1) not in builder._eager_schedules


def test_backend_declarations(world):
    """What vLLM reads from the classes: name, block sizes the spec allows, CUDA-graph level, query lengths,
    and the refusals that reach the engine's start as one line."""
    cls = backend.MlagenBackend
    assert cls.get_name() == "MLAGEN" and cls.is_mla()
    assert cls.get_supported_kernel_block_sizes() == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert cls.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE) == 64
    assert cls.supports_block_size(16) and cls.supports_block_size(1024)
    assert cls.supports_head_size(80) and cls.supports_head_size(576)
    assert cls.supports_kv_cache_dtype("fp8") and not cls.supports_kv_cache_dtype("fp8_e5m2")
    builder = backend.MlagenMetadataBuilder
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_BATCH
    assert builder.query_len_support.name == "UNIFORM"
    reasons = cls.validate_configuration(
        head_size=80,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=DeviceCapability(9, 0),
        attn_type="decoder",
    )
    assert any("Multi-head Latent Attention only" in reason for reason in reasons)
    assert backend.check_vllm_version("0.26.0") is None
    refusal = backend.check_vllm_version("0.27.0")
    assert "0.27.0" in refusal and backend.UNTESTED_ENV in refusal and "\n" not in refusal
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum.CUSTOM.get_class() is cls
    assert MLAPrefillBackendEnum.CUSTOM.get_class() is backend.MlagenPrefillBackend


def test_plugin_entry_point_registers(world):
    """vLLM's own plugin loader finds mlagen's entry point (the installed package's metadata) and its
    register() makes MlagenBackend the CUSTOM backend."""
    from importlib.metadata import PackageNotFoundError, distribution, entry_points

    from vllm.plugins import load_plugins_by_group
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    try:
        distribution("mlagen")
    except PackageNotFoundError:
        pytest.skip("mlagen is not installed as a package here (its entry points live in the package's metadata)")

    (point,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "mlagen"]
    assert point.value == "mlagen_compiler.integrations.vllm:register"
    AttentionBackendEnum.CUSTOM.clear_override()
    assert AttentionBackendEnum.CUSTOM not in _ATTN_OVERRIDES
    load_plugins_by_group("vllm.general_plugins")["mlagen"]()
    assert AttentionBackendEnum.CUSTOM.get_class() is backend.MlagenBackend


@pytest.mark.skipif(DEVICE.type == "cuda", reason="with a GPU vLLM keeps its Triton")
def test_triton_placeholder_is_vllms_own(world):
    """vLLM disables its own Triton handle without a GPU; the generated modules' triton is the real one."""
    import triton
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils import triton as vllm_triton

    assert not HAS_TRITON and vllm_triton is not triton and hasattr(triton, "jit")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("block_size", 512, "page_size=512 is not allowed: must be a power of two in 1..256"),
        ("kv_cache_dtype", "fp8_e5m2", "kv_cache_dtype='fp8_e5m2' is not served"),
        ("kv_lora_rank", 40, "kv_lora_rank=40 is not allowed"),
        ("dtype", torch.float32, "runs bfloat16 or float16 models"),
    ],
)
def test_spec_errors_are_one_line(field, value, expected):
    """A geometry, block size, cache or model dtype the spec refuses: one line naming the field."""
    fields = dict(
        num_heads=HEADS,
        kv_lora_rank=DC,
        qk_rope_head_dim=DR,
        qk_nope_head_dim=DN,
        v_head_dim=DV,
        q_lora_rank=None,
        softmax_scale=SCALE,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
    )
    fields[field] = value
    with pytest.raises(ValueError) as error:
        backend.spec_for_layer(**fields)
    assert expected in str(error.value)
    assert "\n" not in str(error.value).strip()


def test_spec_follows_vllm_layer(world, model_dir):
    """The spec derived from vLLM's layer arguments: heads per rank, widths, vLLM's scale, the page size,
    and vLLM's fp8 cache as an e4m3 spec."""
    for cache_dtype, expected in (("auto", "bfloat16"), ("fp8", "float8_e4m3fn")):
        rig_config = _vllm_config(model_dir, block_size=32, cache_dtype=cache_dtype)
        with set_current_vllm_config(rig_config):
            layer = _mla_layer(rig_config, _kv_b_proj(), prefix=f"{LAYER}.{cache_dtype}")
        spec = layer.impl.spec_for(32)
        assert (spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim) == (HEADS, DC, DR, DN)
        assert spec.v_head_dim == DV and spec.page_size == 32 and spec.dtype == "bfloat16"
        assert spec.softmax_scale == SCALE and (spec.cache_dtype or spec.dtype) == expected


def test_engine_start_refuses_geometry(world, model_dir):
    """A layer whose geometry the spec refuses fails when vLLM constructs it, with the spec's one line."""
    config = _vllm_config(model_dir, block_size=16, cache_dtype="auto")
    with set_current_vllm_config(config), pytest.raises(ValueError) as error:
        _mla_layer(config, _kv_b_proj(40), prefix=f"{LAYER}.refused", kv_lora_rank=40)
    assert "kv_lora_rank=40 is not allowed: must be a multiple of 16 in 64..1024" in str(error.value)
    assert "\n" not in str(error.value).strip()


def test_the_untested_release_switch_is_a_knob_mlagen_env_lists_and_checks():
    from mlagen_compiler.knobs import knob_states

    states = {state.name: state for state in knob_states({backend.UNTESTED_ENV: "yes"})}
    assert states[backend.UNTESTED_ENV].problem == f"{backend.UNTESTED_ENV}: expected 0 or 1, got 'yes'"
    assert not {state.name: state for state in knob_states({backend.UNTESTED_ENV: "1"})}[backend.UNTESTED_ENV].problem
