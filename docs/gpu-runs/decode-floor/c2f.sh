source .gpu/scripts/stage.sh > /dev/null 2>&1
python3 -c "import vllm, anychip; print('vllm', vllm.__version__)"
export PYTHONUNBUFFERED=1
C=/root/keep/cache/synthetic; M1=$(ls -d $C/llama-1b-w4a8-g128*not-a-model); L1=$(ls -d $C/l1-h2048*not-a-model)
echo "L1=$L1"
for m in "$M1 w4a8-16l" "$M1-dequant-bf16 bf16-16l" "$L1 w4a8-1l" "$L1-dequant-bf16 bf16-1l"; do
  set -- $m
  timeout 110 python3 .gpu/exp/floor.py $1 $2 $OUT/floor-$2.json > $OUT/floor-$2.log 2>&1
  echo "$2 rc=$? $(date -u +%T)"; grep '^{' $OUT/floor-$2.log
done
