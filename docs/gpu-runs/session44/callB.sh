# Session 44, call B (carry .gpu/p2 .gpu/scripts .gpu/distinfo .gpu/tok), right after call A on the same machine:
# vLLM complete; the synthetic llama-2b; bench latency anychip W4A8 (call A's re-tuned table from the disk cache)
# against vLLM BF16, one run: pp512, tg128, batch 64.
source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
mkdir -p /root/keep/cache
python3 -m anychip.cli prepare --synthetic llama-2b --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -1
python3 - <<'PY'
from pathlib import Path
from anychip.bench.peers import make_bf16_dequant
print(make_bf16_dequant(next(Path("/root/keep/cache/synthetic").glob("llama-2b-w4a8-g128*not-a-model"))))
PY
M=$(ls -d /root/keep/cache/synthetic/llama-2b-w4a8-g128*not-a-model)
echo "=== bench $(date -u +%T)"
timeout ${LAT_TIMEOUT:-400} python3 -m anychip.cli bench latency $M --peers --device cuda --reps 3 --budget-s 12 \
  --batch 64 --systems anychip-w4a8,vllm-bf16 --compile-cache shared --json $OUT/lat-2b.json > $OUT/lat-2b.log 2>&1
echo "rc=$? $(date -u +%T)"
grep -E "^\| (anychip|vllm)" $OUT/lat-2b.md | cut -d'|' -f2,4-7,9
grep -A12 "^## Targets" $OUT/lat-2b.md | grep "^|"
tail -3 $OUT/lat-2b.log
