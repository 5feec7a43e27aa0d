#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py): GPT presets at stages 0-3 on one CUDA GPU, then
# stage 3 with host offload against none and DeepSpeed's CPU offload, within 8 minutes.
# Fails (exit 1) when no GPU is visible. Extra arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 480 python tools/gpu_check.py "$@"
