#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py), one short run on one CUDA GPU: first GPT-2 XL and small
# in bf16, our stages 0-3 beside FSDP2, tokens/s and MFU and the goal line (stage 3 XL MFU >=
# 40%), the goal run first; then the other presets at stages 0-3, M_D, and stage 3 with host
# offload against none and DeepSpeed's. No run starts after --budget-s (300 s); the timeout
# stops everything at 8 minutes, and --json is rewritten after every run, so what finished
# is kept. Fails (exit 1) when no GPU is visible or a run stops with an error.
# Extra arguments pass through (--tiny --allow-cpu tries the script on a CPU in seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 480 python tools/gpu_check.py "$@"
