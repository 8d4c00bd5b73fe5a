# Prepared in session 48 (no GPU was lent then) for the machine that runs docs/gpu-runs/session47/callE.sh: the
# llama-2b latency bench, anychip against vLLM BF16, to see whether session 47's NaN-propagating amax and rounding
# (GEMV, quantize kernels) cost anything against session 46's run.
source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
mkdir -p /root/keep/cache
python3 -m anychip.cli prepare --synthetic llama-2b --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -1
M=$(ls -d /root/keep/cache/synthetic/llama-2b-w4a8-g128*not-a-model)
timeout 560 python3 -m anychip.cli bench latency $M --peers --device cuda --reps 3 --budget-s 12 --batch 64 \
  --systems anychip-w4a8,vllm-bf16 --compile-cache shared --json $OUT/lat-2b.json 2>&1 | grep -vE "INFO|WARNING|it/s" \
  | tail -40
