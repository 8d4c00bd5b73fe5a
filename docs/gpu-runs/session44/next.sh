# Prepared in session 44 for the next GPU session (not run yet). Call A: carry .gpu/p1 .gpu/scripts .gpu/distinfo,
# TUNE_TIMEOUT up to 560, the whole call for the H100/H200 table re-tune of all fourteen shapes with the split-order
# candidates (writes $OUT/table; copy it into anychip/kernels/gpu/tuned/ only when "tuned 14 shapes" is printed).
# Call B (right after, same machine): `B=1 bash docs/gpu-runs/session44/next.sh`, carrying .gpu/p2 .gpu/scripts
# .gpu/distinfo .gpu/tok: llama-2b bench latency with that table in the disk cache, and the configs each M bucket
# ran (coverage's gpu_gemm_configs), to see why session 44's kernel gain did not reach the engine's pp512.
source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [ -z "$B" ]; then
  mkdir -p $OUT/table
  SHAPES="4096,2048,128 2048,2048,128 12288,2048,128 2048,6144,128 3072,2048,128 16384,2048,128 2048,8192,128
    6144,2048,128 4096,4096,128 14336,4096,128 960,576,32 576,576,32 3072,576,32 576,1536,32"
  timeout ${TUNE_TIMEOUT:-540} python3 -m anychip.kernels.gpu.tuning $SHAPES --retune --out $OUT/table \
    --times $OUT/table/times.json 2>&1 | tail -2 | cut -c1-300
  python3 -c "import json,glob; e=json.load(open(glob.glob('$OUT/table/nvidia*.json')[0]))['entries']; \
print('tuned', len({k.split(':',1)[1] for k in e}), 'shapes')"
  mkdir -p ~/.cache/anychip/gpu_tuning && cp $OUT/table/nvidia*.json ~/.cache/anychip/gpu_tuning/
  exit 0
fi
mkdir -p /root/keep/cache
python3 -m anychip.cli prepare --synthetic llama-2b --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -1
python3 -c "from pathlib import Path; from anychip.bench.peers import make_bf16_dequant; \
print(make_bf16_dequant(next(Path('/root/keep/cache/synthetic').glob('llama-2b-w4a8-g128*not-a-model'))))"
M=$(ls -d /root/keep/cache/synthetic/llama-2b-w4a8-g128*not-a-model)
timeout ${LAT_TIMEOUT:-400} python3 -m anychip.cli bench latency $M --peers --device cuda --reps 3 --budget-s 12 \
  --batch 64 --systems anychip-w4a8,vllm-bf16 --compile-cache shared --json $OUT/lat-2b.json > $OUT/lat-2b.log 2>&1
grep -E "^\| (anychip|vllm)" $OUT/lat-2b.md | cut -d'|' -f2,4-7,9
python3 - <<'PY'
import glob, json
cov = json.load(open(sorted(glob.glob("/tmp/anychip-bench-latency-*/anychip-w4a8.coverage.json"))[-1]))
for shape, buckets in (cov.get("gpu_gemm_configs") or {}).items():
    print(shape, {b: str(c)[:90] for b, c in buckets.items() if b in ("512", "1024", "4096")})
PY
