source .gpu/scripts/stage.sh >/dev/null 2>&1
export PYTHONUNBUFFERED=1
C=/root/keep/cache/synthetic; M1=$(ls -d $C/llama-1b-w4a8-g128*not-a-model)
nvidia-smi --query-gpu=name --format=csv,noheader
for m in "$M1 w4a8 default" "$M1 w4a8 sparse" "$M1-dequant-bf16 bf16 default" ${EXTRA:+"$M1-dequant-bf16 bf16 sparse"}; do
  set -- $m
  [ $3 = sparse ] && export CAPTURE=sparse || unset CAPTURE
  echo "=== $2 $3 $(date -u +%T)"
  timeout 170 python3 .gpu/exp/ttft.py $1 $2 $OUT/ttft-$2-$3.json > $OUT/ttft-$2-$3.log 2>&1
  echo "rc=$?"; grep -E '^\{|Error|error' $OUT/ttft-$2-$3.log | head -12
done
