source .gpu/scripts/stage.sh >/dev/null 2>&1
bash .gpu/exp/wait.sh
