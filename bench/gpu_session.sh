#!/usr/bin/env bash
# The one prepared GPU session: every GPU figure of bench/RESULTS.md "The GPU step" in one call of
# at most about 8 minutes on one H100-class GPU. In order, each part under its own time limit and
# every figure written as soon as it is measured, so that a session cut short still reports what it
# measured:
#   1. the eager variants of bench/gpu.py: the torch-native baseline, tinylm, and one row per
#      fast path turned off (loss, AdamW, clip, RMSNorm), deterministic kernels and activation
#      checkpointing; per-region times, kernels per step, peak memory beside the plan;
#   2. the CUDA-only tests (tests/test_cuda.py: the fused paths against ours on the device, the
#      memory plan against max_memory_allocated);
#   3. the compiled variants: the baseline compiled whole, tinylm as train.compile compiles it, the
#      loss region eager, each attention backend, deterministic; graph breaks and recompiles;
#   4. with 2 or more GPUs, bench/gpu_ddp.py (NCCL): DDP and ZeRO-1 against torch's at every
#      world size the machine has.
# torch.profiler's top 40 kernels of each variant go to $OUT/profile_<variant>.txt.
# Run from the repository root on a CUDA machine. Logs and raw figures go to $OUT (the device tool's
# folder) or bench/out/; the tables, as markdown, to gpu_*.md there.
set -o pipefail
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/tinylm_inductor_cache  # shared by the variants: one cold compile per graph
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"

timeout 150 python3 bench/gpu.py --eager --steps 10 --warmup 3 --out-dir "$out/eager" \
    > "$out/gpu_eager.md" 2> "$out/gpu_eager.log"
echo "bench/gpu.py --eager exit status: $?" | tee -a "$out/gpu_eager.log"
cat "$out/gpu_eager.md"

timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
echo "test_cuda exit status: $?" | tee -a "$out/test_cuda.log"

timeout 200 python3 bench/gpu.py --steps 10 --warmup 3 --out-dir "$out/compiled" \
    --variants native+compile tinylm+compile "tinylm+compile, loss region eager" \
    "tinylm+compile, flash attention" "tinylm+compile, cuDNN attention" \
    "tinylm+compile, efficient attention" "tinylm+compile, deterministic" \
    > "$out/gpu_compiled.md" 2> "$out/gpu_compiled.log"
echo "bench/gpu.py (compiled) exit status: $?" | tee -a "$out/gpu_compiled.log"
cat "$out/gpu_compiled.md"

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    timeout 120 python3 bench/gpu_ddp.py --out "$out/gpu_ddp.json" > "$out/gpu_ddp.md" 2> "$out/gpu_ddp.log"
    echo "bench/gpu_ddp.py exit status: $?" | tee -a "$out/gpu_ddp.log"
    cat "$out/gpu_ddp.md"
fi
