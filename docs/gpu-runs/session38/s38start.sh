source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
C=/root/keep/cache/synthetic; M=$(ls -d $C/llama-2b-w4a8-g128*not-a-model)
cat > /tmp/st.py <<'PY'
import sys, time
t0 = time.time()
from anychip.bench.runners import RunSpec, VllmTimed
spec = RunSpec(system=sys.argv[2], engine="vllm", model=sys.argv[1], pp=512, tg=128, reps=1, threads=16, device="cuda", batch=64)
eng = VllmTimed(spec, max_len=1024)
print(f"ENGINE READY {time.time() - t0:.1f} s", flush=True)
PY
for sys_model in "anychip-w4a8 $M" "vllm-bf16 $M-dequant-bf16"; do
  set -- $sys_model
  python3 /tmp/st.py $2 $1 > $OUT/start-$1.log 2>&1
  echo "== $1"; grep -E "ENGINE READY|Asynchronous|init engine|compil|Compil|graph|tuning|tuned|precompile|took|seconds|cache" $OUT/start-$1.log | cut -c1-220 | tail -40
done
