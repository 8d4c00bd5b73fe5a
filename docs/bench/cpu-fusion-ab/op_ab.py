import torch, time
torch.set_num_threads(2)
from anychip.kernels import cpu_ext, routes
from anychip.kernels.prepare import prepare_w4a8
from anychip.vllm_plugin import fusion
from torch._inductor import config as ic
cpu_ext.load()
K, N, G = 576, 3072, 32
gen = torch.Generator().manual_seed(0)
route = routes.available("cpu")[0]
def prep(n, k):
    return prepare_w4a8(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen), torch.rand(n, k // G, generator=gen) * 0.02 + 1e-3, G, packed=False, route=route.id)
up, down, qkv = prep(2 * 1536, K), prep(K, 1536), prep(960, K)
from vllm.ir.ops.layernorm import fused_add_rms_norm
nw = (torch.rand(K, generator=gen) + 0.5).bfloat16()
def mlp(x, r, nw, wu, su, wd, sd):
    h, res = fused_add_rms_norm.impls["native"].impl_fn(x, r, nw, 1e-5)
    y = torch.ops.anychip.w4a8_linear.default(h, wu, su, None, 3072, K, G, route.code, None)
    a = torch.nn.functional.silu(y[..., :1536]) * y[..., 1536:]
    return torch.ops.anychip.w4a8_linear.default(a, wd, sd, None, K, 1536, G, route.code, None), res
class P(fusion.CpuFusionPass):
    pass
fns = {}
for name, on in (("off", False), ("on", True)):
    torch._dynamo.reset()
    with ic.patch(post_grad_custom_post_pass=P(on, on), fx_graph_cache=False, cpp_wrapper=True):
        fns[name] = torch.compile(mlp, fullgraph=True, dynamic=False)
        for m in (1, 512):
            x, r = torch.randn(m, K, generator=gen).bfloat16(), torch.randn(m, K, generator=gen).bfloat16()
            fns[name](x, r, nw, up.weight, up.scales, down.weight, down.scales)
for m, reps in ((1, 2000), (512, 50)):
    x, r = torch.randn(m, K, generator=gen).bfloat16(), torch.randn(m, K, generator=gen).bfloat16()
    args = (x, r, nw, up.weight, up.scales, down.weight, down.scales)
    best = {k: 1e9 for k in fns}
    for rnd in range(7):
        for name, f in fns.items():
            t = time.perf_counter()
            for _ in range(reps): f(*args)
            best[name] = min(best[name], (time.perf_counter() - t) / reps)
    print(f"M={m}: off {best['off']*1e6:.1f} us, on {best['on']*1e6:.1f} us, on/off {best['on']/best['off']:.3f}")
