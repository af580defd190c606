"""Benchmark: what evaluation costs in memory and time on checkpoints of a 106M-parameter model.

    python bench/inference_memory.py [--folder DIR]

Two published checkpoints of a GPT-2-small-like shape (vocab 32,000, d_model 768, 8 layers,
context 64; 106M parameters, 404 MiB of float32 weights), the newer one with its AdamW moments
(the full format, 3x the weights), as a run publishes them. Then, each in a fresh process:

1. `python -m tinylm evaluate` with an empty cache: peak resident set (VmHWM) and wall time;
2. the same again, every checkpoint cached: peak and wall time (no checkpoint byte is read);
3. for comparison, loading a checkpoint whole, as evaluation did before it read weights only:
   verify every byte, torch.load(weights_only=True) of the full file, build the Transformer
   (random init) and load_state_dict; peak and wall time.

The validation set is 200 random tokens (batch 2), so the figures are the cost of loading, not of
scoring. Figures go to stdout as markdown.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tinylm.model import Transformer
from tinylm.pretrain import state as state_lib
from tinylm.pretrain.publish import publish
from tinylm.tokenizer import Tokenizer

LARGE = dict(
    vocab_size=32000,
    context_length=64,
    d_model=768,
    num_layers=8,
    num_heads=12,
    d_ff=2048,
    rope_theta=10000.0,
)
EOT = "<|endoftext|>"
PEAK = "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0], file=sys.stderr)"


def make_checkpoints(folder: Path) -> float:
    """Publish steps 1 and 2 of a LARGE model into folder/ckpt; returns the weights' MiB."""
    torch.manual_seed(0)
    model = Transformer(**LARGE)
    for step in (1, 2):
        moments = {
            i: {
                "step": torch.tensor(float(step)),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
            for i, p in enumerate(model.parameters())
        }
        payload = {
            "model": model.state_dict(),
            "optimizer": {"state": moments, "param_groups": [{"lr": 1e-3, "params": list(moments)}]},
            "iteration": step,
            "model_config": LARGE,
        }
        state_lib.commit(
            folder / "state", step, payload, {"world_size": 1, "tokens_seen": step * 64}, keep=10
        )
    publish(folder / "state", folder / "ckpt")
    vocab = {i: bytes([i]) for i in range(256)}
    vocab[256] = EOT.encode()
    merges = [(bytes([a]), bytes([b])) for a in range(256) for b in range(256)][: 32000 - 257]
    for a, b in merges:
        vocab[len(vocab)] = a + b
    Tokenizer(vocab, merges, [EOT]).save(folder / "tokenizer.json")
    np.save(folder / "valid.npy", np.random.default_rng(0).integers(0, 32000, 200).astype(np.uint16))
    (folder / "config.yaml").write_text("evaluate:\n  batch_size: 2\n  threads: 1\n")
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def measure(code: str) -> tuple[float, float]:
    """(peak RSS MiB, seconds) of `python -c code` in a fresh process."""
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", f"import sys\ntry:\n{code}\nfinally:\n    {PEAK}"],
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return int(done.stderr.rsplit("VmHWM:", 1)[1].split()[0]) / 1024, seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--folder", type=Path, default=None, help="where to write the checkpoints (a temp dir)"
    )
    args = parser.parse_args()
    folder = args.folder or Path(tempfile.mkdtemp(prefix="tinylm-inference-"))
    try:
        weights_mib = make_checkpoints(folder)
        argv = [
            "tinylm",
            "evaluate",
            "--config",
            str(folder / "config.yaml"),
            "--tokenizer",
            str(folder / "tokenizer.json"),
            "--checkpoint-dir",
            str(folder / "ckpt"),
            "--valid-tokens",
            str(folder / "valid.npy"),
            "--output",
            str(folder / "eval.csv"),
            "--plot",
            str(folder / "eval.png"),
            "--cache-dir",
            str(folder / "cache"),
        ]
        cli = f"    import runpy; sys.argv = {argv!r}; runpy.run_module('tinylm', run_name='__main__')"
        whole = (
            "    import torch; from tinylm import state; from tinylm.model import Transformer\n"
            f"    payload = torch.load({str(folder / 'ckpt' / 'step_2.pt')!r})\n"
            "    model = Transformer(**payload['model_config']); model.load_state_dict(payload['model'])"
        )
        rows = [
            ("evaluate, 2 checkpoints, empty cache", *measure(cli)),
            ("evaluate again, both cached", *measure(cli)),
            ("load one full checkpoint whole (the way before)", *measure(whole)),
        ]
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(
        f"Checkpoints of a {LARGE} model: {weights_mib:,.0f} MiB of float32 weights; the newest holds its "
        f"AdamW moments too. torch {torch.__version__}; each row a fresh process.\n"
    )
    print("| run | peak RSS (MiB) | peak - weights (MiB) | wall time (s) |")
    print("|---|---:|---:|---:|")
    for name, peak, seconds in rows:
        print(f"| {name} | {peak:,.0f} | {peak - weights_mib:,.0f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
