#!/usr/bin/env bash
# The GPU check, one short run on one CUDA GPU. First the engine itself on the GPU
# (packages/zero-core/tests/cuda_engine_body.py: stages 1-3 equal stage 0 bit for bit,
# host offload trains, a checkpoint resumes bit for bit; about a minute at most). Then the
# framework paths on the GPU (packages/zero-core/tests/cuda_integrations_body.py, under a
# minute: zero_comm.from_process_group over an NCCL group the script made, zero_comm.init's
# own NCCL world, a backend-less "cpu:gloo,cuda:nccl" group adopted as nccl, and Lightning's
# ZeroStrategy at stage 3 equal to stage 0 in bf16, skipped with a line without Lightning;
# one PASS/FAIL line each). Then tools/gpu/check.py: GPT-2 XL and small in bf16, our stages 0-3 beside FSDP2, tokens/s and
# MFU and the goal line (stage 3 XL MFU >= 40%), the goal run first; then the other presets
# at stages 0-3, M_D, and stage 3 with host offload against none and DeepSpeed's. No run
# starts after --budget-s (300 s); the timeout stops everything at 8 minutes, and --json is
# rewritten after every run, so what finished is kept. Fails (exit 1) when no GPU is
# visible, a run stops with an error, or the engine or the framework part fails.
# Between the framework part and check.py, ZeRO-Offload on the GPU (tools/gpu/offload_check.py,
# under two minutes: side-stream copies pinned against pageable, step time with and without
# DPU and with pageable memory, the largest GPT with and without offload_optimizer="cpu"),
# its JSON in $OUT/offload-check.json (./ without $OUT); it gets --tiny and --allow-cpu.
# Extra arguments pass through (--tiny --allow-cpu tries tools/gpu/check.py on a CPU in seconds).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: tools run from it as modules
engine=0
PYTHONPATH="packages/zero-core/tests${PYTHONPATH:+:$PYTHONPATH}" \
    timeout 120 python packages/zero-core/tests/cuda_engine_body.py || engine=$?
integrations=0
PYTHONPATH="packages/zero-core/tests${PYTHONPATH:+:$PYTHONPATH}" \
    timeout 90 python packages/zero-core/tests/cuda_integrations_body.py || integrations=$?
offload_args=()
for arg in "$@"; do
    case "$arg" in --tiny|--allow-cpu) offload_args+=("$arg") ;; esac
done
offload=0
timeout 150 python -m tools.gpu.offload_check --json "${OUT:-.}/offload-check.json" \
    ${offload_args[@]+"${offload_args[@]}"} || offload=$?
check=0
timeout 480 python -m tools.gpu.check "$@" || check=$?
if [ "$engine" != 0 ]; then echo "tools/gpu/check.sh: FAILED: the engine on the GPU (exit $engine)" >&2; fi
if [ "$integrations" != 0 ]; then
    echo "tools/gpu/check.sh: FAILED: the framework paths on the GPU (exit $integrations)" >&2
fi
if [ "$offload" != 0 ]; then echo "tools/gpu/check.sh: FAILED: ZeRO-Offload on the GPU (exit $offload)" >&2; fi
exit $((engine || integrations || offload || check))
