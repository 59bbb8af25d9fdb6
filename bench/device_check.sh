#!/usr/bin/env bash
# One-shot check on the lent GPU machine (jax 0.11.x, Python 3.12, no grain there: wheels in .whl/).
# Writes everything under $OUT. Usage (device tool): bash bench/device_check.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
{ nvidia-smi -L; python3 -c "import jax, flax, optax, orbax.checkpoint as o, grain, torch, transformers;
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'grain', grain.__version__,
      'torch', torch.__version__, 'transformers', transformers.__version__); print(jax.devices())"; } \
  2>&1 | tee "$OUT/versions.txt"
# 1. Real step on the GPU vs the inspector's estimate (DSV2-Lite width, 4 layers: 1 dense + 3 MoE).
timeout 200 python3 bench/gpu_step.py --config dsv2lite_farskip --set model.num_layers=4 --batch 2 \
  --seq-len 4096 --steps 5 --out "$OUT/gpu_step.json" 2>&1 | grep -v "^WARNING" | tee "$OUT/gpu_step.txt"
# 2. HF parity with our model running on the GPU (HF reference on torch CPU, fp32).
JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest timeout 120 python3 -m pytest -q -p no:cacheprovider tests/model/test_hf_parity.py \
  tests/model/test_farskip_reference.py -rA 2>&1 | grep -E "PARITY|passed|failed|error" | tee "$OUT/parity_gpu.txt"
# 3. The default suite on this machine's jax (CPU platform, 8 host devices), in parallel workers.
JAX_PLATFORMS=cpu timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -x 2>&1 | tail -25 \
  | tee "$OUT/suite_cpu.txt"
