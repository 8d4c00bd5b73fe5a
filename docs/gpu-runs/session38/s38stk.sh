source .gpu/scripts/stage.sh > /dev/null 2>&1
mkdir -p /tmp/sc && cat > /tmp/sc/sitecustomize.py <<'PY'
import os, sys, threading, time, traceback
if os.environ.get("SC_DUMP"):
    def _sample(path=os.environ["SC_DUMP"] + f".{os.getpid()}"):
        main = threading.main_thread().ident
        with open(path, "w") as f:
            while True:
                time.sleep(0.5)
                frame = sys._current_frames().get(main)
                if frame is None:
                    continue
                stack = traceback.extract_stack(frame)[-14:]
                f.write(f"@ {time.strftime('%H:%M:%S')}\n" + "".join(f"  {s.filename.split('site-packages/')[-1]}:{s.lineno} {s.name}\n" for s in stack))
                f.flush()
    threading.Thread(target=_sample, daemon=True).start()
PY
export PYTHONPATH=/tmp/sc:$PYTHONPATH PYTHONUNBUFFERED=1 SC_DUMP=$OUT/stk
C=/root/keep/cache/synthetic; M=$(ls -d $C/llama-2b-w4a8-g128*not-a-model)
timeout 300 python3 -m anychip.cli bench latency $M --device cuda --reps 1 --budget-s 5 --batch 64 --systems anychip-w4a8 \
  --compile-cache shared --json $OUT/stk-lat.json > $OUT/stk-bench.log 2>&1
echo rc=$?
d=$(ls -dt /tmp/anychip-bench-latency-* | head -1); cp $d/anychip-w4a8.log $OUT/anychip-w4a8-vllm.log
grep -E "Graph capturing finished|JIT monitor|init engine" $OUT/anychip-w4a8-vllm.log | cut -c1-160
ls -la $OUT
