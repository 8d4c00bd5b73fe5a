source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
bash .gpu/exp/lat.sh default
