# wait for the job (at most ~540 s of this call), then copy what exists to $OUT
T0=$SECONDS
while [ $((SECONDS-T0)) -lt ${WAIT_S:-480} ]; do
  grep -q JOBDONE /root/keep/out/job.log 2>/dev/null && break
  sleep 10
done
cat /root/keep/out/job.log | grep -v "it/s\]" | tail -40
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
cp /root/keep/out/*.json /root/keep/out/*.md /root/keep/out/*.png /root/keep/out/job.log $OUT/ 2>/dev/null
for f in /root/keep/out/server-*.log; do [ -f $f ] && tail -c 200000 $f > $OUT/$(basename $f); done
ls -la $OUT
