# Session 47, call D (after p1, with p2 carried): batch 64 with the SiluAndMul fusion on (ANYCHIP_FUSE_SILU=1)
# against the default, same machine; then the GPU NaN check with room for the engine's start.
source .gpu/scripts/stage.sh > /dev/null 2>&1
export PYTHONUNBUFFERED=1
mkdir -p /root/keep/cache
python3 -m anychip.cli prepare --synthetic llama-2b --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -1
M=$(ls -d /root/keep/cache/synthetic/llama-2b-w4a8-g128*not-a-model)
S=docs/gpu-runs/session46/b64split.py
timeout 230 python3 $S $M anychip-w4a8 $OUT/split-default.json 2>&1 | grep -E "^anychip|quant|silu|_w4a8" | head -20
ANYCHIP_FUSE_SILU=1 timeout 200 python3 $S $M anychip-w4a8 $OUT/split-silu.json 2>&1 \
  | grep -E "^anychip|quant|silu|_w4a8|SiluAndMul into" | head -20
python3 -m anychip.cli prepare --synthetic tiny --tokenizer .gpu/tok --cache /root/keep/cache 2>&1 | tail -1
T=$(ls -d /root/keep/cache/synthetic/tiny-w4a8* | grep -v dequant | head -1)
timeout 150 python3 docs/gpu-runs/session46/nan_gpu.py $T /root/keep > $OUT/nan.log 2>&1; echo "nan rc=$?"
grep -E "poisoned|NAN CHECK|NaN|nan|Error" $OUT/nan.log | grep -v "^INFO" | head -8
