# session 38 call 1 (p1): stage, make the synthetic llama-2b and its BF16 / W4A16 copies (torch + anychip only)
source .gpu/scripts/stage.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
mkdir -p /root/keep/cache /root/keep/out
python3 -m anychip.cli prepare --synthetic llama-2b --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -2
python3 - <<'PY'
from pathlib import Path
from anychip.bench.peers import make_bf16_dequant, make_w4a16
d = next(Path("/root/keep/cache/synthetic").glob("llama-2b-w4a8-g128*not-a-model"))
print(make_bf16_dequant(d)); print(make_w4a16(d))
PY
ls /root/keep/cache/synthetic; df -h /root | tail -1; date -u +%T
