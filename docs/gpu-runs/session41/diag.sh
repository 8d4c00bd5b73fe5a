# Session 41: the Gluon GEMM's losses located (gluon_diag.py), no vLLM needed
# Worst case 220 + 100 + 90 + 150 s of timeouts: inside one device call (600 s); run with timeout_s 600.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
which ncu nsys 2>&1 | head -2
timeout ${DIAG_TIMEOUT:-220} python3 docs/gpu-runs/session41/gluon_diag.py $OUT/gluon_diag.json 2>&1 | grep -v "^\s*$" | tail -30
# the warp-specialized Gluon GEMM, in its own process (a partition hand-over error would hang it)
timeout ${WS_TIMEOUT:-100} python3 docs/gpu-runs/session41/ws_check.py $OUT/ws_check.json 2>&1 | grep -v "^\s*$" | tail -12
# a profile of one launch each (the shipped GEMM, two Gluon variants, cuBLAS), if this host has Nsight Compute
if command -v ncu > /dev/null; then
  timeout ${NCU_TIMEOUT:-90} ncu --launch-count 60 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis --csv \
    python3 docs/gpu-runs/session41/ncu_one.py > $OUT/ncu.csv 2> $OUT/ncu.err; echo "ncu rc=$?"; tail -3 $OUT/ncu.err
fi
# on an H200 only: the tuned table re-timed with the BF16 group scales (session 39 left the H200's fp32-scale one)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  mkdir -p $OUT/h200
  timeout ${TUNE_TIMEOUT:-150} python3 -m anychip.kernels.gpu.tuning 4096,2048,128 2048,2048,128 12288,2048,128 \
    2048,6144,128 3072,2048,128 16384,2048,128 2048,8192,128 6144,2048,128 4096,4096,128 14336,4096,128 \
    960,576,32 576,576,32 3072,576,32 576,1536,32 --retune --out $OUT/h200 --times $OUT/h200/times.json 2>&1 | tail -15
fi
