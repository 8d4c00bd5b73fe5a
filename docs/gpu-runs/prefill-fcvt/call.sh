# one device call, no vLLM: the FCVT A/B, then (TUNE=1) the tuner, whose prefill candidates include fcvt configs,
# for the llama-1b shapes into $OUT
set -x
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1
timeout ${AB_TIMEOUT:-170} python3 docs/gpu-runs/prefill-fcvt/ab.py $OUT/ab.json ${AB_BUDGET:-130} 2>&1 | grep -v Warning
if [ "${TUNE:-0}" = 1 ]; then
  timeout 80 python3 -m anychip.kernels.gpu.tuning 3072,2048,128 2048,2048,128 16384,2048,128 2048,8192,128 \
    --out $OUT/tuned --times $OUT/tune_times.json --retune 2>&1 | tail -20
  # the table becomes this machine's disk cache, so a W4A8 engine started after this call tunes nothing at load
  mkdir -p ~/.cache/anychip/gpu_tuning && cp $OUT/tuned/*.json ~/.cache/anychip/gpu_tuning/
fi
ls -laR $OUT
