#!/usr/bin/env bash
# The one prepared GPU session: every GPU figure of bench/RESULTS.md "The GPU step" in one call.
#
#     bash bench/gpu_session.sh            # on a CUDA machine, from the repository root
#     bash bench/gpu_session.sh --smoke    # the same steps at a tiny shape, on the CPU (CI runs it)
#
# In order, each part under its own time limit, every figure written as soon as it is measured, so
# that a session cut short still reports what it measured:
#   1. the CUDA-only tests (tests/test_cuda.py: the fused paths against ours on the device, the
#      memory plan against max_memory_allocated), first, each test under its own limit;
#   2. the eager variants of bench/gpu.py: the torch-native baseline, tinylm, and one row per fast
#      path turned off, deterministic kernels and activation checkpointing; per-region times,
#      kernels per step, peak memory beside the plan;
#   3. the compiled variants: the baseline compiled whole, tinylm as train.compile compiles it on one
#      GPU (whole) and under DDP (per block), the flash and cuDNN attention backends; graph breaks
#      and recompiles;
#   4. with 2 or more GPUs, bench/gpu_ddp.py (NCCL): DDP and ZeRO-1 against torch's;
#   5. one summary table of parts 2 and 3 (tokens/s, ratio to the baseline of the same compile, MFU,
#      time per region, peak memory against the plan), to paste into bench/RESULTS.md.
# A variant that dies or passes its limit is one row saying why; the next one runs.
#
# Time on one H100: at most 8 minutes by the limits below (170 + 100 + 210 s, plus start-up), so a
# 9-minute slot keeps a margin. The limits are sized from the H200 session of 2026-12-05 (two tests
# took 75 s; a cold compile of the GPT-2-small step about 40 s; an eager variant under 10 s), not
# measured on an H100. torch.profiler's top 40 kernels of each variant go to
# $OUT/<phase>/profile_<variant>.txt; logs and tables to $OUT (default bench/out).
set -o pipefail
smoke=()
if [ "${1:-}" = "--smoke" ]; then
    smoke=(--smoke)
fi
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# Shared by the variants: one cold compile per graph.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/tinylm_inductor_cache}

if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/device.txt"
else
    echo "no nvidia-smi: the CPU" | tee "$out/device.txt"
fi
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"

# 1. The CUDA tests (they skip without CUDA).
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 0 --timeout 80 tests/test_cuda.py 2>&1 \
    | tee "$out/test_cuda.log"
echo "test_cuda exit status: $?" | tee -a "$out/test_cuda.log"

# 2. The eager variants.
if [ ${#smoke[@]} -gt 0 ]; then
    eager=(native tinylm)
else
    eager=(native tinylm "tinylm, no fast paths" "tinylm, unfused loss" "tinylm, unfused AdamW"
           "tinylm, per-tensor clip" "tinylm, RMSNorm formula" "tinylm, deterministic"
           "tinylm, full checkpointing" "tinylm, selective checkpointing")
fi
timeout 100 python3 bench/gpu.py "${smoke[@]}" --steps 10 --warmup 3 --variant-timeout 30 \
    --out-dir "$out/eager" --variants "${eager[@]}" > "$out/gpu_eager.md" 2> "$out/gpu_eager.log"
echo "bench/gpu.py (eager) exit status: $?" | tee -a "$out/gpu_eager.log"
cat "$out/gpu_eager.md"

# 3. The compiled variants.
if [ ${#smoke[@]} -gt 0 ]; then
    compiled=(tinylm+compile)
else
    compiled=(native+compile tinylm+compile "tinylm+compile, per block"
              "tinylm+compile, flash attention" "tinylm+compile, cuDNN attention")
fi
timeout 210 python3 bench/gpu.py "${smoke[@]}" --steps 10 --warmup 3 --variant-timeout 90 \
    --out-dir "$out/compiled" --variants "${compiled[@]}" > "$out/gpu_compiled.md" 2> "$out/gpu_compiled.log"
echo "bench/gpu.py (compiled) exit status: $?" | tee -a "$out/gpu_compiled.log"
cat "$out/gpu_compiled.md"

# 4. DDP and ZeRO-1 against torch's, with 2 or more GPUs.
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    timeout 100 python3 bench/gpu_ddp.py --out "$out/gpu_ddp.json" > "$out/gpu_ddp.md" 2> "$out/gpu_ddp.log"
    echo "bench/gpu_ddp.py exit status: $?" | tee -a "$out/gpu_ddp.log"
    cat "$out/gpu_ddp.md"
fi

# 5. One table of everything measured.
python3 bench/gpu.py --summary "$out/eager" "$out/compiled" > "$out/gpu_summary.md"
echo
echo "Summary ($(head -n 1 "$out/device.txt")):"
cat "$out/gpu_summary.md"
