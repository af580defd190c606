"""The from-scratch Transformer language model and its layers (no distributed code in here)."""

from tinylm.model.attention import CausalSelfAttention, causal_mask, scaled_dot_product_attention
from tinylm.model.kv_cache import KVCache
from tinylm.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, SwiGLU
from tinylm.model.transformer import Transformer, TransformerBlock

__all__ = [
    "CausalSelfAttention",
    "Embedding",
    "KVCache",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "Transformer",
    "TransformerBlock",
    "causal_mask",
    "scaled_dot_product_attention",
]
