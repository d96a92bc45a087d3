#!/usr/bin/env bash
# labkit GPU check on ONE NVIDIA GPU, in one call (benchmarks/gpu_check.py's docstring): plan_model
# against torch.cuda.max_memory_allocated (bert-120m, bert-350m, BertForMaskedLM SDPA, two
# micro-batches each); flops_per_token against FlopCounterMode; ZeRO-1 (fused AdamW) and fsdp
# (with evaluation) save/resume/step; bf16 step time, tokens/s, MFU and the largest micro-batch for
# bert-120m and bert-350m at seq 128 and 512; a 1-GPU NCCL init + all_reduce smoke test.
# Usage: benchmarks/gpu_check.sh [OUT_JSON] [extra gpu_check.py args]
#   OUT_JSON defaults to $OUT/gpu_check.json (or ./gpu_check.json). PYTHON picks the interpreter.
# Finishes in under 8 minutes: the python part skips configurations started after 400 s and is
# killed at 470 s.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}/gpu_check.json}"
[ "$#" -gt 0 ] && shift
py="${PYTHON:-python3}"
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: nvidia-smi not found; this script needs an NVIDIA GPU" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
exec timeout 470 "$py" benchmarks/gpu_check.py --out "$out" --budget-s 400 "$@"
