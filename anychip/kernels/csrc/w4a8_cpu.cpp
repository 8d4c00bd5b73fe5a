// W4A8 linear for CPUs: INT4 weights (one fp32 scale per group of G input channels), dynamic per-token INT8
// activations, INT32 accumulation per group.  This file is the torch binding only; the arithmetic lives in the
// torch-free headers it includes (also built by the Arm test driver, tests/arm/driver.cpp):
//   cpu_common.h    ISA codes and their run-time check, 16-bit float bits
//   quantize_act.h  per-token INT8 activations, group sums, bandwidth probe
//   w4a8_tiles.h    the problem, the blocked weight layout, epilogues, the portable tile
//   w4a8_x86.h      AVX512-VNNI and AVX2 tiles          w4a8_arm.h  NEON dotprod and i8mm tiles
//   w4a8_run.h      dispatch and the threaded loop
// One translation unit serves every CPU of an architecture: the SIMD paths are compiled with function-level target
// attributes and chosen at run time.  The torch oracle is anychip/kernels/reference.py.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_common.h"
#include "quantize_act.h"
#include "w4a8_run.h"

namespace anychip {
namespace {

static_assert(sizeof(c10::BFloat16) == sizeof(Bf16) && sizeof(c10::Half) == sizeof(Fp16),
              "16-bit float layouts must match c10's");

// at::parallel_for as the kernel core's thread pool: `work` runs once per pool thread taking part.
struct TorchParallel {
  template <typename Work>
  void operator()(int64_t threads, Work&& work) const {
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { work(); });
  }
};

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int8_t* q, float* sx) {
  const bool simd = quant_simd();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row<T>(x + r * k, k, q + r * k, sx + r, simd);
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_act(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2, "anychip quantize_act wants (M, K), got ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({m, 1}, x.options().dtype(at::kFloat));
  int8_t* q = xq.data_ptr<int8_t>();
  float* s = sx.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat:
      quantize_rows(x.data_ptr<float>(), m, k, q, s);
      break;
    case at::kBFloat16:
      quantize_rows(reinterpret_cast<const Bf16*>(x.data_ptr<c10::BFloat16>()), m, k, q, s);
      break;
    case at::kHalf:
      quantize_rows(reinterpret_cast<const Fp16*>(x.data_ptr<c10::Half>()), m, k, q, s);
      break;
    default:
      TORCH_CHECK(false, "anychip quantize_act: activations must be fp32, bf16 or fp16, got ", x.scalar_type());
  }
  return {xq, sx};
}

// (M, K) int8 -> (M, K / G) int32 group sums
at::Tensor group_sums(const at::Tensor& xq, int64_t group_size) {
  const int64_t m = xq.size(0), k = xq.size(1), groups = k / group_size;
  at::Tensor out = at::empty({m, groups}, xq.options().dtype(at::kInt));
  const int8_t* q = xq.data_ptr<int8_t>();
  int32_t* o = out.data_ptr<int32_t>();
  at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) group_sums_row(q + r * k, k, group_size, o + r * groups);
  });
  return out;
}

int64_t read_bytes(const at::Tensor& buf) {
  TORCH_CHECK(buf.is_contiguous() && buf.scalar_type() == at::kByte, "read_bytes wants contiguous uint8");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t pages = buf.numel() / 4096;
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, pages, 64, [&](int64_t b, int64_t e) { total ^= xor_range_best(p + b * 4096, (e - b) * 4096); });
  return static_cast<int64_t>(total.load() & 0x7FFFFFFF);
}

void check_isa(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa < kIsaCount, "anychip: unknown ISA code ", isa);
  TORCH_CHECK(isa_supported(isa), "anychip: this CPU (or this build) lacks ISA ", isa_name(isa), " (code ", isa,
              "); unset ANYCHIP_KERNEL_ISA or pick a route that `anychip routes` lists as available");
}

OutType out_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return OutType::kF32;
    case at::kBFloat16: return OutType::kBF16;
    case at::kHalf: return OutType::kF16;
    default: TORCH_CHECK(false, "anychip: output dtype must be fp32, bf16 or fp16, got ", t);
  }
}

// ---------------------------------------------------------------- torch-facing functions

