source .gpu/scripts/stage.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /root/keep/cache
for s in llama-1b "llama-1b,layers=1" llama-2b; do
  python3 -m anychip.cli prepare --synthetic $s --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -1
done
python3 - <<'PY'
from pathlib import Path
from anychip.bench.peers import make_bf16_dequant
for d in Path("/root/keep/cache/synthetic").glob("*not-a-model"):
    print(make_bf16_dequant(d))
PY
ls /root/keep/cache/synthetic
