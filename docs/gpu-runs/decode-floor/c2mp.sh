source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
C=/root/keep/cache/synthetic; M1=$(ls -d $C/llama-1b-w4a8-g128*not-a-model)
for mp in 0 1; do
  VLLM_ENABLE_V1_MULTIPROCESSING=$mp timeout 120 python3 .gpu/exp/mp.py $M1 w4a8 > $OUT/mp$mp.log 2>&1
  echo "mp=$mp rc=$?"; grep RESULT $OUT/mp$mp.log
done
