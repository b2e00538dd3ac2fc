"""PagedDecoder: a transformers causal LM whose attention writes and reads an engine's paged KV pool.

The weights, norms, MLPs and rotary tables are the transformers model's own (Qwen3 for MHA, DeepSeek-V3 for MLA);
this module runs its layers one by one with an attention that, per layer, writes the new tokens' K/V into the pool
through the pool's setter and reads the request's whole K/V back through the pool's getters, gathered by the
request's slots. The pool is duck-typed on SGLang's KV pool methods:

* MHA: ``set_kv_buffer(None, loc, k, v, layer_id_override=layer)``, ``get_key_buffer(layer)``,
  ``get_value_buffer(layer)`` (per-layer ``[slots, kv_heads, head_dim]``);
* MLA: ``set_kv_buffer(None, loc, latent, None, layer_id_override=layer)``, ``get_key_buffer(layer)``
  (per-layer ``[slots, 1, kv_lora_rank + qk_rope_head_dim]``: the normalized latent, then the rotated key part).

SGLang's pools call the registered layer-transfer counter's ``wait_until(layer)`` inside their getters, so a
layerwise load is waited for exactly where a real attention backend waits for it.

Weights are random but seeded (nothing is downloaded): the KV is a real function of the tokens, and greedy outputs
are comparable between ways of serving the same prompt.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

__all__ = ["PagedDecoder", "KVShape", "Segment", "greedy", "qwen3_config", "deepseek_v3_config"]


@dataclasses.dataclass(frozen=True)
class KVShape:
    """What an engine needs to build the model's KV pool."""

    num_layers: int
    is_mla: bool
    kv_heads: int  # MHA: KV heads; MLA: 1
    head_dim: int  # MHA: head dim; MLA: kv_lora_rank + qk_rope_head_dim
    kv_lora_rank: int = 0  # MLA only
    qk_rope_head_dim: int = 0  # MLA only

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        per_layer = self.kv_heads * self.head_dim * (1 if self.is_mla else 2)
        return self.num_layers * per_layer * torch.empty((), dtype=dtype).element_size()


def qwen3_config(*, num_layers: int = 36, hidden: int = 4096, heads: int = 32, kv_heads: int = 8,
                 head_dim: int = 128, intermediate: int = 12288, vocab: int = 151936, max_positions: int = 40960):
    """A Qwen3 config; the defaults are Qwen3-8B's shapes."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, max_position_embeddings=max_positions, tie_word_embeddings=False)


def deepseek_v3_config(*, num_layers: int = 4, hidden: int = 1024, heads: int = 8, kv_lora_rank: int = 512,
                       qk_rope_head_dim: int = 64, qk_nope_head_dim: int = 128, v_head_dim: int = 128,
                       intermediate: int = 2816, vocab: int = 32000, max_positions: int = 40960):
    """A dense DeepSeek-V3 (MLA) config: no q LoRA, no routed experts, non-interleaved rope."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                            moe_intermediate_size=intermediate, num_hidden_layers=num_layers,
                            num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=None,
                            kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                            qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                            first_k_dense_replace=num_layers, n_routed_experts=1, num_experts_per_tok=1,
                            n_group=1, topk_group=1, rope_interleave=False, max_position_embeddings=max_positions,
                            tie_word_embeddings=False)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[1, heads, n, dim]`` with ``cos``/``sin`` ``[1, n, dim]`` (rotate-half form)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rope weights: pairs (0,1), (2,3)... to the rotate-half order."""
    *lead, d = x.shape
    return x.view(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


def _sdpa_backends():
    """SDPA kernels whose forward is bit-reproducible: flash, memory-efficient and math. cuDNN's attention, which
    torch picks first on Hopper, is not (docs/DESIGN.md, "End-to-end harness"): its greedy outputs can differ from run
    to run."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _causal_mask(n: int, total: int):
    """Causal attention of ``n`` queries at the end of ``total`` keys (None for one query: it sees every key)."""
    if n == 1:
        return None
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(n, total)


