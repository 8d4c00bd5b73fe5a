# session 39: is the H100 table's prefill choice an artefact of fp32 scales? then re-tune every bucket with BF16 scales
set -e
S="4096,2048,128 2048,2048,128 12288,2048,128 2048,6144,128 3072,2048,128 16384,2048,128 2048,8192,128"
# 1) the old tuner (fp32 scales), prefill buckets 512 and 2048 only, two shapes
mkdir -p $OUT/fp32 $OUT/bf16
cp .gpu/exp/tuning_fp32.py /tmp/tuning_fp32.py
PYTHONPATH=$PWD python3 -c "
import sys, runpy; sys.argv=['tuning','2048,6144,128','12288,2048,128','--retune','--bucket','512','--bucket','2048','--out','$OUT/fp32','--times','$OUT/fp32/times.json']
runpy.run_path('/tmp/tuning_fp32.py', run_name='__main__')" 2>&1 | grep -v Warning | tail -4
# 2) every bucket of the seven shapes with BF16 scales
PYTHONPATH=$PWD python3 -m anychip.kernels.gpu.tuning $S --retune --out $OUT/bf16 --times $OUT/bf16/times.json 2>&1 | grep -v Warning | tail -9
