source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1 ANYCHIP_GPU_MODEL=$(ls -d /root/keep/cache/synthetic/tiny-*not-a-model | head -1) ANYCHIP_GPU_KEEP=$OUT/keep
echo "model $ANYCHIP_GPU_MODEL"
timeout 420 python3 -m pytest -q -x tests/test_kernels_gpu_vllm.py tests/test_cuda_graphs.py -p no:cacheprovider 2>&1 | tail -15
grep -h "anychip: CUDA graphs\|cudagraph_capture_sizes\|Capturing CUDA graphs" $OUT/keep/stderr-graphs.txt | head -4 | cut -c1-300
