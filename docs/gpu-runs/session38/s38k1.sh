source .gpu/scripts/stage.sh > /dev/null 2>&1; nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%T
