// Torch binding of the output-head GEMV (head_cpu.h), registered from C++ as torch ops (no Python per call):
//   anychip::head_bf16(Tensor x, Tensor weight, Tensor? bias, int isa) -> Tensor
//       x (..., K) bf16/fp32/fp16, weight (N, K) bf16 -> (..., N) in x's dtype; fp32 accumulation
//   anychip::head_int8(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int isa) -> Tensor
//       weight (N, K) int8, scales (N,) fp32; x quantized per token to INT8 inside -> (..., N) in x's dtype
// Meta kernels give torch.compile the output shapes.  `isa` is a HeadIsa code (head_cpu.h).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "head_cpu.h"
#include "parallel_cpu.h"
#include "quantize_act.h"

namespace anychip {
namespace {

OutType head_out_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return OutType::kF32;
    case at::kBFloat16: return OutType::kBF16;
    case at::kHalf: return OutType::kF16;
    default: TORCH_CHECK(false, "anychip head: activations must be fp32, bf16 or fp16, got ", t);
  }
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

template <typename F>
void for_x_type(const at::Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat: f(x.data_ptr<float>()); break;
    case at::kBFloat16: f(reinterpret_cast<const Bf16*>(x.data_ptr<c10::BFloat16>())); break;
    case at::kHalf: f(reinterpret_cast<const Fp16*>(x.data_ptr<c10::Half>())); break;
    default: head_out_type(x.scalar_type());
  }
}

void check_head(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, int64_t isa,
                at::ScalarType wtype) {
  TORCH_CHECK(isa >= 0 && isa < kHeadIsaCount && head_isa_supported(isa), "anychip head: ISA code ", isa,
              " is unknown or not supported by this CPU: pick a head route that `anychip routes` lists as available");
  TORCH_CHECK(head_isa_serves(isa, wtype == at::kChar), "anychip head: ISA code ", isa, " has no ",
              wtype == at::kChar ? "INT8" : "BF16", " head kernel: pick a head route of that kind");
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu(), "anychip head: x must be a CPU tensor (..., K)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == wtype && weight.is_contiguous() &&
                  weight.size(1) == x.size(-1),
              "anychip head: weight must be contiguous (N, K=", x.size(-1), ") ", wtype, ", got ", weight.scalar_type(),
              " ", weight.sizes(), ": prepare it with the head route's prepare()");
  if (bias.has_value())
    TORCH_CHECK(bias->numel() == weight.size(0), "anychip head: bias must have N=", weight.size(0), " elements");
}

at::Tensor head_bf16(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_in,
                     int64_t isa) {
  check_head(x_in, weight, bias_in, isa, at::kBFloat16);
  const int64_t k = x_in.size(-1), n = weight.size(0);
  const at::Tensor x = x_in.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  at::Tensor out = at::empty(out_shape(x_in, n), x_in.options());
  if (m == 0) return out;
  c10::optional<at::Tensor> bias;
  if (bias_in.has_value()) bias = bias_in->to(at::kFloat).contiguous();
  if (isa == kHeadAvx512Bf16 && x.scalar_type() != at::kBFloat16) isa = kHeadAvx2;  // vdpbf16ps takes bf16 x only
  HeadProblem p;
  p.m = m, p.n = n, p.k = k;
  p.w = reinterpret_cast<const Bf16*>(weight.data_ptr<c10::BFloat16>());
  p.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.out_type = head_out_type(x.scalar_type());
  at::Tensor xf;
  if (isa == kHeadAvx512Bf16) {
    p.xb = reinterpret_cast<const Bf16*>(x.data_ptr<c10::BFloat16>());
  } else {
    xf = at::empty({m, k}, x.options().dtype(at::kFloat));
    float* f = xf.data_ptr<float>();
    for_x_type(x, [&](const auto* xs) {
      for (int64_t r = 0; r < m; ++r) {
        if (isa == kHeadAvx2) {
          head_split_x(xs + r * k, k, f + r * k);
        } else {
          for (int64_t i = 0; i < k; ++i) f[r * k + i] = to_f(xs[r * k + i]);
        }
      }
    });
    p.xf = f;
  }
  head_run(p, false, isa, at::get_num_threads(), TorchParallel{});
  return out;
}

at::Tensor head_int8(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scales_in,
                     const c10::optional<at::Tensor>& bias_in, int64_t isa) {
  check_head(x_in, weight, bias_in, isa, at::kChar);
  const int64_t k = x_in.size(-1), n = weight.size(0);
  TORCH_CHECK(scales_in.numel() == n, "anychip head_int8: scales must have N=", n, " elements");
  const at::Tensor x = x_in.reshape({-1, k}).contiguous();
  const at::Tensor scales = scales_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0);
  at::Tensor out = at::empty(out_shape(x_in, n), x_in.options());
  if (m == 0) return out;
  c10::optional<at::Tensor> bias;
  if (bias_in.has_value()) bias = bias_in->to(at::kFloat).contiguous();
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({m}, x.options().dtype(at::kFloat));
  const int simd = quant_simd();
  for_x_type(x, [&](const auto* xs) {
    for (int64_t r = 0; r < m; ++r) quantize_row(xs + r * k, k, xq.data_ptr<int8_t>() + r * k, sx.data_ptr<float>() + r, simd);
  });
  HeadProblem p;
  p.m = m, p.n = n, p.k = k;
  p.wq = weight.data_ptr<int8_t>();
  p.sw = scales.data_ptr<float>();
  p.xq = xq.data_ptr<int8_t>();
  p.sx = sx.data_ptr<float>();
  at::Tensor xsum;
  if (isa == kHeadAvx512Vnni) {  // the offset its tiles take off: 128 * sum(xq) per token
    xsum = at::empty({m}, x.options().dtype(at::kInt));
    const int8_t* q = xq.data_ptr<int8_t>();
    int32_t* s = xsum.data_ptr<int32_t>();
    for (int64_t r = 0; r < m; ++r) {
      int32_t t = 0;
      for (int64_t i = 0; i < k; ++i) t += q[r * k + i];
      s[r] = t;
    }
    p.xsum = s;
  }
  p.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.out_type = head_out_type(x.scalar_type());
  head_run(p, true, isa, at::get_num_threads(), TorchParallel{});
  return out;
}

at::Tensor head_bf16_meta(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>&, int64_t) {
  return at::empty(out_shape(x, weight.size(0)), x.options());
}

at::Tensor head_int8_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor&,
                          const c10::optional<at::Tensor>&, int64_t) {
  return at::empty(out_shape(x, weight.size(0)), x.options());
}

}  // namespace
}  // namespace anychip

TORCH_LIBRARY_FRAGMENT(anychip, m) {
  m.def("head_bf16(Tensor x, Tensor weight, Tensor? bias, int isa) -> Tensor");
  m.def("head_int8(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(anychip, CPU, m) {
  m.impl("head_bf16", &anychip::head_bf16);
  m.impl("head_int8", &anychip::head_int8);
}

TORCH_LIBRARY_IMPL(anychip, Meta, m) {
  m.impl("head_bf16", &anychip::head_bf16_meta);
  m.impl("head_int8", &anychip::head_int8_meta);
}
