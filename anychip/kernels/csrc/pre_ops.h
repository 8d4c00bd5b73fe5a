// What vLLM computes ahead of a W4A8 linear, computed by the linear's own op instead (the plugin's graph pass,
// anychip/vllm_plugin/fusion.py, rewrites the pair into anychip::w4a8_linear_norm / w4a8_linear_silu_mul): one
// token's RMSNorm (with the residual add of fused_add_rms_norm) or SiluAndMul, as fp32 values that are each exactly
// a value of the activations' dtype T, which the row quantizer (quantize_act.h) then quantizes as it would T.
// Torch-free.  Numerics as anychip/kernels/reference.py defines them (rms_norm_ref, silu_and_mul_ref):
//   RMSNorm     h = x (+ r) in fp32; y = T(T(h * rstd) * w), rstd = 1 / sqrt(sum(h^2) / K + eps); residual T(h)
//   SiluAndMul  y = T(T(g / (1 + exp(-g))) * u) for the row's halves g = x[0, K), u = x[K, 2K)
// The sum of squares runs in another order than torch's, and exp is a polynomial within about 2 ulp of fp32's, so
// a rounded value can differ from torch's by one ulp of T; inputs whose squares sum exactly (small integers) give
// torch's bits.
#pragma once

#include "cpu_common.h"
#include "quantize_act.h"

#include <cmath>

namespace anychip {

enum class PreOp : int { kNone = 0, kRmsNorm = 1, kSiluMul = 2 };

// The op's operands besides x: the residual (or nullptr), the norm weight (K, in x's dtype), where the new
// residual goes (nullptr: nowhere), epsilon.  Rows are K apart (2K for SiluAndMul's x).
struct PreArgs {
  PreOp op = PreOp::kNone;
  const void* residual = nullptr;
  const void* norm_weight = nullptr;
  void* residual_out = nullptr;
  float eps = 0.f;
};

// ---------------------------------------------------------------- scalar (any CPU; the tails of the SIMD paths)

template <typename T>
inline float round_as(float v) {
  if constexpr (std::is_same_v<T, Bf16>) {
    return to_f(Bf16{bf16_bits(v)});
  } else if constexpr (std::is_same_v<T, Fp16>) {
    return to_f(Fp16{fp16_bits(v)});
  } else {
    return v;
  }
}

template <typename T>
inline T store_as(float v) {
  if constexpr (std::is_same_v<T, Bf16>) {
    return Bf16{bf16_bits(v)};
  } else if constexpr (std::is_same_v<T, Fp16>) {
    return Fp16{fp16_bits(v)};
  } else {
    return v;
  }
}

template <typename T>
inline float silu_mul_one(T g, T u) {
  const float a = to_f(g);
  return round_as<T>(round_as<T>(a / (1.f + std::exp(-a))) * to_f(u));
}

template <typename T>
inline float residual_sum(const T* x, const T* r, int64_t i) {
  return r ? to_f(x[i]) + to_f(r[i]) : to_f(x[i]);
}

// exp(x) = 2^n exp(f), x = n ln2 + f, |f| <= ln2 / 2 (ln2 in two parts, so n ln2 subtracts exactly), and
// exp(f) = 1 + f + f^2 P(f) with Cephes' expf polynomial P, highest power first.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#ifdef ANYCHIP_X86
// ---------------------------------------------------------------- AVX512

// exp(x) for 16 lanes, 2^n by scalef (which saturates to inf and 0 as exp does beyond fp32's range).
ANYCHIP_AVX512 inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), f);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// v rounded to T (nearest, ties to even) and back to fp32; finite v.
template <typename T>
ANYCHIP_AVX512 inline __m512 round_as_avx512(__m512 v) {
  if constexpr (std::is_same_v<T, Bf16>) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
  } else if constexpr (std::is_same_v<T, Fp16>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return v;
  }
}

template <typename T>
ANYCHIP_AVX512 inline void store16(T* dst, __m512 v, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(dst, mask, v);
  } else if constexpr (std::is_same_v<T, Bf16>) {
    const __m512i b = _mm512_srli_epi32(_mm512_castps_si512(round_as_avx512<Bf16>(v)), 16);
    _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(b));
  } else {
    _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

inline __mmask16 tail16(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

template <typename T>
ANYCHIP_AVX512 void silu_mul_avx512(const T* x, int64_t k, float* v) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = tail16(k - i);
    const __m512 g = load16(x + i, m), u = load16(x + k + i, m);
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = round_as_avx512<T>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    _mm512_mask_storeu_ps(v + i, m, round_as_avx512<T>(_mm512_mul_ps(s, u)));
  }
}

template <typename T>
ANYCHIP_AVX512 void rms_norm_avx512(const T* x, const T* r, const T* w, float eps, int64_t k, float* v, T* rout) {
  __m512 sq0 = _mm512_setzero_ps(), sq1 = sq0;
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = tail16(k - i);
    __m512 h = load16(x + i, m);
    if (r) h = _mm512_add_ps(h, load16(r + i, m));
    if (rout) store16(rout + i, h, m);
    _mm512_mask_storeu_ps(v + i, m, h);
    if ((i / 16) % 2) sq1 = _mm512_fmadd_ps(h, h, sq1);
    else sq0 = _mm512_fmadd_ps(h, h, sq0);
  }
  const float mean = _mm512_reduce_add_ps(_mm512_add_ps(sq0, sq1)) / float(k);
  const __m512 rstd = _mm512_set1_ps(1.f / std::sqrt(mean + eps));
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = tail16(k - i);
    const __m512 y = _mm512_mul_ps(round_as_avx512<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, v + i), rstd)),
                                   load16(w + i, m));
    _mm512_mask_storeu_ps(v + i, m, round_as_avx512<T>(y));
  }
}

