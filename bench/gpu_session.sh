#!/usr/bin/env bash
# The one prepared GPU session (device time is short): the CUDA-only tests, then bench/gpu.py, each
# under its own time limit (cold Inductor caches included: the first compilation of each graph takes
# a minute or more), so that the whole session ends within 10 minutes on one H100-class GPU. Every
# figure is written as soon as it is measured, so a session cut short still reports what it measured.
# Run from the repository root on a CUDA machine. Logs and raw figures go to $OUT (the device tool's
# folder) or bench/out/; the figures alone, as markdown, to gpu.md.
set -o pipefail
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/device.txt"
timeout 270 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
echo "test_cuda exit status: $?" | tee -a "$out/test_cuda.log"
export TORCHINDUCTOR_CACHE_DIR=/tmp/tinylm_inductor_cache  # shared by the variants: one cold compile per graph
timeout 330 python3 bench/gpu.py --steps 20 --warmup 5 --out "$out/gpu.json" > "$out/gpu.md" 2> "$out/gpu.log"
echo "bench/gpu.py exit status: $?" | tee -a "$out/gpu.log"
cat "$out/gpu.md"
