# call 1 (p1): stage, make the synthetic models (torch + anychip only)
set -x
source .gpu/scripts/stage.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
mkdir -p /root/keep/cache /root/keep/out
git log -1 --format=%H 2>/dev/null
for s in llama-1b; do
  python3 -m anychip.cli prepare --synthetic $s --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -3
done
python3 - <<'PY'
from pathlib import Path
from anychip.bench.peers import make_bf16_dequant
for s in ("llama-1b",):
    d = next(Path("/root/keep/cache/synthetic").glob(f"{s}-w4a8-g128*not-a-model"))
    print(make_bf16_dequant(d))
PY
ls /root/keep/cache/synthetic; df -h /root | tail -1
