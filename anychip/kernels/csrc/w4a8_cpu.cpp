// W4A8 linear for CPUs: INT4 weights (one fp32 scale per group of G input channels), dynamic per-token INT8
// activations, INT32 accumulation per group.  This file is the torch binding: it registers the CPU kernels of the
// torch.ops.anychip.* W4A8 ops (schemas, fake kernels and the other devices' kernels: anychip/kernels/ops.py), so a
// call on one of this extension's routes runs no Python.  The arithmetic lives in the torch-free headers it includes
// (also built by the Arm test driver, tests/arm/driver.cpp):
//   cpu_common.h    ISA codes, route ids and their run-time check, 16-bit float bits
//   quantize_act.h  per-token INT8 activations, group corrections, bandwidth probe
//   pre_ops.h       the RMSNorm / SiluAndMul that the fused ops compute ahead of the quantization
//   w4a8_tiles.h    the problem, the blocked weight layout, epilogues, the portable tile
//   w4a8_x86.h      AVX512-VNNI and AVX2 tiles          w4a8_arm.h  NEON dotprod and i8mm tiles
//   w4a8_run.h      dispatch and the threaded loop    parallel_cpu.h  the thread pool (at::parallel_for, load guard)
// and call_counts.h, the per-layer coverage counts the ops keep.  One translation unit serves every CPU of an
// architecture: the SIMD paths are compiled with function-level target attributes and chosen at run time.  The torch
// oracle is anychip/kernels/reference.py.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "call_counts.h"
#include "cpu_common.h"
#include "parallel_cpu.h"
#include "pre_ops.h"
#include "quantize_act.h"
#include "w4a8_run.h"

// Calls with up to this many tokens quantize their activations on every thread, inside the GEMV's one parallel
// region (each thread's copy is the same bits); larger calls quantize in a pass of their own first.
#ifndef ANYCHIP_FUSED_MAX_TOKENS
#define ANYCHIP_FUSED_MAX_TOKENS 8
#endif

