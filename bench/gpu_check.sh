#!/usr/bin/env bash
# GPU checks for a session that is lent a device (see README "GPU"). Builds nothing: uses the
# machine's python3 (with torch, transformers, tokenizers, safetensors, pytest) and this tree.
#   1. the engine test suite with device auto = CUDA: parity with transformers (fp32, no TF32),
#      paged KV, batching, sampling on the GPU; the flash-attn parity test runs if flash_attn imports;
#   2. the engine benchmark's decode figures on the GPU (small preset, bf16 and fp32).
# Output goes to stdout and, when $OUT is set, to $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
log="${OUT:-/tmp}/gpu_check.log"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 DISTSERVE_CACHE="${TMPDIR:-/tmp}/distserve-gpu"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine
  timeout 200 python3 bench/engine/engine_gpu.py
} 2>&1 | tee "$log"
