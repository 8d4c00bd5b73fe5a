# call 2 (p2): finish staging, start the job detached, then wait
source .gpu/scripts/stage.sh
python3 -c "import vllm, anychip; print('vllm', vllm.__version__)"
rm -rf /tmp/code && mkdir -p /tmp/code && cp -r anychip .gpu /tmp/code/ && rm -rf /tmp/code/.gpu/p1 /tmp/code/.gpu/p2
# in a subshell: a trailing `&` on `cd /tmp/code && ...` backgrounds the whole list, so the cd never reaches this
# shell and a `cd -` after it went elsewhere (session 32: wait.sh not found, the call returned at once)
(cd /tmp/code && setsid nohup bash .gpu/exp/job.sh > /root/keep/out/job.log 2>&1 < /dev/null &)
bash .gpu/exp/wait.sh