namespace anychip {
namespace {

static_assert(sizeof(c10::BFloat16) == sizeof(Bf16) && sizeof(c10::Half) == sizeof(Fp16),
              "16-bit float layouts must match c10's");

// f(typed pointer to x's data) for fp32 / bf16 / fp16 activations.
template <typename F>
void with_x(at::ScalarType type, const void* data, F&& f) {
  switch (type) {
    case at::kFloat: return f(static_cast<const float*>(data));
    case at::kBFloat16: return f(static_cast<const Bf16*>(data));
    case at::kHalf: return f(static_cast<const Fp16*>(data));
    default: TORCH_CHECK(false, "anychip: activations must be fp32, bf16 or fp16, got ", type);
  }
}

// Where a call's INT8 activations come from: float x to quantize (after `pre`, for the fused ops), or ready xq
// (with sx, absent for the debug dots).
struct Acts {
  const void* x = nullptr;
  at::ScalarType x_type = at::kFloat;
  const int8_t* xq = nullptr;
  const float* sx = nullptr;
  PreArgs pre;
};

// Rows [r0, r1): quantized (when a.x) into q / sx, and the group corrections into corr of those from row
// corr_from on (corrections_from: the rows before it are read by no tile).
void prepare_rows(const Acts& a, const Problem& p, int64_t r0, int64_t r1, int8_t* q, float* sx, int32_t* corr,
                  int64_t corr_from) {
  const int level = quant_simd();
  const int8_t* rows = a.x ? q : a.xq;
  if (a.x && a.pre.op != PreOp::kNone) {
    thread_local std::vector<float> v;
    v.resize(p.k);
    with_x(a.x_type, a.x, [&](const auto* x) {
      for (int64_t r = r0; r < r1; ++r) {
        pre_row(a.pre, x, r, p.k, v.data(), level);
        quantize_row(v.data(), p.k, q + r * p.k, sx + r, level);
      }
    });
  } else if (a.x) {
    with_x(a.x_type, a.x, [&](const auto* x) {
      for (int64_t r = r0; r < r1; ++r) quantize_row(x + r * p.k, p.k, q + r * p.k, sx + r, level);
    });
  }
  for (int64_t r = std::max(r0, corr_from); r < r1; ++r)
    group_corr_row(rows + r * p.k, p.k, p.group_size, corr + r * p.groups);
}

// A fused call's activations on one thread, kept between calls: a decode step allocates nothing for them.
struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> sx;
  std::vector<int32_t> corr;
};

// Runs the linear (or the debug dots) of `p`, whose activations are `a`.
template <bool DOTS>
void run_op(Problem p, int64_t isa, const Acts& a) {
  if (p.m == 0) return;
  if (a.pre.op != PreOp::kNone && p.m <= ANYCHIP_FUSED_MAX_TOKENS) {
    // a call this small quantizes on every thread: its pre-op runs once, here, and writes the residual once
    thread_local std::vector<float> v;
    v.resize(p.m * p.k);
    with_x(a.x_type, a.x, [&](const auto* x) {
      for (int64_t r = 0; r < p.m; ++r) pre_row(a.pre, x, r, p.k, v.data() + r * p.k, quant_simd());
    });
    Acts values;
    values.x = v.data();
    return run_op<DOTS>(p, isa, values);
  }
  const int64_t threads = at::get_num_threads();
  const int64_t corr_from = corrections_from<DOTS>(p, isa);
  if (p.m <= ANYCHIP_FUSED_MAX_TOKENS) {
    run<DOTS>(p, isa, threads, TorchParallel{}, [&](Problem& local) {
      thread_local Scratch s;
      s.corr.resize(p.m * p.groups);
      if (a.x) s.q.resize(p.m * p.k), s.sx.resize(p.m);
      prepare_rows(a, p, 0, p.m, s.q.data(), s.sx.data(), s.corr.data(), corr_from);
      local.xq = a.x ? s.q.data() : a.xq;
      local.sx = a.x ? s.sx.data() : a.sx;
      local.xcorr = s.corr.data();
    });
    return;
  }
  const at::TensorOptions opts = at::TensorOptions().device(at::kCPU);
  at::Tensor corr = at::empty({p.m, p.groups}, opts.dtype(at::kInt)), q, sx;
  if (a.x) q = at::empty({p.m, p.k}, opts.dtype(at::kChar)), sx = at::empty({p.m}, opts.dtype(at::kFloat));
  int8_t* qp = a.x ? q.data_ptr<int8_t>() : nullptr;
  float* sp = a.x ? sx.data_ptr<float>() : nullptr;
  int32_t* cp = corr.data_ptr<int32_t>();
  at::parallel_for(0, p.m, 16, [&](int64_t r0, int64_t r1) { prepare_rows(a, p, r0, r1, qp, sp, cp, corr_from); });
  p.xq = a.x ? qp : a.xq;
  p.sx = a.x ? sp : a.sx;
  p.xcorr = cp;
  run<DOTS>(p, isa, threads, TorchParallel{});
}

void check_isa(int64_t isa) {
  static const auto supported = [] {
    std::vector<bool> s(kIsaCount);
    for (int64_t i = 0; i < kIsaCount; ++i) s[i] = isa_supported(i);
    return s;
  }();
  TORCH_CHECK(supported[isa], "anychip: this CPU (or this build) lacks ISA ", isa_name(isa), " (route ",
              isa_route_id(isa), "); unset ANYCHIP_KERNEL_ISA or pick a route that `anychip routes` lists as available");
}

OutType out_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return OutType::kF32;
    case at::kBFloat16: return OutType::kBF16;
    case at::kHalf: return OutType::kF16;
    default: TORCH_CHECK(false, "anychip: output dtype must be fp32, bf16 or fp16, got ", t);
  }
}

