source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
C=/root/keep/cache/synthetic; M2=$(ls -d $C/llama-2b-w4a8-g128*not-a-model)
for m in "$M2 w4a8-2b" "$M2-dequant-bf16 bf16-2b"; do
  set -- $m
  timeout 120 python3 .gpu/exp/floor.py $1 $2 $OUT/floor-$2.json > $OUT/floor-$2.log 2>&1
  echo "$2 rc=$? $(date -u +%T)"; grep '^{' $OUT/floor-$2.log
done
echo "=== lat 2b $(date -u +%T)"
timeout 300 python3 -m anychip.cli bench latency $M2 --peers --device cuda --reps 3 --budget-s 12 --batch 64 \
  --systems anychip-w4a8,vllm-bf16 --compile-cache shared --json $OUT/lat-2b.json > $OUT/lat-2b.log 2>&1
echo "rc=$? $(date -u +%T)"; grep -E "^\| (anychip|vllm)" $OUT/lat-2b.md | cut -d'|' -f2,4-7,9
