# Session 40, the last device time: the Gluon GEMM's GPU test (bit for bit against the Triton GEMM), then a
# short A/B (two shapes, M = 512 and 4096).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${TEST_TIMEOUT:-110} python3 -m pytest -q -x tests/test_kernels_gpu_gluon.py -p no:cacheprovider 2>&1 | tail -8
AB_QUICK=1 timeout ${AB_TIMEOUT:-80} python3 docs/gpu-runs/session40/gluon_ab.py $OUT/gluon_ab.json 2>&1 | grep -v "^\s*$" | tail -8
