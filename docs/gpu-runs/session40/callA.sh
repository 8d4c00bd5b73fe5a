# Session 40, call A (carry .gpu/p1 .gpu/scripts .gpu/distinfo): stage vLLM's first half, then the Gluon GEMM's
# GPU test and A/B (no vLLM needed), then the table re-tune with the Gluon candidates; the re-tuned table goes to
# the disk cache (~/.cache/anychip/gpu_tuning) for call B only if the Gluon test passed.
source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 200 python3 -m pytest -q -x tests/test_kernels_gpu_gluon.py -p no:cacheprovider 2>&1 | tail -6
ok=${PIPESTATUS[0]}
echo "gluon tests rc=$ok $(date -u +%T)"
timeout ${AB_TIMEOUT:-200} python3 docs/gpu-runs/session40/gluon_ab.py $OUT/gluon_ab.json 2>&1 | grep -v "^\s*$" | tail -16
echo "ab done $(date -u +%T)"
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
mkdir -p $OUT/table
timeout ${TUNE_TIMEOUT:-170} python3 -m anychip.kernels.gpu.tuning 4096,2048,128 2048,2048,128 12288,2048,128 \
  2048,6144,128 3072,2048,128 16384,2048,128 2048,8192,128 6144,2048,128 4096,4096,128 14336,4096,128 \
  960,576,32 576,576,32 3072,576,32 576,1536,32 --retune --wgmma --out $OUT/table --times $OUT/table/times.json \
  2>&1 | tail -4 | cut -c1-400
echo "tune done $(date -u +%T)"
if [ "$ok" = 0 ]; then mkdir -p ~/.cache/anychip/gpu_tuning && cp $OUT/table/*.json ~/.cache/anychip/gpu_tuning/; fi
ls ~/.cache/anychip/gpu_tuning/ 2>/dev/null
grep -c '"wgmma"' $OUT/table/*.json
