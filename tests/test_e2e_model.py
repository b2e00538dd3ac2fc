"""PagedDecoder (the end-to-end harness's model) computes what the transformers model computes, over a paged pool."""

import pytest
import torch

pytest.importorskip("transformers")

from kvtier.e2e.model import PagedDecoder, deepseek_v3_config, qwen3_config  # noqa: E402

CONFIGS = {
    "qwen3_mha": lambda: qwen3_config(num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                                      vocab=256),
    "deepseek_v3_mla": lambda: deepseek_v3_config(num_layers=2, hidden=64, heads=4, kv_lora_rank=32,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                                  intermediate=128, vocab=256),
}


class ListPool:
    """Per-layer buffers with SGLang's pool method names (the MLA latent lives in the key buffer)."""

    def __init__(self, shape, slots: int):
        self.k = [torch.full((slots, shape.kv_heads, shape.head_dim), float("nan")) for _ in range(shape.num_layers)]
        self.v = [torch.full_like(b, float("nan")) for b in self.k]
        self.reads = []

    def set_kv_buffer(self, layer, loc, k, v, layer_id_override):
        self.k[layer_id_override][loc] = k
        if v is not None:
            self.v[layer_id_override][loc] = v

    def get_key_buffer(self, layer):
        self.reads.append(layer)
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_paged_forward_equals_transformers_forward(name):
    model = PagedDecoder.from_config(CONFIGS[name](), seed=1, dtype=torch.float32, attn_implementation="eager")
    tokens = torch.randint(0, 256, (41,), generator=torch.Generator().manual_seed(2))
    slots = torch.randperm(128, generator=torch.Generator().manual_seed(3))[:41]
    for n in (17, 40, 41):  # prefill lengths compared with the reference over the same tokens
        ref = model.reference_logits(tokens[:n])
        whole = model.forward(ListPool(model.kv_shape, 128), tokens[:n], 0, slots[:n], slots[:n])
        torch.testing.assert_close(whole, ref, rtol=0, atol=2e-5)
    pool = ListPool(model.kv_shape, 128)  # a cached prefix, an extend, then one decode step
    model.forward(pool, tokens[:24], 0, slots[:24], slots[:24])
    extend = model.forward(pool, tokens[24:40], 24, slots[24:40], slots[:40])
    torch.testing.assert_close(extend, model.reference_logits(tokens[:40]), rtol=0, atol=2e-5)
    pool.reads.clear()
    step = model.forward(pool, tokens[40:41], 40, slots[40:41], slots[:41])
    torch.testing.assert_close(step, model.reference_logits(tokens), rtol=0, atol=2e-5)
    assert pool.reads == list(range(model.num_layers))  # every layer read through the pool's getter, in order


def test_forward_rejects_mismatched_slots():
    model = PagedDecoder.from_config(CONFIGS["qwen3_mha"](), dtype=torch.float32)
    pool = ListPool(model.kv_shape, 16)
    with pytest.raises(ValueError, match="need 4 write slots and 6 read slots"):
        model.forward(pool, torch.arange(4), 2, torch.arange(3), torch.arange(6))


