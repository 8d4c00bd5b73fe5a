# the long job: runs from /tmp/code (a copy of the checkout), outlives a call
cd /tmp/code
export PYTHONPATH=/tmp/code:/tmp/anychip-site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
O=/root/keep/out; C=/root/keep/cache/synthetic
M1=$(ls -d $C/llama-1b-w4a8-g128*not-a-model)
echo "job start $(date -u +%T)"
python3 -m anychip.cli bench serve --launch $M1-dequant-bf16 --stock --label vllm-bf16 --concurrency 64 \
  --input-len 32768 --output-len 1024 --num-prompts 64 --peak-tflops 989 --peak-gbps 4800 --timeout-s 1200 --server-log $O/server-bf16.log \
  --json $O/serve-h200-llama-1b-article.json
echo "bf16 serve done rc=$? $(date -u +%T)"
python3 -m anychip.cli bench serve --launch $M1 --label anychip-w4a8 --baseline vllm-bf16 --append --concurrency 64 \
  --input-len 32768 --output-len 1024 --num-prompts 64 --peak-tflops 989 --peak-gbps 4800 --timeout-s 1200 --server-log $O/server-w4a8.log \
  --json $O/serve-h200-llama-1b-article.json
echo "w4a8 serve done rc=$? $(date -u +%T)"
echo JOBDONE
