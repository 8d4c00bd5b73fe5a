# Session 41: the Gluon GEMM's losses located (gluon_diag.py), no vLLM needed
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
which ncu nsys 2>&1 | head -2
timeout ${DIAG_TIMEOUT:-400} python3 docs/gpu-runs/session41/gluon_diag.py $OUT/gluon_diag.json 2>&1 | grep -v "^\s*$" | tail -30