def test_graphed_forward_needs_a_cuda_model():
    from kvtier.e2e.graphs import GraphedForward

    model = PagedDecoder.from_config(CONFIGS["qwen3_mha"](), dtype=torch.float32)
    with pytest.raises(ValueError, match="CUDA device"):
        GraphedForward(model, ListPool(model.kv_shape, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_graph_replays_give_the_eager_logits_and_kv(name):
    """Each captured shape replays with new tokens and slots: the logits and the whole pool equal an eager run's
    over the same inputs, bit for bit, and the slots lent to the capture are left alone; a shape not captured, or
    another pool, runs eagerly."""
    from kvtier.e2e.engine import PagedPool
    from kvtier.e2e.graphs import GraphedForward

    model = PagedDecoder.from_config(CONFIGS[name](), seed=1, device="cuda")
    gen = torch.Generator().manual_seed(2)
    graphed, eager = PagedPool(model, 256, 16), PagedPool(model, 256, 16)
    fwd = GraphedForward(model, graphed)
    spare = torch.arange(160, 256, device="cuda")  # the captures' warm-up runs write there
    fwd.capture(0, spare[:40], spare[:40])
    fwd.capture(32, spare[32:40], spare[:40])
    fwd.capture(40, spare[40:41], spare[:41])
    assert len(fwd) == 3 and (32, 8) in fwd
    lent = [b[160:].clone() for b in graphed.buffers]
    for seed in (3, 4):  # replays with other tokens and slots than the capture's
        tokens = torch.randint(0, 256, (41,), generator=gen).cuda()
        slots = torch.randperm(160, generator=torch.Generator().manual_seed(seed))[:41].cuda()
        for start, end in ((0, 40), (32, 40), (40, 41)):
            got = fwd(graphed, tokens[start:end], start, slots[start:end], slots[:end])
            want = model.forward(eager, tokens[start:end], start, slots[start:end], slots[:end])
            assert torch.equal(got, want), (start, end)
        for a, b, kept in zip(graphed.buffers, eager.buffers, lent):
            assert torch.equal(a[:160], b[:160]) and torch.equal(a[160:], kept)
        assert torch.equal(fwd(graphed, tokens, 0, slots, slots), model.forward(eager, tokens, 0, slots, slots))
    other = PagedPool(model, 256, 16)
    assert torch.equal(fwd(other, tokens[:40], 0, slots[:40], slots[:40]),
                       model.forward(eager, tokens[:40], 0, slots[:40], slots[:40]))
    assert fwd.replays == 6 and fwd.eager == 3  # (0, 41) was never captured; `other` is not the graphs' pool


def test_graphed_engine_needs_whole_loads():
    from kvtier.config import TierConfig
    from kvtier.e2e.engine import TierEngine

    model = PagedDecoder.from_config(CONFIGS["qwen3_mha"](), dtype=torch.float32)
    with pytest.raises(ValueError, match="layerwise=False"):
        TierEngine(model, TierConfig(page_size=16, cpu_cache_gb=1 / 256), num_slots=256, cuda_graphs=True)


@pytest.mark.gpu
def test_graphed_engine_serves_what_the_eager_engine_serves():
    """A TierEngine on graphs serves a prompt recomputed, then (the device pool wiped) its prefix from the CPU tier:
    the same greedy outputs as an eager engine, with every forward of the captured shapes replayed."""
    from kvtier.config import TierConfig
    from kvtier.e2e.engine import TierEngine

    model = PagedDecoder.from_config(CONFIGS["qwen3_mha"](), seed=1, device="cuda")
    config = TierConfig(page_size=16, cpu_cache_gb=1 / 256, layerwise=False)
    prompt = torch.randint(1, 256, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    outs = {}
    for graphs in (False, True):
        engine = TierEngine(model, config, num_slots=512, cuda_graphs=graphs)
        if graphs:
            engine.capture_graphs(80, 4, cached=(0, 64))
        held = engine.pool.alloc(128)  # the requests take other slots than the capture's
        first = engine.serve(prompt, 4, source="none")
        engine.drop_device_cache()
        for buf in engine.pool.buffers:  # nothing of the first request is left on the device
            buf.fill_(float("nan"))
        hit = engine.serve(prompt, 4, source="kvtier")
        engine.pool.free(held)
        assert hit.cached == 64
        outs[graphs] = (first.output, hit.output)
        if graphs:
            assert engine.graphs.eager == 0 and engine.graphs.replays == 8
        engine.tier.destroy()
    assert outs[True] == outs[False] and outs[True][0] == outs[True][1]


@pytest.mark.parametrize("block_tokens", [16, 32])
def test_hit_tokens_is_what_a_full_host_hit_serves(block_tokens):
    """The shape capture_graphs takes for a hit by default is the one serve takes: a full host hit serves whole
    pages short of the last token, in whole host blocks."""
    from kvtier.config import TierConfig
    from kvtier.e2e.engine import TierEngine

    model = PagedDecoder.from_config(CONFIGS["qwen3_mha"](), dtype=torch.float32)
    config = TierConfig(page_size=16, tokens_per_block=block_tokens, cpu_cache_gb=1 / 256, layerwise=False)
    engine = TierEngine(model, config, num_slots=512)
    prompt = torch.randint(1, 256, (112,), generator=torch.Generator().manual_seed(5)).tolist()
    engine.serve(prompt, 2, source="none")
    for n in (17, 80, 81, 112):
        engine.drop_device_cache()
        assert engine.serve(prompt[:n], 2, source="kvtier").cached == engine.hit_tokens(n), n
    assert [engine.hit_tokens(n) for n in (16, 80, 81)] == [0, 64, 80 // block_tokens * block_tokens]
    engine.tier.destroy()
