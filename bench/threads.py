"""Torch threads for evaluation and generation, on an idle machine and with one core busy.

    python bench/threads.py [--repeats 3] [--new-tokens 200]

The default model (random weights: speed does not depend on them), in float32 on the CPU:
- generate: `tinylm.generating.generate` of --new-tokens tokens after a short prompt (KV cache),
  tokens per second;
- evaluate: forward passes of 32 windows of 128 tokens (what `evaluate` runs), windows per second.
Each at 1 and 2 torch threads, with OpenMP's default wait policy (threads spin between parallel
regions) and with OMP_WAIT_POLICY=PASSIVE (they sleep), and each with the machine idle and with one
core held by a busy process (a Python loop). Every case runs in its own process; the median of
--repeats is reported. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

CHILD = r"""
import json, sys, time, torch
from tinylm.generating import generate
from tinylm.model import Transformer
threads, what, new_tokens = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
torch.manual_seed(0)
shape = dict(vocab_size=4096, context_length=128, d_model=128, num_layers=4, num_heads=4, d_ff=344)
model = Transformer(**shape).eval()
prompt = torch.randint(0, 4096, (8,)).tolist()
windows = torch.randint(0, 4096, (32, 128))
def run():
    if what == "generate":
        generate(model, prompt, new_tokens, 128, temperature=0.0)
        return new_tokens
    with torch.no_grad():
        for _ in range(5):
            model(windows)
    return 5 * 32
run()
start = time.perf_counter()
done = run()
print(json.dumps(done / (time.perf_counter() - start)))
"""


def measure(threads: int, what: str, new_tokens: int, passive: bool) -> float:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads), what, str(new_tokens)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=120)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} cores\n")  # fmt: skip
    print("| work | machine | threads | OpenMP wait | rate (median) | x 1 thread, same machine state |")
    print("|---|---|---:|---|---:|---:|")
    for what, unit in (("generate", "tokens/s"), ("evaluate", "windows/s")):
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            time.sleep(0.5 if busy else 0)
            try:
                rates = {}
                for threads, passive in ((1, False), (2, False), (2, True)):
                    runs = [measure(threads, what, args.new_tokens, passive) for _ in range(args.repeats)]
                    rates[threads, passive] = statistics.median(runs)
                    print(
                        f"| {what} | {'one core busy' if busy else 'idle'} | {threads} | "
                        f"{'passive' if passive else 'default'} | {rates[threads, passive]:,.1f} {unit} | "
                        f"{rates[threads, passive] / rates[1, False]:.2f} |",
                        flush=True,
                    )
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()


if __name__ == "__main__":
    main()
