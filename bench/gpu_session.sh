#!/usr/bin/env bash
# The one prepared GPU session (device time is short, about 8 minutes on one H100-class GPU): first
# the eager training-step variants of bench/gpu.py (the baseline, tinylm, and tinylm with full and
# selective activation checkpointing, each with the memory plan beside its measured peak), then the
# CUDA-only tests, then the compiled variants (cold Inductor caches: the first compilation of each
# graph takes a minute or more). Each part runs under its own time limit, and every figure is written
# as soon as it is measured, so a session cut short still reports what it measured.
# Run from the repository root on a CUDA machine. Logs and raw figures go to $OUT (the device tool's
# folder) or bench/out/; the figures alone, as markdown, to gpu*.md.
set -o pipefail
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/tinylm_inductor_cache  # shared by the variants: one cold compile per graph
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/device.txt"
timeout 150 python3 bench/gpu.py --steps 10 --warmup 3 --out "$out/gpu_eager.json" \
    --variants native tinylm "tinylm, full checkpointing" "tinylm, selective checkpointing" \
    > "$out/gpu_eager.md" 2> "$out/gpu_eager.log"
echo "bench/gpu.py (eager) exit status: $?" | tee -a "$out/gpu_eager.log"
cat "$out/gpu_eager.md"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
echo "test_cuda exit status: $?" | tee -a "$out/test_cuda.log"
timeout 150 python3 bench/gpu.py --steps 10 --warmup 3 --out "$out/gpu_compiled.json" \
    --variants native+compile tinylm+compile "tinylm+compile, full checkpointing" \
    > "$out/gpu_compiled.md" 2> "$out/gpu_compiled.log"
echo "bench/gpu.py (compiled) exit status: $?" | tee -a "$out/gpu_compiled.log"
cat "$out/gpu_compiled.md"
