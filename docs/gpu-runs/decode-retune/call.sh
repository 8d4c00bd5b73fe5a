# one device call, no vLLM: re-time the "decode" bucket (M <= 16) of this GPU's shipped table with the current
# candidates (launch._DECODE), every other bucket kept; the merged table and every candidate's time go to $OUT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1
mkdir -p $OUT/tuned && cp anychip/kernels/gpu/tuned/*.json $OUT/tuned/
slug=$(python3 -c "import torch; from anychip.kernels.gpu.tuning import slug; print(slug(torch.cuda.get_device_name()))")
shapes=$(python3 -c "
import json
entries = json.load(open('anychip/kernels/gpu/tuned/$slug.json'))['entries']
print(' '.join(sorted({','.join(key.split(':')[1:]) for key in entries})))")
echo "$slug: $shapes"
timeout ${RETUNE_TIMEOUT:-400} python3 -m anychip.kernels.gpu.tuning $shapes --retune --bucket decode \
  --out $OUT/tuned --times $OUT/decode-times.json 2>&1 | grep -v Warning
