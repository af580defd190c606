"""The public import path `tinylm.generating` of the `generate` stage's functions (tinylm/generate.py)."""

from tinylm.generate import generate, generate_reference, stream_generate

__all__ = ["generate", "generate_reference", "stream_generate"]