// The problem without its activations; checks the prepared weight layout.  bias: fp32 contiguous or absent.
Problem weight_problem(const at::Tensor& weight, const at::Tensor& scales, const c10::optional<at::Tensor>& bias,
                       int64_t m, int64_t n, int64_t k, int64_t group_size) {
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && k % group_size == 0, "anychip: K=", k,
              " must be a multiple of the group size ", group_size, ", itself a multiple of 32");
  const int64_t nblocks = (n + kRows - 1) / kRows, groups = k / group_size;
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.numel() == nblocks * k * 8,
              "anychip: weight must be the route's prepared uint8 layout for N=", n, " K=", k,
              " (blocked (N/16, K/8, 64); pair (N/16, K/16, 128) for arm.i8mm); build it with "
              "anychip.kernels.prepare.prepare_w4a8");
  const bool bf16_scales = scales.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16_scales || scales.scalar_type() == at::kFloat) && scales.is_contiguous() &&
                  scales.numel() == nblocks * groups * kRows,
              "anychip: scales must be the prepared (N/16, K/G, 16) fp32 or bf16 layout");
  Problem p{};
  p.w = weight.data_ptr<uint8_t>();
  if (bf16_scales) {
    p.sw_bf16 = reinterpret_cast<const Bf16*>(scales.data_ptr<at::BFloat16>());
  } else {
    p.sw = scales.data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "anychip: bias must have N=", n, " elements, got ", bias->numel());
    p.bias = bias->data_ptr<float>();
  }
  p.m = m, p.n = n, p.k = k, p.groups = groups, p.group_size = group_size;
  return p;
}

c10::optional<at::Tensor> float_bias(const c10::optional<at::Tensor>& bias) {
  if (!bias.has_value()) return c10::nullopt;
  return bias->to(at::kFloat).contiguous();  // a no-op for an fp32 bias
}

// ---------------------------------------------------------------- the ops' CPU kernels

// A route this extension does not implement (the torch reference, arm.kleidiai; a CUDA route given CPU tensors): the
// op's Python twin anychip::<op>_torch (kernels/ops.py) hands the call to the route object, which refuses what it
// cannot serve.  Never another route: strict routing stays with the route the weights were prepared for.
template <typename Sig, typename... Args>
auto call_twin(const char* op, int64_t route, Args&&... args) {
  const auto handle = c10::Dispatcher::singleton().findSchema({op, ""});
  TORCH_CHECK(handle.has_value(), "anychip: route code ", route, " is not one of the C++ extension's and ", op,
              " is not registered: import anychip.kernels.ops first (it registers the Python routes)");
  return handle->typed<Sig>().call(std::forward<Args>(args)...);
}

// Per-token INT8 of x's rows at SIMD level `level` (quant_simd()'s scale).
std::tuple<at::Tensor, at::Tensor> quantize_at(const at::Tensor& x_in, int level) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.device().is_cpu(), "anychip quantize_act wants a CPU (..., K) tensor");
  const int64_t k = x_in.size(-1);
  const at::Tensor x = x_in.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({m, 1}, x.options().dtype(at::kFloat));
  int8_t* q = xq.data_ptr<int8_t>();
  float* s = sx.data_ptr<float>();
  with_x(x.scalar_type(), x.data_ptr(), [&](const auto* xs) {
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) quantize_row(xs + r * k, k, q + r * k, s + r, level);
    });
  });
  return {xq, sx};
}

std::tuple<at::Tensor, at::Tensor> quantize_act(const at::Tensor& x_in) { return quantize_at(x_in, quant_simd()); }

