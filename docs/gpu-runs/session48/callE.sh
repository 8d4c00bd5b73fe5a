# Session 48, call E (after p1, with p2 and .gpu/tok carried; prepared in session 47): the GPU test files with
# a tiny model made here (run 189's fixture error), the compiled NaN case and the tuning-cache changes included.
source .gpu/scripts/stage.sh > /dev/null 2>&1
mkdir -p /root/keep/cache
python3 -m anychip.cli prepare --synthetic tiny --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -1
export PYTHONUNBUFFERED=1 ANYCHIP_GPU_MODEL=$(ls -d /root/keep/cache/synthetic/tiny-*not-a-model | head -1)
export ANYCHIP_GPU_KEEP=$OUT/keep ANYCHIP_GPU_TUNING_DIR=/root/keep/tuning
timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_cuda_graphs.py \
  tests/test_kernels_gpu_vllm.py 2>&1 | grep -vE "Warning|warn" | tail -15
