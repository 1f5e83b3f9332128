#!/usr/bin/env bash
# One device run (at most 8 minutes on an H200) that writes a JSON summary:
#   bash benchmarks/gpu_check.sh            # summary in ${OUT:-benchmarks/results}/gpu_check.json
# Measured step and activation peak of HF GPT-2 medium and a 1B Llama config (bf16, SDPA) at
# 100 / 70 / 50 / 30% budgets, heuristic and default solver, beside plain, per-block and selective
# checkpointing, save_on_cpu and torch.compile; the simulator's figures beside (gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import slackswap" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
    || export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
fi
mkdir -p "${OUT:-benchmarks/results}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS, for the bitwise gradient check
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out "${OUT:-benchmarks/results}/gpu_check.json" "$@"
