# one bench latency call at llama-2b, appending to /root/keep/out/$2.json (default lat-2b); $1: the systems
# (runs 163-165: `s38lat.sh anychip-w4a8,vllm-bf16,vllm-w4a8-stock`,
# then `s38lat.sh vllm-w4a16-machete,vllm-w4a16-marlin`;
# run 166: `s38lat.sh vllm-bf16,anychip-w4a8 lat-2b-again`)
source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
J=/root/keep/out/${2:-lat-2b}
C=/root/keep/cache/synthetic; M=$(ls -d $C/llama-2b-w4a8-g128*not-a-model)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "=== $1 $(date -u +%T)"
timeout ${LAT_TIMEOUT:-560} python3 -m anychip.cli bench latency $M --peers --device cuda --reps 3 --budget-s 12 \
  --batch 64 --systems $1 --compile-cache shared --append --json $J.json > $OUT/lat-${2:-lat-2b}.log 2>&1
echo "rc=$? $(date -u +%T)"
cp $J.* $OUT/ 2>/dev/null
grep -E "^\| (anychip|vllm)" $J.md | cut -d'|' -f2,4-7,9,10
grep -A14 "^## Targets" $J.md | grep "^|"
tail -3 $OUT/lat-${2:-lat-2b}.log
