# Session 40, call 1 (no vLLM): the Gluon GEMM A/B, then (on an H200 only) the table re-tune with BF16 scales.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -q -x tests/test_kernels_gpu_gluon.py -p no:cacheprovider 2>&1 | tail -15
timeout ${AB_TIMEOUT:-400} python3 docs/gpu-runs/session40/gluon_ab.py $OUT/gluon_ab.json 2>&1 | grep -v "^\s*$" | tail -60
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  mkdir -p $OUT/h200
  timeout ${TUNE_TIMEOUT:-170} python3 -m anychip.kernels.gpu.tuning 4096,2048,128 2048,2048,128 12288,2048,128 \
    2048,6144,128 3072,2048,128 16384,2048,128 2048,8192,128 6144,2048,128 4096,4096,128 14336,4096,128 \
    960,576,32 576,576,32 3072,576,32 576,1536,32 --retune --wgmma --out $OUT/h200 --times $OUT/h200/times.json 2>&1 | tail -15
fi
