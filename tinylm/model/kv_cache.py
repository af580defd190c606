"""The key/value cache of incremental decoding.

When a model generates one token at a time, the keys and values of the positions it has already
seen do not change (attention is causal), so each layer keeps them here and a new position costs
one row of work per layer instead of the whole sequence again:

    cache = model.new_kv_cache(batch_size=1)
    logits = model(prompt_ids, kv_cache=cache)      # prefill: positions 0 .. T-1
    logits = model(next_id[:, None], kv_cache=cache)  # one more position: T

The buffers are allocated once, for `max_len` positions (the model's context_length); `length`
positions are filled. The cache holds no autograd history (fill it under torch.no_grad()).
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of the first `length` positions, per layer.

    keys[i], values[i]: [batch_size, num_heads, max_len, d_head], layer i's rotated keys and its
    values; positions length .. max_len - 1 are not yet written.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_heads: int,
        max_len: int,
        d_head: int,
        device=None,
        dtype=None,
    ):
        shape = (batch_size, num_heads, max_len, d_head)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions' k, v [B, H, T, d_head] after the first `length`; return all so far.

        Returns keys and values of positions 0 .. length + T - 1. `length` itself moves on only
        in `advance`, once every layer has written its T positions.
        """
        end = self.length + k.shape[-2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, num_positions: int) -> None:
        self.length += num_positions