// The linear of float x after `pre` (pre_ops.h; none for w4a8_linear itself), computed while its rows are
// quantized; the fused ops (the plugin's graph pass puts them where vLLM's norm or SiluAndMul feeds one W4A8 linear)
// flag their layer with `fused`.  x: contiguous (..., K), or (..., 2K) for SiluAndMul; the output (..., N) in x's
// dtype.
at::Tensor linear_of(const at::Tensor& xc, const PreArgs& pre, int64_t k, const at::Tensor& weight,
                     const at::Tensor& scales, const c10::optional<at::Tensor>& bias, int64_t n, int64_t group_size,
                     int64_t isa, const c10::optional<at::Tensor>& layer_id, uint8_t fused) {
  const int64_t m = xc.numel() / xc.size(-1);
  const c10::optional<at::Tensor> b = float_bias(bias);
  Problem p = weight_problem(weight, scales, b, m, n, k, group_size);
  const int64_t layer = layer_index(layer_id);
  count_call(layer, m);
  note_fused(layer, fused);
  at::DimVector shape(xc.sizes());
  shape.back() = n;
  at::Tensor out = at::empty(shape, xc.options());
  p.out = out.data_ptr();
  p.out_type = out_type(xc.scalar_type());
  Acts a;
  a.x = xc.data_ptr();
  a.x_type = xc.scalar_type();
  a.pre = pre;
  run_op<false>(p, isa, a);
  return out;
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t n, int64_t k, int64_t group_size,
                       int64_t route, const c10::optional<at::Tensor>& layer_id) {
  const int64_t isa = route_isa(route);
  if (isa < 0)
    return call_twin<decltype(w4a8_linear)>("anychip::w4a8_linear_torch", route, x, weight, scales, bias, n, k,
                                            group_size, route, layer_id);
  check_isa(isa);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "anychip w4a8_linear: x must be (..., K=", k, "), got ", x.sizes());
  return linear_of(x.contiguous(), PreArgs{}, k, weight, scales, bias, n, group_size, isa, layer_id, 0);
}

at::Tensor w4a8_linear_q(const at::Tensor& xq_in, const at::Tensor& sx_in, const at::Tensor& weight,
                         const at::Tensor& scales, const c10::optional<at::Tensor>& bias, int64_t n, int64_t k,
                         int64_t group_size, int64_t route, const c10::optional<at::Tensor>& layer_id,
                         at::ScalarType out_dtype) {
  const int64_t isa = route_isa(route);
  if (isa < 0)
    return call_twin<decltype(w4a8_linear_q)>("anychip::w4a8_linear_q_torch", route, xq_in, sx_in, weight, scales,
                                              bias, n, k, group_size, route, layer_id, out_dtype);
  check_isa(isa);
  TORCH_CHECK(xq_in.dim() == 2 && xq_in.scalar_type() == at::kChar && xq_in.size(1) == k,
              "anychip w4a8_linear_q: xq must be (M, K=", k, ") int8, got ", xq_in.scalar_type(), " ", xq_in.sizes());
  const at::Tensor xq = xq_in.contiguous();
  const at::Tensor sx = sx_in.to(at::kFloat).contiguous();
  const int64_t m = xq.size(0);
  TORCH_CHECK(sx.numel() == m, "anychip w4a8_linear_q: sx must be (M=", m, ", 1), got ", sx_in.sizes());
  const c10::optional<at::Tensor> b = float_bias(bias);
  Problem p = weight_problem(weight, scales, b, m, n, k, group_size);
  count_call(layer_index(layer_id), m);
  at::Tensor out = at::empty({m, n}, xq.options().dtype(out_dtype));
  p.out = out.data_ptr();
  p.out_type = out_type(out_dtype);
  Acts a;
  a.xq = xq.data_ptr<int8_t>();
  a.sx = sx.data_ptr<float>();
  run_op<false>(p, isa, a);
  return out;
}

// An RMSNorm's operands checked against x (..., K) and held contiguous while `pre` points into them; residual_out:
// where fused_add_rms_norm's new residual goes (empty without a residual).
struct NormOperands {
  at::Tensor weight, residual, residual_out;
  PreArgs pre;

