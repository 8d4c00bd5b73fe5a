# usage: bash .gpu/acc/run.sh OUTNAME VARIANTS  (after the three staging calls)
set -e
K=/root/keep/acc
if [ ! -d $K/bf16 ]; then
  cat $K/part00 $K/part01 $K/part02 > $K/model.gguf
  echo "$(cat $K/gguf.sha256)  $K/model.gguf" | sha256sum -c
  mkdir -p $K/site && tar -C $K/site -xf $K/gguf.tar && tar -C $K -xJf $K/tasks.tar.xz
  PYTHONPATH=$K/site:$PWD python3 -c "
from pathlib import Path; from anychip.checkpoint.from_gguf import convert_gguf
convert_gguf(Path('$K/model.gguf'), Path('$K/bf16'))"
  sha256sum $K/bf16/model.safetensors
fi
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$K/site:$PWD python3 docs/bench/accuracy_sweep.py --bf16 $K/bf16 --data $K/tasks --device cuda \
  --text mix=$K/mix.txt --out $OUT/$1.json --variants $2 ${BASE:+--base $K/$BASE.json} 2>&1 | grep -v "it/s\]\|Warning\|warn(" | tail -60
cp $OUT/$1.json $OUT/$1.items.json $K/