Problem make_problem(const at::Tensor& xq, const at::Tensor& sx, const at::Tensor& xsum, const at::Tensor& weight,
                     const at::Tensor& scales, const c10::optional<at::Tensor>& bias, int64_t n, int64_t group_size) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.is_contiguous(), "anychip: xq must be (M, K) int8");
  const int64_t m = xq.size(0), k = xq.size(1);
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && k % group_size == 0, "anychip: K=", k,
              " must be a multiple of the group size ", group_size, ", itself a multiple of 32");
  const int64_t nblocks = (n + kRows - 1) / kRows, groups = k / group_size;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.numel() == nblocks * k * 8,
              "anychip: weight must be the route's prepared uint8 layout for N=", n, " K=", k,
              " (blocked (N/16, K/8, 64); pair (N/16, K/16, 128) for arm.i8mm); build it with "
              "anychip.kernels.prepare.prepare_w4a8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == nblocks * groups * kRows,
              "anychip: scales must be the prepared (N/16, K/G, 16) fp32 layout");
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sx.numel() == m && sx.is_contiguous(), "anychip: sx must be (M, 1) fp32");
  TORCH_CHECK(xsum.scalar_type() == at::kInt && xsum.numel() == m * groups, "anychip: bad group sums");
  Problem p{};
  p.xq = xq.data_ptr<int8_t>();
  p.sx = sx.data_ptr<float>();
  p.xsum = xsum.data_ptr<int32_t>();
  p.w = weight.data_ptr<uint8_t>();
  p.sw = scales.data_ptr<float>();
  p.bias = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "anychip: bias must be (N,) fp32 contiguous");
    p.bias = bias->data_ptr<float>();
  }
  p.m = m;
  p.n = n;
  p.k = k;
  p.groups = groups;
  p.group_size = group_size;
  return p;
}

// Pre-quantized activations -> (M, N) in out_dtype.
at::Tensor linear_q(const at::Tensor& xq_in, const at::Tensor& sx_in, const at::Tensor& weight, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& bias_in, int64_t n, int64_t group_size, int64_t isa,
                    at::ScalarType out_dtype) {
  check_isa(isa);
  const at::Tensor xq = xq_in.contiguous();
  const at::Tensor sx = sx_in.to(at::kFloat).contiguous();
  c10::optional<at::Tensor> bias;
  if (bias_in.has_value()) bias = bias_in->to(at::kFloat).contiguous();
  const at::Tensor xsum = group_sums(xq, group_size);
  Problem p = make_problem(xq, sx, xsum, weight, scales, bias, n, group_size);
  at::Tensor out = at::empty({p.m, n}, xq.options().dtype(out_dtype));
  p.out = out.data_ptr();
  p.out_type = out_type(out_dtype);
  if (p.m) run<false>(p, isa, at::get_num_threads(), TorchParallel{});
  return out;
}

// x (M, K) float -> quantize once -> (M, N) in x's dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& bias, int64_t n, int64_t group_size, int64_t isa) {
  auto [xq, sx] = quantize_act(x);
  return linear_q(xq, sx, weight, scales, bias, n, group_size, isa, x.scalar_type());
}

// Debug: the exact (M, N, K/G) int32 group dot products, through the same tile kernels.
at::Tensor group_dots(const at::Tensor& xq_in, const at::Tensor& weight, const at::Tensor& scales, int64_t n,
                      int64_t group_size, int64_t isa) {
  check_isa(isa);
  const at::Tensor xq = xq_in.contiguous();
  const at::Tensor sx = at::ones({xq.size(0), 1}, xq.options().dtype(at::kFloat));
  const at::Tensor xsum = group_sums(xq, group_size);
  Problem p = make_problem(xq, sx, xsum, weight, scales, c10::nullopt, n, group_size);
  at::Tensor out = at::empty({p.m, n, p.groups}, xq.options().dtype(at::kInt));
  p.out = out.data_ptr();
  p.out_type = OutType::kI32;
  if (p.m) run<true>(p, isa, at::get_num_threads(), TorchParallel{});
  return out;
}

std::vector<std::string> cpu_isas() {
  int64_t isas[kIsaCount];
  const int n = supported_isas(isas);
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(isa_name(isas[i]));
  return out;
}

}  // namespace
}  // namespace anychip

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace anychip;
  m.doc() = "anychip W4A8 CPU kernels";
  m.def("quantize_act", &quantize_act, "per-token symmetric INT8: x (M, K) -> (xq int8, sx (M, 1) fp32)");
  m.def("linear", &linear, "W4A8 linear, quantizing x inside");
  m.def("linear_q", &linear_q, "W4A8 linear on pre-quantized activations");
  m.def("group_dots", &group_dots, "debug: exact (M, N, K/G) int32 group dot products");
  m.def("read_bytes", &read_bytes, "streaming read (bandwidth probe)");
  m.def("cpu_isas", &cpu_isas, "ISAs this CPU and build support, best first");
  m.attr("ISA_PORTABLE") = int64_t(kPortable);
  m.attr("ISA_AVX2") = int64_t(kAvx2);
  m.attr("ISA_AVX512_VNNI") = int64_t(kAvx512Vnni);
  m.attr("ISA_ARM_DOTPROD") = int64_t(kArmDotprod);
  m.attr("ISA_ARM_I8MM") = int64_t(kArmI8mm);
}