  NormOperands(const at::Tensor& x, const c10::optional<at::Tensor>& r, const at::Tensor& norm_weight, double eps,
               const char* op) {
    const int64_t k = x.size(-1);
    TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == k && norm_weight.scalar_type() == x.scalar_type(),
                op, ": norm_weight must be (K=", k, ") in x's dtype ", x.scalar_type(), ", got ",
                norm_weight.scalar_type(), " ", norm_weight.sizes());
    weight = norm_weight.contiguous();
    residual_out = at::empty({0}, x.options());
    pre.op = PreOp::kRmsNorm;
    pre.norm_weight = weight.data_ptr();
    pre.eps = static_cast<float>(eps);
    if (r.has_value()) {
      TORCH_CHECK(r->sizes() == x.sizes() && r->scalar_type() == x.scalar_type(), op,
                  ": the residual must be x's shape and dtype, got ", r->scalar_type(), " ", r->sizes());
      residual = r->contiguous();
      residual_out = at::empty(x.sizes(), x.options());
      pre.residual = residual.data_ptr();
      pre.residual_out = residual_out.data_ptr();
    }
  }
};

std::tuple<at::Tensor, at::Tensor> w4a8_linear_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                    const at::Tensor& norm_weight, double eps,
                                                    const at::Tensor& weight, const at::Tensor& scales,
                                                    const c10::optional<at::Tensor>& bias, int64_t n, int64_t k,
                                                    int64_t group_size, int64_t route,
                                                    const c10::optional<at::Tensor>& layer_id) {
  const int64_t isa = route_isa(route);
  if (isa < 0)
    return call_twin<decltype(w4a8_linear_norm)>("anychip::w4a8_linear_norm_torch", route, x, residual, norm_weight,
                                                 eps, weight, scales, bias, n, k, group_size, route, layer_id);
  check_isa(isa);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "anychip w4a8_linear_norm: x must be (..., K=", k, "), got ",
              x.sizes());
  const NormOperands norm(x, residual, norm_weight, eps, "anychip w4a8_linear_norm");
  at::Tensor y = linear_of(x.contiguous(), norm.pre, k, weight, scales, bias, n, group_size, isa, layer_id, kFusedNorm);
  return {y, norm.residual_out};
}

at::Tensor w4a8_linear_silu_mul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                                const c10::optional<at::Tensor>& bias, int64_t n, int64_t k, int64_t group_size,
                                int64_t route, const c10::optional<at::Tensor>& layer_id) {
  const int64_t isa = route_isa(route);
  if (isa < 0)
    return call_twin<decltype(w4a8_linear_silu_mul)>("anychip::w4a8_linear_silu_mul_torch", route, x, weight, scales,
                                                     bias, n, k, group_size, route, layer_id);
  check_isa(isa);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == 2 * k, "anychip w4a8_linear_silu_mul: x must be (..., 2K=", 2 * k,
              "), got ", x.sizes());
  PreArgs pre;
  pre.op = PreOp::kSiluMul;
  return linear_of(x.contiguous(), pre, k, weight, scales, bias, n, group_size, isa, layer_id, kFusedSiluMul);
}

// Debug: the exact (M, N, K/G) int32 group dot products, through the same tile kernels.
at::Tensor w4a8_group_dots(const at::Tensor& xq_in, const at::Tensor& weight, const at::Tensor& scales, int64_t n,
                           int64_t k, int64_t group_size, int64_t route) {
  const int64_t isa = route_isa(route);
  if (isa < 0)
    return call_twin<decltype(w4a8_group_dots)>("anychip::w4a8_group_dots_torch", route, xq_in, weight, scales, n, k,
                                                group_size, route);
  check_isa(isa);
  TORCH_CHECK(xq_in.dim() == 2 && xq_in.scalar_type() == at::kChar && xq_in.size(1) == k,
              "anychip w4a8_group_dots: xq must be (M, K=", k, ") int8");
  const at::Tensor xq = xq_in.contiguous();
  Problem p = weight_problem(weight, scales, c10::nullopt, xq.size(0), n, k, group_size);
  at::Tensor out = at::empty({p.m, n, p.groups}, xq.options().dtype(at::kInt));
  p.out = out.data_ptr();
  p.out_type = OutType::kI32;
  Acts a;
  a.xq = xq.data_ptr<int8_t>();
  run_op<true>(p, isa, a);
  return out;
}

