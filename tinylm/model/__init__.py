"""The from-scratch Transformer language model and its layers (no distributed code in here)."""

from tinylm.model.attention import CausalSelfAttention, causal_mask, scaled_dot_product_attention
from tinylm.model.kv_cache import KVCache
from tinylm.model.layers import GEGLU, Embedding, Linear, ReLUSquared, RMSNorm, RotaryEmbedding, SwiGLU
from tinylm.model.transformer import Transformer, TransformerBlock, relu2_hidden_width
from tinylm.model_options import MLP_CHOICES, ModelOptions

__all__ = [
    "MLP_CHOICES",
    "GEGLU",
    "CausalSelfAttention",
    "Embedding",
    "KVCache",
    "Linear",
    "ModelOptions",
    "RMSNorm",
    "ReLUSquared",
    "RotaryEmbedding",
    "SwiGLU",
    "Transformer",
    "TransformerBlock",
    "causal_mask",
    "relu2_hidden_width",
    "scaled_dot_product_attention",
]
