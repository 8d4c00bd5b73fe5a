source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
C=/root/keep/cache/synthetic; M=$(ls -d $C/llama-2b-w4a8-g128*not-a-model)
for i in 1 2; do
timeout 280 python3 -m anychip.cli bench latency $M --peers --device cuda --reps 1 --budget-s 5 --batch 0 \
  --systems anychip-w4a8,vllm-bf16 --compile-cache shared --json $OUT/start$i.json > /dev/null 2>&1
echo "rc=$? $(date -u +%T)"
python3 -c "
import json; d=json.load(open('$OUT/start$i.json'))
for r in d['rows']: print(r['system'], round(r['engine_start_s'],1), r.get('start_breakdown'))"
done
