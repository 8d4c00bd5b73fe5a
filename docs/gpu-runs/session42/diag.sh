# Session 42: the cat/swap A/B of the shipped GEMM first, then the H200 table's re-tune (on an H200 only), then
# session 41's diagnostics (no vLLM); one device call (worst case 170 + 150 + 80 + 120 s of timeouts).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${CAT_TIMEOUT:-170} python3 docs/gpu-runs/session42/cat_ab.py $OUT/cat_ab.json 2>&1 | grep -v "^\s*$" | tail -12
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  mkdir -p $OUT/h200
  timeout ${TUNE_TIMEOUT:-150} python3 -m anychip.kernels.gpu.tuning 4096,2048,128 2048,2048,128 12288,2048,128 \
    2048,6144,128 3072,2048,128 16384,2048,128 2048,8192,128 6144,2048,128 4096,4096,128 14336,4096,128 \
    960,576,32 576,576,32 3072,576,32 576,1536,32 --retune --out $OUT/h200 --times $OUT/h200/times.json 2>&1 | tail -4
fi
timeout ${WS_TIMEOUT:-80} python3 docs/gpu-runs/session41/ws_check.py $OUT/ws_check.json 2>&1 | grep -v "^\s*$" | tail -8
timeout ${DIAG_TIMEOUT:-120} python3 docs/gpu-runs/session41/gluon_diag.py $OUT/gluon_diag.json 2>&1 | grep -v "^\s*$" | tail -8
