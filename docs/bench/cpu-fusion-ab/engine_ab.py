import json, os, sys, time
os.environ.update({"OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
os.environ["VLLM_CACHE_ROOT"] = sys.argv[2]
from anychip.bench.runners import RunSpec, VllmTimed
spec = RunSpec(**json.load(open(sys.argv[1])))
eng = VllmTimed(spec, 600)
from anychip.kernels import hooks
nf = len(hooks.fused_layers())
import random
ids = [random.Random(0).randrange(100, 40000) for _ in range(512)]
eng.prefill(ids); eng.decode(5, 32)
pp, tg = [], []
for rep in range(4):
    pp.append(512 / eng.prefill(ids)); tg.append(128 / eng.decode(5, 128))
print(json.dumps({"label": sys.argv[3], "fused_layers": nf, "pp": pp, "tg": tg}))
