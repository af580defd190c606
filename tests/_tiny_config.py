"""A tiny config for the tests that train on the `tiny_data` fixture (see conftest.py)."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def write_tiny_config(path: Path, **sections: dict) -> Path:
    """The shipped config shrunk for `tiny_data` (vocab 300, context 16, 12 steps); `sections`
    override keys."""
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["tokenizer"]["vocab_size"] = 300
    cfg["model"].update(context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    cfg["train"].update(
        batch_size=8,
        max_iters=12,
        warmup_iters=2,
        lr_max=1e-2,
        lr_min=1e-3,
        log_interval=1,
        val_interval=6,
        val_batches=2,
        checkpoint_interval=4,
        timeout_s=30.0,
        weight_decay=0.1,
        dtype="float32",
    )  # the tests compare float32 runs to 1e-4 and float64 ones to 1e-10
    cfg["generate"].update(max_new_tokens=5)
    for section, values in sections.items():
        cfg[section].update(values)
    path.write_text(yaml.safe_dump(cfg))
    return path
