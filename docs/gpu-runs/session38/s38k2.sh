source .gpu/scripts/stage.sh > /dev/null 2>&1
python3 -c "import vllm; print('vllm', vllm.__version__)"
export PYTHONUNBUFFERED=1
timeout 500 python3 -m anychip.cli bench kernels --device cuda --json $OUT/kernels_gpu-h100-s38.json > $OUT/kernels.log 2>&1
echo rc=$?; tail -5 $OUT/kernels.log; grep -A22 "Marlin peers" $OUT/kernels_gpu-h100-s38.md | head -26
