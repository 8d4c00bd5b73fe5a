source .gpu/scripts/stage.sh > /dev/null 2>&1
mkdir -p /root/keep/cache
python3 -m anychip.cli prepare --synthetic tiny --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -1
python3 -c "import pytest, xdist; print('pytest', pytest.__version__)" 2>&1 | tail -1