// ---------------------------------------------------------------- module functions (control plane, not per call)

// Debug: the fused ops' pre-op values (M, K) fp32 (each a value of x's dtype) and new residual, at SIMD level
// `level` (quant_simd()'s scale: 0 scalar, 1 AVX2 or NEON, 2 AVX512; capped at this CPU's), so tests can check
// every path the CPU has against the reference.  op: 1 RMSNorm (norm_weight, eps, residual optional), 2 SiluAndMul.
std::tuple<at::Tensor, at::Tensor> pre_values(const at::Tensor& x_in, const c10::optional<at::Tensor>& residual,
                                              const c10::optional<at::Tensor>& norm_weight, double eps, int64_t op,
                                              int64_t level) {
  TORCH_CHECK(op == 1 || op == 2, "pre_values: op must be 1 (RMSNorm) or 2 (SiluAndMul)");
  const at::Tensor x = x_in.contiguous();
  const int64_t k = op == 2 ? x.size(-1) / 2 : x.size(-1), m = x.numel() / x.size(-1);
  TORCH_CHECK(op == 2 || norm_weight.has_value(), "pre_values: RMSNorm needs a norm_weight");
  std::optional<NormOperands> norm;
  PreArgs pre;
  pre.op = PreOp::kSiluMul;
  if (op == 1) {
    norm.emplace(x, residual, *norm_weight, eps, "pre_values");
    pre = norm->pre;
  }
  at::Tensor v = at::empty({m, k}, x.options().dtype(at::kFloat));
  const int lvl = static_cast<int>(std::min<int64_t>(level, quant_simd()));
  with_x(x.scalar_type(), x.data_ptr(), [&](const auto* xs) {
    for (int64_t row = 0; row < m; ++row) pre_row(pre, xs, row, k, v.data_ptr<float>() + row * k, lvl);
  });
  return {v, norm ? norm->residual_out : at::empty({0}, x.options())};
}

// Debug: quantize_act at SIMD level `level` (as pre_values; capped at this CPU's), so tests check every path.
std::tuple<at::Tensor, at::Tensor> quantize_at_level(const at::Tensor& x, int64_t level) {
  return quantize_at(x, static_cast<int>(std::min<int64_t>(level, quant_simd())));
}

int64_t read_bytes(const at::Tensor& buf) {
  TORCH_CHECK(buf.is_contiguous() && buf.scalar_type() == at::kByte, "read_bytes wants contiguous uint8");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t pages = buf.numel() / 4096;
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, pages, 64, [&](int64_t b, int64_t e) { total ^= xor_range_best(p + b * 4096, (e - b) * 4096); });
  return static_cast<int64_t>(total.load() & 0x7FFFFFFF);
}

std::vector<std::string> cpu_isas() {
  int64_t isas[kIsaCount];
  const int n = supported_isas(isas);
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(isa_name(isas[i]));
  return out;
}

std::vector<std::string> route_ids() {
  std::vector<std::string> out;
  for (int64_t isa = 0; isa < kIsaCount; ++isa) out.push_back(isa_route_id(isa));
  return out;
}

// ---------------------------------------------------------------- transparent huge pages (load time)
// A decode step streams every weight once, and with 4 KB pages each page is a TLB miss and a point where the
// hardware prefetchers stop.  Backed by 2 MB pages, the 120 SmolLM2 linears ran 17-19% faster and the BF16 head
// 15-18% (2 threads, the 2-core EPYC, the two layouts alternating in one process).  Linux only; elsewhere, or where
// the kernel refuses, the memory is ordinary pages.
constexpr int64_t kHugePage = 2 << 20;

