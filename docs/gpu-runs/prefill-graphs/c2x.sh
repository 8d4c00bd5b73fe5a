# call 2: finish staging, the article preset's 4k and 16k levels (BF16 then W4A8, both with the profile's capture
# sizes), then the offline 4k repro with the plugin's own sizes (its log line shows the hook)
source .gpu/scripts/stage.sh
python3 -c "import vllm, anychip; print('vllm', vllm.__version__)"
rm -rf /tmp/code && mkdir -p /tmp/code && cp -r anychip .gpu /tmp/code/ && rm -rf /tmp/code/.gpu/p1 /tmp/code/.gpu/p2
(cd /tmp/code && LEVELS=4096,16384 SERVE_ONLY=1 setsid nohup bash .gpu/exp/job.sh > /root/keep/out/job.log 2>&1 < /dev/null &)
WAIT_S=420 bash .gpu/exp/wait.sh
grep -h "compilation-config\|cudagraph_capture_sizes" /root/keep/out/server-*.log | head -2 | cut -c1-400
C=/root/keep/cache/synthetic; M1=$(ls -d $C/llama-1b-w4a8-g128*not-a-model)
timeout 150 python3 .gpu/exp/ttft.py $M1 w4a8 $OUT/ttft-w4a8-plugin.json > $OUT/ttft-w4a8-plugin.log 2>&1; echo rc=$?
grep -E '^\{|anychip: CUDA graphs|median' $OUT/ttft-w4a8-plugin.log | grep -v '"E one' | cut -c1-300
