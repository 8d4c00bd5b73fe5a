source .gpu/scripts/stage.sh
python3 -c "import vllm, anychip; print('vllm', vllm.__version__)"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
bash .gpu/exp/lat.sh g512 --graph-tokens 512
