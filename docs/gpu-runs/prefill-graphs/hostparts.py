import time, torch
from anychip.kernels import ops
from anychip.kernels.gpu import launch as L, triton_w4a8 as K
from anychip.kernels.prepare import prepare_w4a8
DEV = "cuda"
def make(n, k, g=128):
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    s = torch.rand(n, k // g) * 0.01 + 0.001
    return prepare_w4a8(q.to(DEV), s.to(DEV).bfloat16(), g, packed=False)
def host_us(f, n=30):
    for _ in range(3): f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): f()
    h = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return round(h * 1e6, 1)
with torch.inference_mode():
  for m, n, k in [(4096, 3072, 2048), (4096, 2048, 8192), (64, 3072, 2048), (1024, 3072, 2048)]:
    p = make(n, k); g = 128
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    lid = ops.layer_tensor(0)
    xq, sx = L.quantize_act(x)
    sxf = sx.reshape(-1).float().contiguous()
    out = torch.empty((m, n), dtype=torch.bfloat16, device=DEV)
    cfg = L.serving_config(m, n, k, g, x.device)
    sp = L.split_of(cfg, m, n)
    parts = torch.empty((sp, m, n), dtype=torch.float32, device=DEV) if sp > 1 else None
    locks = L._locks(x.device) if sp > 1 else None
    grid, args, options = L.gemm_launch(cfg, m, n, k, g, xq, sxf, p.weight, p.scales, None, out, parts, locks, None,
                                        None, xq.stride(0), out.stride(0))
    L.w4a8_linear_q(xq, sx, p.weight, p.scales, None, n, k, g, torch.bfloat16); d(grid, args, options) if False else None
    d = L.Direct(K._w4a8_gemm_kernel)
    qopt = L.quantize_options(k)
    dq = L.Direct(K._quantize_rows_kernel)
    res = {
     "op": host_us(lambda: torch.ops.anychip.w4a8_linear(x, p.weight, p.scales, None, n, k, g, p.route.code, lid)),
     "launch.w4a8_linear": host_us(lambda: L.w4a8_linear(x, p.weight, p.scales, None, n, k, g)),
     "quantize_act": host_us(lambda: L.quantize_act(x)),
     "w4a8_linear_q": host_us(lambda: L.w4a8_linear_q(xq, sx, p.weight, p.scales, None, n, k, g, torch.bfloat16)),
     "direct gemm": host_us(lambda: d(grid, args, options)),
     "direct quant": host_us(lambda: dq((m,), (x, xq, sx, k, x.stride(0), xq.stride(0)), qopt)),
     "jit gemm": host_us(lambda: K._w4a8_gemm_kernel[grid](*args, **options)),
     "empty x3": host_us(lambda: (torch.empty((m, n), dtype=torch.bfloat16, device=DEV),
                                  torch.empty((m, k), dtype=torch.int8, device=DEV),
                                  torch.empty((m, 1), dtype=torch.float32, device=DEV))),
     "serving_config": host_us(lambda: L.serving_config(m, n, k, g, x.device)),
    }
    print(f"M={m} N={n} K={k} cfg={cfg}", res, flush=True)
  # where in the direct launch: spec key vs compiled.run
  import anychip.kernels.gpu.direct as D
  key = (torch.cuda.current_device(), tuple(options.items()), tuple(map(D._spec, args)))
  compiled, tail = d._entries[key]
  stream = torch._C._cuda_getCurrentRawStream(0)
  full = args + tail
  print("key", host_us(lambda: (torch.cuda.current_device(), tuple(options.items()), tuple(map(D._spec, args)))),
        "run", host_us(lambda: compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata,
                                             None, None, None, *full)),
        "gs", getattr(compiled.metadata, "global_scratch_size", None), getattr(compiled.metadata, "profile_scratch_size", None))
