# one device call, no vLLM: the M = 16 decode-tile sweep into $OUT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1
timeout ${SWEEP_TIMEOUT:-300} python3 docs/gpu-runs/decode-sweep/sweep.py $OUT/sweep.json ${SWEEP_BUDGET:-200} 2>&1 \
  | grep -v Warning
