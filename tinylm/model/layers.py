"""The building blocks of the Transformer, each a small nn.Module with its own parameters.

Shapes use B for batch, T for sequence length, and `...` for any leading dimensions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T, no bias.

    weight: [d_out, d_in], initialised from a normal distribution with std sqrt(2 / (d_in + d_out)),
    truncated at 3 std. forward: [..., d_in] -> [..., d_out].
    """

    def __init__(self, d_in: int, d_out: int, device=None, dtype=None):
        super().__init__()
        self.d_in = d_in
        self.d_out = d_out
        self.weight = nn.Parameter(torch.empty(d_out, d_in, device=device, dtype=dtype))
        std = math.sqrt(2.0 / (d_in + d_out))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


class Embedding(nn.Module):
    """A lookup table of vectors, one row per token id.

    weight: [num_embeddings, embedding_dim], initialised from a normal distribution with std 1,
    truncated at 3. forward: integer ids [...] -> vectors [..., embedding_dim].
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[token_ids]

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned gain: x / sqrt(mean(x^2) + eps) * weight.

    Computes in at least float32 (bf16 / fp16 inputs are upcast), and returns the input dtype.
    weight: [d_model], initialised to ones. forward: [..., d_model] -> [..., d_model].
    """

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is the formula above (tests/test_model.py: the same bits as `rms_norm_reference`,
        # forward and both gradients, on the CPU), one fused kernel on CUDA where the written-out
        # formula is about seven forward and ten backward, each with float32 temporaries.
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        weight = self.weight.to(wide.dtype)  # a float32 gain is itself; a bf16 one is upcast, as x
        return F.rms_norm(wide, (self.d_model,), weight, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, eps={self.eps}"


class SwiGLU(nn.Module):
    """The gated feed-forward network: w2( silu(w1 x) * w3 x ), with silu(a) = a * sigmoid(a).

    w1, w3: d_model -> d_ff; w2: d_ff -> d_model. forward: [..., d_model] -> [..., d_model].
    """

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.silu is a * sigmoid(a) in one kernel that saves only `a` for backward; the written-out
        # product would keep one more [..., d_ff] tensor alive per layer.
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GEGLU(SwiGLU):
    """SwiGLU with the exact GELU for SiLU (Shazeer 2020, "GLU Variants Improve Transformer"):
    w2( gelu(w1 x) * w3 x ), the same weights and shapes. forward: [..., d_model] -> [..., d_model]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)) * self.w3(x))


# Primer (So et al. 2021, "Searching for Efficient Transformers"); the nanoGPT speedrun and nanochat use it.
class ReLUSquared(nn.Module):
    """The ReLU-squared feed-forward network: w_out( relu(w_in x)^2 ).

    w_in: d_model -> d_hidden; w_out: d_hidden -> d_model. forward: [..., d_model] -> [..., d_model].
    """

    def __init__(self, d_model: int, d_hidden: int, device=None, dtype=None):
        super().__init__()
        self.w_in = Linear(d_model, d_hidden, device=device, dtype=dtype)
        self.w_out = Linear(d_hidden, d_model, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.relu(self.w_in(x)).square())


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), interleaved-pairs formulation (as in the RoFormer paper).

    The feature vector is split into consecutive pairs (a, b) = (x[2i], x[2i+1]), i = 0 .. d_k/2 - 1,
    and the pair at position p is rotated by the angle p * theta^(-2i / d_k):
        (a, b) -> (a cos - b sin, b cos + a sin) = (a, b) * cos + (b, a) * (-sin, sin).
    Rotating both queries and keys makes their dot product depend only on the offset between their
    positions.

    cos and (-sin, sin) are precomputed per pair for positions 0 .. max_seq_len - 1, shape
    [max_seq_len, d_k], as non-persistent buffers (they follow .to(device) but are not saved).
    forward: x [..., T, d_k] and optional token_positions [..., T] (default start .. start + T - 1)
    -> [..., T, d_k].
    """

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device=None):
        super().__init__()
        if d_k % 2 != 0:
            raise ValueError(f"RoPE needs an even head dimension, got d_k={d_k}")
        self.theta = theta
        self.d_k = d_k
        self.max_seq_len = max_seq_len
        inv_freq = theta ** (-torch.arange(0, d_k, 2, dtype=torch.float64, device=device) / d_k)
        positions = torch.arange(max_seq_len, dtype=torch.float64, device=device)
        angles = torch.outer(positions, inv_freq)  # [max_seq_len, d_k / 2], one angle per pair
        cos = torch.stack((angles.cos(), angles.cos()), dim=-1).flatten(-2)  # (cos, cos) per pair
        sin = torch.stack((-angles.sin(), angles.sin()), dim=-1).flatten(-2)  # (-sin, sin) per pair
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)

    def forward(
        self, x: torch.Tensor, token_positions: torch.Tensor | None = None, start: int = 0
    ) -> torch.Tensor:
        seq_len = x.shape[-2]
        if token_positions is None:
            cos, sin = self.cos[start : start + seq_len], self.sin[start : start + seq_len]
        else:
            cos, sin = self.cos[token_positions], self.sin[token_positions]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (a, b) -> (b, a) in every pair
        return x * cos + swapped * sin

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}"
