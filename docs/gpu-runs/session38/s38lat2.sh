# one bench latency call at llama-2b, appending to /root/keep/out/lat-2b-again.json; $1: the systems
source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
C=/root/keep/cache/synthetic; M=$(ls -d $C/llama-2b-w4a8-g128*not-a-model)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "=== $1 $(date -u +%T)"
timeout ${LAT_TIMEOUT:-560} python3 -m anychip.cli bench latency $M --peers --device cuda --reps 3 --budget-s 12 \
  --batch 64 --systems $1 --compile-cache shared --append --json /root/keep/out/lat-2b-again.json > $OUT/lat-$1.log 2>&1
echo "rc=$? $(date -u +%T)"
cp /root/keep/out/lat-2b-again.* $OUT/ 2>/dev/null
grep -E "^\| (anychip|vllm)" /root/keep/out/lat-2b-again.md | cut -d'|' -f2,4-7,9,10
grep -A14 "^## Targets" /root/keep/out/lat-2b-again.md | grep "^|"
tail -3 $OUT/lat-$1.log
