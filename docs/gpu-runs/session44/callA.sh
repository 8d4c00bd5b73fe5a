# Session 44, call A (carry .gpu/p1 .gpu/scripts .gpu/distinfo): stage vLLM's first half; the GPU kernel tests with
# the split-order (cat) swap tiles among the prefill candidates; then the table re-tune with them. The re-tuned
# table goes to the disk cache (~/.cache/anychip/gpu_tuning) for call B only if the kernel tests passed.
source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -x tests/test_kernels_gpu.py -p no:cacheprovider 2>&1 | tail -4
ok=${PIPESTATUS[0]}
echo "gpu kernel tests rc=$ok $(date -u +%T)"
mkdir -p $OUT/table
timeout ${TUNE_TIMEOUT:-170} python3 -m anychip.kernels.gpu.tuning 4096,2048,128 2048,2048,128 12288,2048,128 \
  2048,6144,128 3072,2048,128 16384,2048,128 2048,8192,128 6144,2048,128 4096,4096,128 14336,4096,128 \
  960,576,32 576,576,32 3072,576,32 576,1536,32 --retune --out $OUT/table --times $OUT/table/times.json \
  2>&1 | tail -3 | cut -c1-400
echo "tune done $(date -u +%T)"
if [ "$ok" = 0 ]; then mkdir -p ~/.cache/anychip/gpu_tuning && cp $OUT/table/*.json ~/.cache/anychip/gpu_tuning/; fi
ls ~/.cache/anychip/gpu_tuning/ 2>/dev/null
python3 - $OUT/table <<'PY'
import json, sys, pathlib, collections
for f in pathlib.Path(sys.argv[1]).glob("nvidia*.json"):
    e = json.load(open(f))["entries"]
    c = collections.Counter((v.get("swap"), v.get("cat"), v.get("block_n"), v.get("pipe")) for k, v in e.items()
                            if int(k.split(":")[0]) > 256)
    print(f.name, len(e), "prefill entries (swap, cat, block_n, pipe):", dict(c))
PY
