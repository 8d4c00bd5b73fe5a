# Session 46, call C (same warm machine as B, or a fresh one after p1+p2): batch 64 split and profiled.
source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
mkdir -p /root/keep/cache
[ -d /root/keep/cache/synthetic ] || python3 -m anychip.cli prepare --synthetic llama-2b --tokenizer .gpu/tok \
  --cache /root/keep/cache 2>&1 | tail -1
M=$(ls -d /root/keep/cache/synthetic/llama-2b-w4a8-g128*not-a-model)
[ -d "$M-dequant-bf16" ] || python3 -c "from pathlib import Path; from anychip.bench.peers import make_bf16_dequant; make_bf16_dequant(Path('$M'))"
timeout 200 python3 docs/gpu-runs/session46/b64split.py $M anychip-w4a8 $OUT/split-anychip.json 2>&1 \
  | grep -vE "INFO|WARNING|it/s" | tail -70
timeout 170 python3 docs/gpu-runs/session46/b64split.py $M-dequant-bf16 vllm-bf16 $OUT/split-bf16.json 2>&1 \
  | grep -vE "INFO|WARNING|it/s" | tail -70
python3 -m anychip.cli prepare --synthetic tiny --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -1
T=$(ls -d /root/keep/cache/synthetic/tiny-w4a8* | grep -v dequant | head -1)
timeout 60 python3 docs/gpu-runs/session46/nan_gpu.py $T /root/keep 2>&1 | grep -E "poisoned|NAN CHECK|holds NaN" | head -5
