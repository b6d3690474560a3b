#!/usr/bin/env bash
# One device call: the demo with no flags on one GPU, then the GPU-relevant tests.
# Usage (on the GPU machine, from the repo root): bash tools/gpu_check.sh "$OUT"
set -uo pipefail
out="${1:-/tmp/gpu_check}"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$out/device.txt"
echo "== moe-jax demo (no flags)"
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m moe_jax.cli demo 2>&1 | tee "$out/demo.txt"
echo "demo rc=${PIPESTATUS[0]}" | tee -a "$out/demo.txt"
echo "== pytest on GPU"
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -q -n 4 -p no:cacheprovider \
  tests/test_layer.py tests/test_nvfp4.py tests/test_resolve.py tests/test_router.py tests/test_config.py \
  ${EXTRA_TESTS:-} 2>&1 | tee "$out/pytest.txt" | tail -25
echo "pytest rc=${PIPESTATUS[0]}" | tee -a "$out/pytest.txt"