// ---------------------------------------------------------------- AVX2 (fp16 takes the scalar path: no F16C here)

// exp(x) for 8 lanes, 2^n built in the exponent bits (x clamped so that 2^n stays a normal number).
ANYCHIP_AVX2 inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), f);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

template <typename T>
ANYCHIP_AVX2 inline __m256 round_as_avx2(__m256 v) {
  if constexpr (std::is_same_v<T, Bf16>) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
  } else {
    return v;
  }
}

template <typename T>
ANYCHIP_AVX2 void silu_mul_avx2(const T* x, int64_t k, float* v) {
  const int64_t k8 = k / 8 * 8;
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < k8; i += 8) {
    const __m256 g = load8(x + i), u = load8(x + k + i);
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = round_as_avx2<T>(_mm256_div_ps(g, _mm256_add_ps(one, e)));
    _mm256_storeu_ps(v + i, round_as_avx2<T>(_mm256_mul_ps(s, u)));
  }
  for (int64_t i = k8; i < k; ++i) v[i] = silu_mul_one(x[i], x[k + i]);
}

template <typename T>
ANYCHIP_AVX2 void rms_norm_avx2(const T* x, const T* r, const T* w, float eps, int64_t k, float* v, T* rout) {
  const int64_t k8 = k / 8 * 8;
  __m256 sq0 = _mm256_setzero_ps(), sq1 = sq0;
  for (int64_t i = 0; i < k8; i += 8) {
    __m256 h = load8(x + i);
    if (r) h = _mm256_add_ps(h, load8(r + i));
    _mm256_storeu_ps(v + i, h);
    if ((i / 8) % 2) sq1 = _mm256_fmadd_ps(h, h, sq1);
    else sq0 = _mm256_fmadd_ps(h, h, sq0);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(sq0, sq1));
  float sum = 0.f;
  for (float l : lanes) sum += l;
  for (int64_t i = k8; i < k; ++i) {
    v[i] = residual_sum(x, r, i);
    sum += v[i] * v[i];
  }
  if (rout)
    for (int64_t i = 0; i < k; ++i) rout[i] = store_as<T>(v[i]);
  const float rstd = 1.f / std::sqrt(sum / float(k) + eps);
  const __m256 vr = _mm256_set1_ps(rstd);
  for (int64_t i = 0; i < k8; i += 8) {
    const __m256 y = _mm256_mul_ps(round_as_avx2<T>(_mm256_mul_ps(_mm256_loadu_ps(v + i), vr)), load8(w + i));
    _mm256_storeu_ps(v + i, round_as_avx2<T>(y));
  }
  for (int64_t i = k8; i < k; ++i) v[i] = round_as<T>(round_as<T>(v[i] * rstd) * to_f(w[i]));
}
#endif

template <typename T>
void silu_mul_scalar(const T* x, int64_t k, float* v) {
  for (int64_t i = 0; i < k; ++i) v[i] = silu_mul_one(x[i], x[k + i]);
}

template <typename T>
void rms_norm_scalar(const T* x, const T* r, const T* w, float eps, int64_t k, float* v, T* rout) {
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    v[i] = residual_sum(x, r, i);
    sum += v[i] * v[i];
    if (rout) rout[i] = store_as<T>(v[i]);
  }
  const float rstd = 1.f / std::sqrt(sum / float(k) + eps);
  for (int64_t i = 0; i < k; ++i) v[i] = round_as<T>(round_as<T>(v[i] * rstd) * to_f(w[i]));
}

// Row `row` of the pre-op over x (M rows of K, 2K for SiluAndMul) into v (K fp32 values, each a T), writing the
// row's new residual where args.residual_out is set.  level: quant_simd()'s.
template <typename T>
void pre_row(const PreArgs& a, const T* x, int64_t row, int64_t k, float* v, [[maybe_unused]] int level) {
  if (a.op == PreOp::kSiluMul) {
    const T* xr = x + row * 2 * k;
#ifdef ANYCHIP_X86
    if (level >= kQuantAvx512) return silu_mul_avx512(xr, k, v);
    if (level == kQuantSimd && !std::is_same_v<T, Fp16>) return silu_mul_avx2(xr, k, v);
#endif
    return silu_mul_scalar(xr, k, v);
  }
  const T* xr = x + row * k;
  const T* r = a.residual ? static_cast<const T*>(a.residual) + row * k : nullptr;
  T* rout = a.residual_out ? static_cast<T*>(a.residual_out) + row * k : nullptr;
  const T* w = static_cast<const T*>(a.norm_weight);
#ifdef ANYCHIP_X86
  if (level >= kQuantAvx512) return rms_norm_avx512(xr, r, w, a.eps, k, v, rout);
  if (level == kQuantSimd && !std::is_same_v<T, Fp16>) return rms_norm_avx2(xr, r, w, a.eps, k, v, rout);
#endif
  rms_norm_scalar(xr, r, w, a.eps, k, v, rout);
}

}  // namespace anychip
