source .gpu/scripts/stage.sh > /dev/null 2>&1
python3 -c "import vllm, anychip; print('vllm', vllm.__version__)"
export PYTHONUNBUFFERED=1
C=/root/keep/cache/synthetic; M1=$(ls -d $C/llama-1b-w4a8-g128*not-a-model)
timeout 400 python3 -m anychip.cli bench latency $M1 --floor --peers --device cuda --reps 3 --budget-s 12 --batch 64 \
  --systems anychip-w4a8,anychip-w4a8-floor,vllm-bf16 --compile-cache shared --json $OUT/lat-floor.json > $OUT/lat-floor.log 2>&1
echo "rc=$? $(date -u +%T)"; grep -E "^\| (anychip|vllm)" $OUT/lat-floor.md | cut -d'|' -f2,4-7,9; grep "step floor" $OUT/lat-floor.md
