# call 2 (p2): finish staging, start the job detached, then wait
source .gpu/scripts/stage.sh
python3 -c "import vllm, anychip; print('vllm', vllm.__version__)"
rm -rf /tmp/code && mkdir -p /tmp/code && cp -r anychip .gpu /tmp/code/ && rm -rf /tmp/code/.gpu/p1 /tmp/code/.gpu/p2
cd /tmp/code && setsid nohup bash .gpu/exp/job.sh > /root/keep/out/job.log 2>&1 < /dev/null & 
cd - >/dev/null
bash .gpu/exp/wait.sh
