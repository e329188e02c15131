#!/usr/bin/env bash
# GPU checks for a session that is lent a device (see README "GPU"). Builds nothing: uses the
# machine's python3 (with torch, transformers, tokenizers, safetensors, pytest) and this tree.
#   1. the engine test suite with device auto = CUDA: parity with transformers (fp32, no TF32) for
#      every model family (tests/engine/test_families.py), paged KV, batching, sampling, tensor
#      parallelism, on the GPU; with flash_attn importable, every family in bf16 with flash-attn
#      (varlen prefill, paged decode, prefill over a cached prefix) against the torch backend;
#   2. every family through a 1P1D mesh, prefill and decode two CUDA processes handing KV over
#      UCX (needs ucxx in this python: the step says so and goes on if it is missing);
#   3. the engine benchmark's decode figures on the GPU (small preset, bf16 and fp32).
# Budget: about 8 minutes on one H100 (each step has its own timeout).
# Output goes to stdout and, when $OUT is set, to $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
log="${OUT:-/tmp}/gpu_check.log"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 DISTSERVE_CACHE="${TMPDIR:-/tmp}/distserve-gpu"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine
  python3 -c "import ucxx" 2>/dev/null \
    && timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_families_mesh.py \
    || echo "gpu_check: step 2 skipped or failed: ucxx missing or the mesh test failed (above)"
  timeout 120 python3 bench/engine/engine_gpu.py
} 2>&1 | tee "$log"
