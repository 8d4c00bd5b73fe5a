// Dynamic per-token symmetric INT8 activations, their group corrections, and the benchmark's bandwidth probe.
// Torch-free: the binding (w4a8_cpu.cpp) splits the rows over threads.
#pragma once

#include <limits>

#include "cpu_common.h"

namespace anychip {

// ---------------------------------------------------------------- activation quantization
// Bit-exact with quantize_activations_ref: scale = amax / 127 in fp32, q = round_half_even(x / scale) (a true
// division, not a multiply by the reciprocal), clamped to [-127, 127]; an all-zero row gets scale 0 and q 0; a row
// holding NaN or inf gets scale NaN and q 0, so that each of its outputs is NaN (not finite values from clamped
// codes).

// The scalar pieces every row quantizer shares: the amax of x[i0, k) (NaN once a NaN is seen: std::max drops it),
// the row's scale (false, with q zeroed, for an all-zero or non-finite row), and the quantization of x[i0, k)
// with scale s.
template <typename T>
inline float amax_from(const T* x, int64_t i0, int64_t k, float amax) {
  for (int64_t i = i0; i < k; ++i) {
    const float a = std::fabs(to_f(x[i]));
    amax = (a != a || amax != amax) ? a + amax : std::max(amax, a);
  }
  return amax;
}

inline bool row_scale(float amax, int64_t k, int8_t* q, float* sx) {
  float s = amax / 127.f;
  if (!(s <= std::numeric_limits<float>::max())) s = std::numeric_limits<float>::quiet_NaN();  // NaN or inf
  *sx = s;
  if (s > 0.f) return true;
  std::memset(q, 0, k);
  return false;
}

template <typename T>
inline void quantize_from(const T* x, int64_t i0, int64_t k, float s, int8_t* q) {
  for (int64_t i = i0; i < k; ++i) {
    const float v = std::nearbyint(to_f(x[i]) / s);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
}

template <typename T>
void quantize_row_scalar(const T* x, int64_t k, int8_t* q, float* sx) {
  if (row_scale(amax_from(x, 0, k, 0.f), k, q, sx)) quantize_from(x, 0, k, *sx, q);
}

#ifdef ANYCHIP_X86
template <typename T>
ANYCHIP_AVX512 inline __m512 load16(const T* x, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, x);
  } else if constexpr (std::is_same_v<T, Bf16>) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, x));
  }
}

template <typename T>
ANYCHIP_AVX512 void quantize_row_avx512(const T* x, int64_t k, int8_t* q, float* sx) {
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 nan = 0;  // lanes that saw a NaN (max_ps drops it)
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = k - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1);
    const __m512 v = load16(x + i, mask);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
  }
  const float amax = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(vmax);
  if (!row_scale(amax, k, q, sx)) return;
  const __m512 vs = _mm512_set1_ps(*sx);
  const __m512 lim = _mm512_set1_ps(127.f);
  const __m512 nlim = _mm512_set1_ps(-127.f);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = k - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1);
    __m512 v = _mm512_div_ps(load16(x + i, mask), vs);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, nlim), lim);
    _mm512_mask_cvtsepi32_storeu_epi8(q + i, mask, _mm512_cvtps_epi32(v));
  }
}

// AVX2: 8 lanes, a true division and round-to-nearest-even per lane, as the scalar path; fp16 is widened with the
// exact scalar conversion (no F16C needed), the K % 8 tail runs the scalar formula.
template <typename T>
ANYCHIP_AVX2 inline __m256 load8(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(x);
  } else if constexpr (std::is_same_v<T, Bf16>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = to_f(x[i]);
    return _mm256_load_ps(f);
  }
}

template <typename T>
ANYCHIP_AVX2 void quantize_row_avx2(const T* x, int64_t k, int8_t* q, float* sx) {
  const int64_t k8 = k / 8 * 8;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();  // vnan: lanes that saw a NaN (max_ps drops it)
  for (int64_t i = 0; i < k8; i += 8) {
    const __m256 v = load8(x + i);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, abs_mask));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float head = _mm256_movemask_ps(vnan) ? std::numeric_limits<float>::quiet_NaN() : _mm_cvtss_f32(m4);
  if (!row_scale(amax_from(x, k8, k, head), k, q, sx)) return;
  const __m256 vs = _mm256_set1_ps(*sx), lim = _mm256_set1_ps(127.f), nlim = _mm256_set1_ps(-127.f);
  for (int64_t i = 0; i < k8; i += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(load8(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, nlim), lim);
    const __m256i w = _mm256_cvtps_epi32(v);  // exact: |v| <= 127
    const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(h, h));
  }
  quantize_from(x, k8, k, *sx, q);
}
#endif