class PagedDecoder:
    """A transformers causal LM run layer by layer over a paged KV pool (see the module docstring).

    Args:
        model: a ``Qwen3ForCausalLM`` or ``DeepseekV3ForCausalLM`` (any weights).
    """

    def __init__(self, model) -> None:
        self.model = model.eval()
        self.config = model.config
        cfg = self.config
        self.is_mla = getattr(cfg, "kv_lora_rank", None) is not None
        if self.is_mla:
            self.kv_shape = KVShape(cfg.num_hidden_layers, True, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                    cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        else:
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            self.kv_shape = KVShape(cfg.num_hidden_layers, False, cfg.num_key_value_heads, head_dim)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    @classmethod
    def from_config(cls, config, *, seed: int = 0, device="cpu", dtype: torch.dtype = torch.bfloat16,
                    attn_implementation: str = "sdpa") -> PagedDecoder:
        """Build the model with random weights drawn from ``seed``, directly on ``device`` (no host copy)."""
        from transformers import AutoModelForCausalLM

        config._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        if torch.device(device).type == "cuda":
            torch.cuda.manual_seed_all(seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config)
        finally:
            torch.set_default_dtype(prev)
        return cls(model.to(dtype))

    @property
    def num_layers(self) -> int:
        return self.kv_shape.num_layers

    @torch.inference_mode()
    def forward(self, pool, tokens: torch.Tensor, start: int, write_slots: torch.Tensor,
                read_slots: torch.Tensor) -> torch.Tensor:
        """Run ``tokens`` (positions ``start..``) through every layer; return the last position's logits.

        Args:
            pool: the KV pool (see the module docstring).
            tokens: the new tokens, 1-D, on the model's device.
            start: position of ``tokens[0]``; positions ``0..start-1`` are already in the pool.
            write_slots: the pool slot of each new token (its K/V is written there, every layer).
            read_slots: the slots of positions ``0..start+len(tokens)-1`` (the prefix, then ``write_slots``).
        """
        return self.forward_batch(pool, [Segment(tokens, start, write_slots, read_slots)])[0]

    @torch.inference_mode()
    def forward_batch(self, pool, segments: list["Segment"]) -> torch.Tensor:
        """Run several requests' new tokens as one batch (the projections and MLPs over all of them at once,
        attention per request); return each segment's last-position logits, ``[len(segments), vocab]``."""
        for s in segments:
            n = s.tokens.numel()
            if n < 1 or s.write_slots.numel() != n or s.read_slots.numel() != s.start + n:
                raise ValueError(f"{n} tokens at {s.start}: need {n} write slots and {s.start + n} read slots (and "
                                 f"a token at least), got {s.write_slots.numel()} and {s.read_slots.numel()}")
        inner = self.model.model
        tokens = torch.cat([s.tokens for s in segments])
        h = inner.embed_tokens(tokens)[None]
        positions = torch.cat([torch.arange(s.start, s.start + s.tokens.numel(), device=tokens.device)
                               for s in segments])[None]
        cos, sin = inner.rotary_emb(h, positions)
        ends = torch.tensor([s.tokens.numel() for s in segments]).cumsum(0).tolist()
        parts = [_Part(s, a, b, _causal_mask(b - a, s.start + b - a))
                 for s, a, b in zip(segments, [0] + ends[:-1], ends)]
        write = torch.cat([s.write_slots for s in segments])
        attend = self._mla if self.is_mla else self._mha
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_sdpa_backends()):  # the same inputs give the same logits, run after run
            for i, layer in enumerate(inner.layers):
                x = layer.input_layernorm(h)
                h = h + attend(i, layer.self_attn, pool, x, cos, sin, parts, write)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = ends[0] - 1
        # one segment (what CUDA graphs capture) takes a slice: a list index is a host-to-device copy
        h = inner.norm(h[:, last:last + 1] if len(ends) == 1 else h[:, [b - 1 for b in ends]])
        return self.model.lm_head(h)[0].float()

    def _mha(self, layer: int, attn, pool, x, cos, sin, parts: list["_Part"], write) -> torch.Tensor:
        n, d = x.shape[1], self.kv_shape.head_dim
        q = attn.q_norm(attn.q_proj(x).view(1, n, -1, d)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(1, n, -1, d)).transpose(1, 2)
        v = attn.v_proj(x).view(1, n, -1, d)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        pool.set_kv_buffer(None, write, k[0].transpose(0, 1), v[0], layer_id_override=layer)
        key_buf, value_buf = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        out = []
        for p in parts:
            keys = key_buf[p.seg.read_slots].transpose(0, 1)[None]  # [1, kv_heads, total, d]
            values = value_buf[p.seg.read_slots].transpose(0, 1)[None]
            groups = q.shape[1] // keys.shape[1]
            if groups > 1 and p.mask is not None:  # SDPA's causal bias takes no grouped KV: repeat it per head
                keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
            out.append(F.scaled_dot_product_attention(q[:, :, p.a:p.b], keys, values, attn_mask=p.mask,
                                                      scale=attn.scaling, enable_gqa=groups > 1 and p.mask is None))
        o = torch.cat(out, dim=2)
        return attn.o_proj(o.transpose(1, 2).reshape(1, n, -1))

    def _mla(self, layer: int, attn, pool, x, cos, sin, parts: list["_Part"], write) -> torch.Tensor:
        cfg, n = self.config, x.shape[1]
        rank, rope_dim, nope_dim = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
        if attn.q_lora_rank is None:
            q = attn.q_proj(x)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q = q.view(1, n, -1, nope_dim + rope_dim).transpose(1, 2)
        q_nope, q_rot = q.split([nope_dim, rope_dim], dim=-1)
        latent, k_rot = attn.kv_a_proj_with_mqa(x).split([rank, rope_dim], dim=-1)
        latent = attn.kv_a_layernorm(latent)
        k_rot = k_rot.view(1, 1, n, rope_dim)
        if getattr(cfg, "rope_interleave", False):
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        q_rot, k_rot = _rope(q_rot, cos, sin), _rope(k_rot, cos, sin)
        row = torch.cat((latent[0], k_rot[0, 0]), dim=-1)[:, None]  # [n, 1, rank + rope]
        pool.set_kv_buffer(None, write, row, None, layer_id_override=layer)
        buf = pool.get_key_buffer(layer)
        query = torch.cat((q_nope, q_rot), dim=-1)
        out = []
        for p in parts:
            cached = buf[p.seg.read_slots][:, 0]  # [total, rank + rope]
            total, heads = cached.shape[0], q.shape[1]
            kv = attn.kv_b_proj(cached[:, :rank]).view(total, heads, -1).transpose(0, 1)  # [heads, total, nope + v]
            k_nope, values = kv.split([nope_dim, kv.shape[-1] - nope_dim], dim=-1)
            keys = torch.cat((k_nope, cached[None, :, rank:].expand(heads, -1, -1)), dim=-1)
            out.append(F.scaled_dot_product_attention(query[:, :, p.a:p.b], keys[None], values[None],
                                                      attn_mask=p.mask, scale=attn.scaling))
        o = torch.cat(out, dim=2)
        return attn.o_proj(o.transpose(1, 2).reshape(1, n, -1))

    @torch.inference_mode()
    def reference_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The transformers model's own forward over the whole of ``tokens``: its last position's logits."""
        return self.model(tokens[None], use_cache=False).logits[0, -1].float()


class Segment(NamedTuple):
    """One request's share of a batched forward: its new ``tokens`` at positions ``start..``, the slot each is
    written to, and the slots of all its positions (the prefix's, then ``write_slots``)."""

    tokens: torch.Tensor
    start: int
    write_slots: torch.Tensor
    read_slots: torch.Tensor


class _Part(NamedTuple):
    """A segment's rows ``a..b`` of the batch and its attention mask."""

    seg: Segment
    a: int
    b: int
    mask: Optional[torch.Tensor]


def greedy(logits: torch.Tensor) -> int:
    """The greedy next token (the lowest id among equal maxima, as ``argmax`` picks)."""
    return int(torch.argmax(logits).item())

