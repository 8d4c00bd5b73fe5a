source .gpu/scripts/stage.sh > /dev/null 2>&1
mkdir -p /root/keep/cache
python3 -m anychip.cli prepare --synthetic llama-1b --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -1