#ifdef ANYCHIP_ARM
// Baseline NEON (every aarch64 CPU): fdiv and frintn (round to nearest even) per lane, as the scalar path.
template <typename T>
inline float32x4_t load4f(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return vld1q_f32(x);
  } else if constexpr (std::is_same_v<T, Bf16>) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(x)), 16));
  } else {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(x))));
  }
}

template <typename T>
void quantize_row_neon(const T* x, int64_t k, int8_t* q, float* sx) {
  const int64_t k4 = k / 4 * 4;
  float32x4_t vmax = vdupq_n_f32(0.f);
  for (int64_t i = 0; i < k4; i += 4) vmax = vmaxq_f32(vmax, vabsq_f32(load4f(x + i)));
  if (!row_scale(amax_from(x, k4, k, vmaxvq_f32(vmax)), k, q, sx)) return;
  const float32x4_t vs = vdupq_n_f32(*sx), lim = vdupq_n_f32(127.f), nlim = vdupq_n_f32(-127.f);
  for (int64_t i = 0; i < k4; i += 4) {
    float32x4_t v = vrndnq_f32(vdivq_f32(load4f(x + i), vs));
    v = vminq_f32(vmaxq_f32(v, nlim), lim);
    const int16x4_t h = vmovn_s32(vcvtq_s32_f32(v));  // exact: |v| <= 127
    const int8x8_t b = vmovn_s16(vcombine_s16(h, h));
    std::memcpy(q + i, &b, 4);
  }
  quantize_from(x, k4, k, *sx, q);
}
#endif

// Row quantizers, all bit-exact with the scalar one; quant_simd() is the fastest this CPU runs.
enum QuantLevel : int { kQuantScalar = 0, kQuantSimd = 1, kQuantAvx512 = 2 };  // kQuantSimd: AVX2 or NEON

inline int quant_simd() {
#ifdef ANYCHIP_X86
  static const int level = isa_supported(kAvx512Vnni) ? kQuantAvx512 : isa_supported(kAvx2) ? kQuantSimd : kQuantScalar;
  return level;
#elif defined(ANYCHIP_ARM)
  return kQuantSimd;
#else
  return kQuantScalar;
#endif
}

template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* sx, int level) {
#ifdef ANYCHIP_X86
  if (level >= kQuantAvx512) return quantize_row_avx512<T>(x, k, q, sx);
  if (level == kQuantSimd) return quantize_row_avx2<T>(x, k, q, sx);
#endif
#ifdef ANYCHIP_ARM
  if (level != kQuantScalar) return quantize_row_neon<T>(x, k, q, sx);
#endif
  quantize_row_scalar<T>(x, k, q, sx);
}

// One token's (K / G) int32 corrections for the +8 offset of the u4 weights: -8 x the sum of its int8 activations
// over each group, the value each group's dot starts from.  Stored ready to use, so a tile loads its start value
// with one broadcast from memory (-8 * sum in a tile cost a multiply and a broadcast from a general register: 3% of
// the AVX512 prefill GEMM, docs/kernels-cpu.md).
inline void group_corr_row(const int8_t* q, int64_t k, int64_t group_size, int32_t* out) {
  for (int64_t g = 0; g < k / group_size; ++g) {
    const int8_t* p = q + g * group_size;
    int32_t s = 0;
    for (int64_t i = 0; i < group_size; ++i) s += p[i];
    out[g] = -8 * s;
  }
}

// ---------------------------------------------------------------- bandwidth probe
// Streaming read of a large buffer; returns a checksum.
#ifdef ANYCHIP_X86
ANYCHIP_AVX512 inline uint64_t xor_range_avx512(const uint8_t* p, int64_t bytes) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 256 <= bytes; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  return static_cast<uint64_t>(_mm512_reduce_or_epi64(a0));
}

ANYCHIP_AVX2 inline uint64_t xor_range_avx2(const uint8_t* p, int64_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 128 <= bytes; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a0);
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
}
#endif

inline uint64_t xor_range(const uint8_t* p, int64_t bytes) {
  uint64_t a = 0;
  for (int64_t i = 0; i + 8 <= bytes; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    a ^= v;
  }
  return a;
}

inline uint64_t xor_range_best(const uint8_t* p, int64_t bytes) {
#ifdef ANYCHIP_X86
  if (quant_simd() == kQuantAvx512) return xor_range_avx512(p, bytes);
  if (quant_simd() == kQuantSimd) return xor_range_avx2(p, bytes);
#endif
  return xor_range(p, bytes);
}

}  // namespace anychip
