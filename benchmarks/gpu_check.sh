#!/usr/bin/env bash
# One short GPU run (under 5 minutes) that writes a JSON summary:
#   bash benchmarks/gpu_check.sh            # summary in ${OUT:-benchmarks/results}/gpu_check.json
# Real peak memory (torch.cuda.max_memory_allocated) and step time of a GPT-2-medium-size model at
# 100 / 70 / 50 % budgets for the heuristic and the exact plan, beside torch.utils.checkpoint and
# offload-everything (save_on_cpu), with the simulator's prediction from a profile taken there.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import slackswap" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
    || export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
fi
mkdir -p "${OUT:-benchmarks/results}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS, for the bitwise gradient check
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out "${OUT:-benchmarks/results}/gpu_check.json" "$@"