// An uninitialized (nbytes,) uint8 tensor whose memory starts on a 2 MB boundary and is advised MADV_HUGEPAGE
// before its first touch, so its pages fault in as huge pages (where the system has them).
at::Tensor huge_empty(int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "huge_empty: nbytes must be positive, got ", nbytes);
  const int64_t size = (nbytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = std::aligned_alloc(kHugePage, size);
  TORCH_CHECK(p != nullptr, "huge_empty: could not allocate ", size, " bytes");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(p, size, MADV_HUGEPAGE);  // advice: a refusal leaves ordinary pages
#endif
  return at::from_blob(p, {nbytes}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
}

// Asks the kernel to back the 2 MB-aligned part of t's memory with huge pages now (MADV_COLLAPSE, Linux 6.1+), for
// a tensor that is already filled (the checkpoint's output head).  Returns the bytes collapsed, 0 where refused.
int64_t collapse_huge(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "collapse_huge wants a contiguous CPU tensor");
  const uintptr_t a = reinterpret_cast<uintptr_t>(t.data_ptr()), end = a + t.numel() * t.element_size();
  const uintptr_t lo = (a + kHugePage - 1) / kHugePage * kHugePage, hi = end / kHugePage * kHugePage;
  if (hi <= lo) return 0;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
  madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_COLLAPSE) == 0) return static_cast<int64_t>(hi - lo);
#endif
  return 0;
}

}  // namespace
}  // namespace anychip

TORCH_LIBRARY_IMPL(anychip, CPU, m) {
  m.impl("quantize_act", &anychip::quantize_act);
  m.impl("w4a8_linear", &anychip::w4a8_linear);
  m.impl("w4a8_linear_q", &anychip::w4a8_linear_q);
  m.impl("w4a8_group_dots", &anychip::w4a8_group_dots);
  m.impl("w4a8_linear_norm", &anychip::w4a8_linear_norm);
  m.impl("w4a8_linear_silu_mul", &anychip::w4a8_linear_silu_mul);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace anychip;
  m.doc() = "anychip W4A8 CPU kernels (the per-call ops are torch.ops.anychip.*, registered from C++)";
  m.def("quantize_act", &quantize_act, "per-token symmetric INT8: x (M, K) -> (xq int8, sx (M, 1) fp32)");
  m.def("read_bytes", &read_bytes, "streaming read (bandwidth probe)");
  m.def("cpu_isas", &cpu_isas, "ISAs this CPU and build support, best first");
  m.def("route_ids", &route_ids, "the route id of each ISA code, by code");
  m.def("huge_empty", &huge_empty, "uninitialized (nbytes,) uint8 on a 2 MB boundary, advised for huge pages");
  m.def("collapse_huge", &collapse_huge, "back a filled tensor's 2 MB-aligned part with huge pages; bytes done");
  m.def("amx_usable", &amx_usable, "whether this CPU and OS let route cpu.amx_int8 run (AMX-INT8 tiles)");
  m.def("quantize_at_level", &quantize_at_level,
        "debug: quantize_act at a SIMD level (0 scalar, 1 AVX2 or NEON, 2 AVX512; capped at this CPU's)");
  m.def("pre_values", &pre_values, "debug: the fused ops' RMSNorm / SiluAndMul values at a SIMD level");
  m.def("fused_layers", &fused_layers, "(layer id, bits: 1 RMSNorm, 2 SiluAndMul) of the layers whose fused ops ran");
  m.def("set_call_counts", &set_call_counts, "install (counts, slot) as the ops' coverage table (None, None: none); "
        "returns the previous pair");
  m.attr("ISA_PORTABLE") = int64_t(kPortable);
  m.attr("ISA_AVX2") = int64_t(kAvx2);
  m.attr("ISA_AVX512_VNNI") = int64_t(kAvx512Vnni);
  m.attr("ISA_ARM_DOTPROD") = int64_t(kArmDotprod);
  m.attr("ISA_ARM_I8MM") = int64_t(kArmI8mm);
  m.attr("ISA_AMX_INT8") = int64_t(kAmxInt8);
}
