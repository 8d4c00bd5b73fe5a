# the long job: runs from /tmp/code (a copy of the checkout), outlives a call
cd /tmp/code
export PYTHONPATH=/tmp/code:/tmp/anychip-site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
O=/root/keep/out; C=/root/keep/cache/synthetic
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o "H[0-9]*" | head -1 | tr A-Z a-z)
M1=$(ls -d $C/llama-1b-w4a8-g128*not-a-model)
echo "job start $(date -u +%T)"
L=${LEVELS:-32768,16384,4096}; P=4800; [ "$G" = h100 ] && P=3350
python3 -m anychip.cli bench serve --launch $M1-dequant-bf16 --stock --label vllm-bf16 --concurrency 64 \
  --input-len $L --output-len 1024 --num-prompts 64 --peak-tflops 989 --peak-gbps $P --timeout-s 1200 --server-log $O/server-bf16.log \
  --json $O/serve-$G-llama-1b-article.json
echo "bf16 serve done rc=$? $(date -u +%T)"
python3 -m anychip.cli bench serve --launch $M1 --label anychip-w4a8 --baseline vllm-bf16 --append --concurrency 64 \
  --input-len $L --output-len 1024 --num-prompts 64 --peak-tflops 989 --peak-gbps $P --timeout-s 1200 --server-log $O/server-w4a8.log \
  --json $O/serve-$G-llama-1b-article.json
echo "w4a8 serve done rc=$? $(date -u +%T)"
[ -n "$SERVE_ONLY" ] && { echo JOBDONE; exit 0; }
python3 -m anychip.cli bench latency $M1 --peers --device cuda --reps 5 --budget-s 20 --batch 64 --graph-tokens 512 \
  --systems anychip-w4a8,vllm-bf16,vllm-w4a8-stock --json $O/latency-$G-llama-1b-s32.json 2>&1 | grep -v "it/s" | tail -40
echo "latency done rc=$? $(date -u +%T)"
timeout 400 python3 -m anychip.cli bench kernels --device cuda --json $O/kernels_gpu-$G-s32.json 2>&1 | tail -40
echo "kernels done rc=$? $(date -u +%T)"
echo JOBDONE
