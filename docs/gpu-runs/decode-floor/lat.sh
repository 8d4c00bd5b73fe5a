# one bench latency run at llama-1b: anychip W4A8 and vLLM BF16; $1 tag, rest extra flags
tag=$1; shift
C=/root/keep/cache/synthetic; M1=$(ls -d $C/llama-1b-w4a8-g128*not-a-model)
echo "=== $tag $(date -u +%T) $*"
timeout ${LAT_TIMEOUT:-270} python3 -m anychip.cli bench latency $M1 --peers --device cuda --reps ${REPS:-3} \
  --budget-s 12 --batch 64 --systems ${SYSTEMS:-anychip-w4a8,vllm-bf16} --compile-cache shared \
  --json $OUT/lat-$tag.json "$@" > $OUT/lat-$tag.log 2>&1
echo "$tag rc=$? $(date -u +%T)"
grep -E "^\| (anychip|vllm)" $OUT/lat-$tag.md | cut -d'|' -f2,4-7,9
grep -iE "graph|capture" $OUT/lat-$tag.md | head -3 | cut -c1-300
