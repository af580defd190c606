"""Causal multi-head self-attention.

Two paths compute the same numbers:
- `scaled_dot_product_attention`, the readable reference: softmax(Q K^T / sqrt(d_k)) V with a mask,
  which materialises the whole [T, T] score matrix per head;
- the default fast path, `fast_causal_attention`: torch.nn.functional.scaled_dot_product_attention
  (is_causal=True), a fused kernel that never stores the score matrix and so saves both time and
  memory; on the CPU, for sequences of at most MATMUL_ATTENTION_MAX_LENGTH positions, the same
  formula in two matmuls and torch's softmax, which trains faster there (the fused CPU kernel's
  backward is slow on short sequences: bench/RESULTS.md, "The recipe lab").

With a KVCache (generation), the new positions' keys and values are appended to those of the
positions before them, and the new queries attend to all of them; without one (training), nothing
of this runs. QK-norm and value embeddings act on the new positions' queries, keys and values
before the two part ways, so training and the cache both see them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tinylm.model.kv_cache import KVCache
from tinylm.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding
from tinylm.model_options import NO_OPTIONS, ModelOptions
from tinylm.nn_utils import softmax


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Reference attention: dropout(softmax(q k^T / sqrt(d_k), masked)) v.

    q: [..., T_q, d_k], k: [..., T_k, d_k], v: [..., T_k, d_v]; mask: bool, broadcastable to
    [..., T_q, T_k], True where a query may attend to a key. With dropout_p > 0 each attention
    probability is zeroed with probability dropout_p and the rest scaled by 1 / (1 - dropout_p).
    Returns [..., T_q, d_v].
    """
    d_k = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return probs @ v


# On the CPU, up to this many positions two matmuls and a softmax train faster than the fused
# kernel, whose backward is slow on short sequences (bench/RESULTS.md, "The recipe lab").
MATMUL_ATTENTION_MAX_LENGTH = 128


def fast_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal attention of q, k, v [B, H, T, d_head] by PyTorch's kernels -> [B, H, T, d_head].

    F.scaled_dot_product_attention(is_causal=True), except on the CPU for T <= MATMUL_ATTENTION_MAX_LENGTH:
    scores by a matmul, masked, torch.softmax in float32, cast back, dropout, a matmul with v.
    """
    T = q.shape[-2]
    if q.device.type != "cpu" or T > MATMUL_ATTENTION_MAX_LENGTH:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~causal_mask(T, device=q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return probs @ v


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """[seq_len, seq_len] bool mask, True on and below the diagonal: position i sees positions <= i."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position attends only to itself and earlier positions.

    q, k and v come from one fused projection qkv_proj: d_model -> 3 * d_model (one matmul instead of
    three; its weight is the q, k and v weights stacked in that order). RoPE rotates q and k per head.
    forward: x [B, T, d_model] -> [B, T, d_model].
    `use_fast_attention` picks PyTorch's kernels (default, `fast_causal_attention`) or the reference path.
    With `kv_cache`, x holds positions kv_cache.length .. kv_cache.length + T - 1, and this layer
    (number `layer`) appends their keys and values to the cache.

    What `options` (ModelOptions) say of attention, all off by default (then there are no parameters
    beyond the two projections):
    - qk_norm: q_norm and k_norm, RMSNorms with a learned gain [d_head], normalise each head's
      queries and keys [B, H, T, d_head] before RoPE;
    - dropout: the probability of zeroing an attention probability, in training mode only.
    And value_vocab_size (this layer's part of the option value_embeddings): a value-embedding table
    value_embedding [value_vocab_size, d_model] and a learned scalar value_gate (initialised to 0.5):
    v <- v + value_gate * value_embedding(token_ids), the [B, T, d_model] rows split into heads like
    v [B, H, T, d_head]; forward then needs token_ids [B, T], the ids of the positions of x.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rope: RotaryEmbedding | None = None,
        use_fast_attention: bool = True,
        options: ModelOptions = NO_OPTIONS,
        value_vocab_size: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_head = d_model // num_heads
        self.rope = rope
        self.use_fast_attention = use_fast_attention
        self.dropout = options.dropout
        self.qkv_proj = Linear(d_model, 3 * d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.q_norm = self.k_norm = None
        if options.qk_norm:
            # QK-norm (Henry et al. 2020; as in OLMo 2, Qwen3, nanochat and the nanoGPT speedrun).
            self.q_norm = RMSNorm(self.d_head, device=device, dtype=dtype)
            self.k_norm = RMSNorm(self.d_head, device=device, dtype=dtype)
        self.value_embedding = self.value_gate = None
        if value_vocab_size is not None:
            # Value embeddings (modded-nanogpt speedrun, nanochat; cf. ResFormer, Zhou et al. 2024).
            self.value_embedding = Embedding(value_vocab_size, d_model, device=device, dtype=dtype)
            self.value_gate = nn.Parameter(torch.full((), 0.5, device=device, dtype=dtype))

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: KVCache | None = None,
        layer: int = 0,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, 3, self.num_heads, self.d_head)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # [3, B, num_heads, T, d_head]
        # split / unbind / squeeze rather than indexing: their backward copies gradients into
        # place without first filling a zero tensor the size of qkv.
        qk, v = qkv.split([2, 1])
        v = v.squeeze(0)
        if self.q_norm is not None:
            q, k = qk.unbind(0)
            qk = torch.stack((self.q_norm(q), self.k_norm(k)))
        if self.value_embedding is not None:
            ve = self.value_embedding(token_ids).view(B, T, self.num_heads, self.d_head).transpose(1, 2)
            v = v + self.value_gate * ve
        dropout_p = self.dropout if self.training else 0.0
        if kv_cache is not None:
            out = self._attend_cached(qk, v, kv_cache, layer, dropout_p)
        else:
            if self.rope is not None:
                qk = self.rope(qk)  # q and k rotated in one call, positions 0 .. T-1
            q, k = qk.unbind(0)
            if self.use_fast_attention:
                out = fast_causal_attention(q, k, v, dropout_p)
            else:
                mask = causal_mask(T, device=x.device)
                out = scaled_dot_product_attention(q, k, v, mask=mask, dropout_p=dropout_p)
        out = out.transpose(1, 2).reshape(B, T, self.d_model)  # heads side by side again
        return self.output_proj(out)

    def _attend_cached(
        self, qk: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int, dropout_p: float
    ) -> torch.Tensor:
        """Attention of T new positions (qk [2, B, H, T, d_head], v) to themselves and the cached ones."""
        start, T = kv_cache.length, qk.shape[-2]
        if self.rope is not None:
            qk = self.rope(qk, start=start)  # positions start .. start + T - 1
        q, k = qk.unbind(0)
        k, v = kv_cache.update(layer, k, v)  # positions 0 .. start + T - 1
        # New position p sees every cached position and the new ones up to itself. One new position
        # (the usual decoding step) sees everything: no mask at all.
        mask = None
        if T > 1:
            mask = (
                torch.arange(start + T, device=qk.device)
                <= torch.arange(start, start + T, device=qk.device)[:, None]
            )
        if self.use_fast_attention:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        return scaled_dot_product_attention(q, k, v, mask=mask, dropout_p=dropout_p)
