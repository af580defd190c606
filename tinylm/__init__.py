"""tinylm: a readable, reproducible from-scratch LLM pretraining pipeline."""

__version__ = "0.1.0"
