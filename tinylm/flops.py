"""The model FLOPs of one training token: what MFU (tinylm/throughput.py) and a ladder's compute
budgets (tinylm/config/ladder.py) count. Plain arithmetic on the model's sizes; imports no torch.

The model FLOPs of one token, forward and backward, are

    6 * (weights of the matmuls)  +  12 * num_layers * d_model * context_length

The first term is 2 FLOPs per weight per token forward and 4 backward (every weight but the embedding
table, which is a lookup, and the RMSNorm gains, which are not matmuls); the second is the attention
scores q k^T and their product with v (4 * T * d_model per token and layer forward, 3x that with
backward), counted in full as is usual, although a causal kernel skips about half of it. Recomputation
and optimizer work are not model FLOPs.
"""

from __future__ import annotations

from tinylm.model_options import padded_vocab_size


def matmul_weights(model_config: dict) -> int:
    """Weights of the matmuls (N in C = 6 N D): each block's attention projections (4 d^2) and SwiGLU
    MLP (3 d d_ff), and the output head (d vocab, its padding rows included: they are multiplied).
    `model_config` needs d_model, num_layers, d_ff and vocab_size (pad_vocab_to_multiple: 1 if absent)."""
    d, L = model_config["d_model"], model_config["num_layers"]
    head_rows = padded_vocab_size(model_config["vocab_size"], model_config.get("pad_vocab_to_multiple", 1))
    return L * (4 * d * d + 3 * d * model_config["d_ff"]) + d * head_rows


def flops_per_token(model_config: dict) -> float:
    """Model FLOPs of one training token (forward + backward) at the full context; see the module doc.
    `model_config` needs what `matmul_weights` needs and context_length."""
    d, L, T = model_config["d_model"], model_config["num_layers"], model_config["context_length"]
    return 6.0 * matmul_weights(model_config) + 12.0 * L * d * T
