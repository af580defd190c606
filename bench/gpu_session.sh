#!/usr/bin/env bash
# The one prepared GPU session (device time is short): the CUDA-only tests, then bench/gpu.py.
# Run from the repository root on a CUDA machine; logs and raw figures go to $OUT (the device
# tool's folder) or bench/out/.
set -o pipefail
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/device.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
python3 bench/gpu.py --out "$out/gpu.json" 2>&1 | tee "$out/gpu.md"
