source .gpu/scripts/stage.sh > /dev/null 2>&1
mkdir -p /root/keep/cache
python3 -m anychip.cli prepare --synthetic llama-1b --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -1
python3 -c "
from pathlib import Path
from anychip.bench.peers import make_bf16_dequant
print(make_bf16_dequant(next(Path('/root/keep/cache/synthetic').glob('llama-1b-w4a8-g128*not-a-model'))))"
