"""The decoder-only Transformer language model: token ids [B, T] -> next-token logits [B, T, vocab_size].

    token_embeddings -> num_layers x TransformerBlock -> ln_final (RMSNorm) -> lm_head (Linear)

Each block is pre-norm: x = x + attn(ln1(x)); x = x + ffn(ln2(x)). Positions enter only through RoPE
inside attention; the output head is not tied to the embeddings.

For generation, `forward(ids, kv_cache=cache)` runs only the new positions and keeps the keys and
values of the earlier ones in a KVCache (see kv_cache.py); training never passes one.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from tinylm.model.attention import CausalSelfAttention
from tinylm.model.kv_cache import KVCache
from tinylm.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, SwiGLU


class TransformerBlock(nn.Module):
    """Pre-norm block: causal self-attention then SwiGLU, each with a residual. [B, T, d_model] -> same."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        rope: RotaryEmbedding | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, num_heads, rope=rope, device=device, dtype=dtype)
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), kv_cache, layer)
        return x + self.ffn(self.ln2(x))


class Transformer(nn.Module):
    """A decoder-only language model.

    forward: token ids [B, T] (any integer dtype, T <= context_length) -> logits [B, T, vocab_size],
    where logits[:, t] predict the token after position t from positions 0 .. t only. With
    `kv_cache` (from `new_kv_cache`), the ids are the positions after the kv_cache.length cached
    ones, and logits[:, t] see the cached positions too.

    `model.config` holds the constructor's numbers, so `Transformer(**model.config)` rebuilds the same
    architecture (e.g. from a checkpoint). One RotaryEmbedding (cos/sin cache) is shared by all layers.
    """

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float = 10000.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        self.config = dict(
            vocab_size=vocab_size,
            context_length=context_length,
            d_model=d_model,
            num_layers=num_layers,
            num_heads=num_heads,
            d_ff=d_ff,
            rope_theta=rope_theta,
        )
        self.vocab_size = vocab_size
        self.context_length = context_length

        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        self.rope = RotaryEmbedding(rope_theta, d_model // num_heads, context_length, device=device)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, num_heads, d_ff, rope=self.rope, device=device, dtype=dtype)
            for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model, device=device, dtype=dtype)
        self.lm_head = Linear(d_model, vocab_size, device=device, dtype=dtype)

    def forward(self, token_ids: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        if token_ids.dim() != 2:
            raise ValueError(f"expected token ids of shape [batch, seq_len], got {tuple(token_ids.shape)}")
        seq_len = token_ids.shape[1]
        if seq_len > self.context_length:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's context_length {self.context_length}"
            )
        if kv_cache is not None and kv_cache.length + seq_len > kv_cache.max_len:
            raise ValueError(
                f"{kv_cache.length} cached and {seq_len} new positions exceed the cache's "
                f"{kv_cache.max_len} (the model's context_length)"
            )
        x = self.token_embeddings(token_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, kv_cache, i)
        if kv_cache is not None:
            kv_cache.advance(seq_len)
        return self.lm_head(self.ln_final(x))

    def new_kv_cache(self, batch_size: int = 1) -> KVCache:
        """An empty cache for `batch_size` sequences of up to context_length positions."""
        attn = self.layers[0].attn
        weight = self.lm_head.weight
        return KVCache(
            len(self.layers),
            batch_size,
            attn.num_heads,
            self.context_length,
            attn.d_head,
            device=weight.device,
            dtype=weight.dtype,
        )

    def set_fast_attention(self, enabled: bool) -> None:
        """Switch every layer between the fused attention kernel (default) and the reference path."""
        for layer in self.layers:
            layer.attn.use_fast_attention = enabled

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of trainable scalars (optionally without the token embedding table)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.token_embeddings.weight.numel()
        return total


# The constructor's architecture arguments (all but device and dtype): the keys of `model.config`.
Transformer.CONFIG_KEYS = tuple(
    name for name in inspect.signature(Transformer).parameters if name not in ("device", "dtype")
)
