// Dynamic per-token symmetric INT8 activations (and the benchmark's memory-bandwidth probe).
#pragma once

#include "cpu_common.h"

namespace anychip {

// ---------------------------------------------------------------- activation quantization
// Bit-exact with quantize_activations_ref: scale = amax / 127 in fp32, q = round_half_even(x / scale) (a true
// division, not a multiply by the reciprocal), clamped to [-127, 127]; an all-zero row gets scale 0 and q 0.

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

template <typename T>
void quantize_row_scalar(const T* x, int64_t k, int8_t* q, float* sx) {
  float amax = 0.f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(to_f(x[i])));
  const float s = amax / 127.f;
  *sx = s;
  if (!(s > 0.f)) {
    std::memset(q, 0, k);
    return;
  }
  for (int64_t i = 0; i < k; ++i) {
    const float v = std::nearbyint(to_f(x[i]) / s);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
}

#ifdef ANYCHIP_X86
template <typename T>
ANYCHIP_AVX512 inline __m512 load16(const T* x, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, x);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, x));
  }
}

template <typename T>
ANYCHIP_AVX512 void quantize_row_avx512(const T* x, int64_t k, int8_t* q, float* sx) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = k - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x + i, mask)));
  }
  const float amax = _mm512_reduce_max_ps(vmax);
  const float s = amax / 127.f;
  *sx = s;
  if (!(s > 0.f)) {
    std::memset(q, 0, k);
    return;
  }
  const __m512 vs = _mm512_set1_ps(s);
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
#endif

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int8_t* q, float* sx, bool simd) {
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
#ifdef ANYCHIP_X86
      if (simd) {
        quantize_row_avx512<T>(x + r * k, k, q + r * k, sx + r);
        continue;
      }
#endif
      quantize_row_scalar<T>(x + r * k, k, q + r * k, sx + r);
    }
  });
}

inline bool quant_simd() {
#ifdef ANYCHIP_X86
  static const bool ok = isa_supported(kAvx512Vnni);
  return ok;
#else
  return false;
#endif
}

// (M, K) int8 -> (M, K / G) int32 group sums
inline at::Tensor group_sums(const at::Tensor& xq, int64_t group_size) {
  const int64_t m = xq.size(0), k = xq.size(1), groups = k / group_size;
  at::Tensor out = at::empty({m, groups}, xq.options().dtype(at::kInt));
  const int8_t* q = xq.data_ptr<int8_t>();
  int32_t* o = out.data_ptr<int32_t>();
  at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* p = q + r * k + g * group_size;
        int32_t s = 0;
        for (int64_t i = 0; i < group_size; ++i) s += p[i];
        o[r * groups + g] = s;
      }
    }
  });
  return out;
}

inline std::tuple<at::Tensor, at::Tensor> quantize_act(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2, "anychip quantize_act wants (M, K), got ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({m, 1}, x.options().dtype(at::kFloat));
  const bool simd = quant_simd();
  switch (x.scalar_type()) {
    case at::kFloat:
      quantize_rows(x.data_ptr<float>(), m, k, xq.data_ptr<int8_t>(), sx.data_ptr<float>(), simd);
      break;
    case at::kBFloat16:
      quantize_rows(x.data_ptr<c10::BFloat16>(), m, k, xq.data_ptr<int8_t>(), sx.data_ptr<float>(), simd);
      break;
    case at::kHalf:
      quantize_rows(x.data_ptr<c10::Half>(), m, k, xq.data_ptr<int8_t>(), sx.data_ptr<float>(), simd);
      break;
    default:
      TORCH_CHECK(false, "anychip quantize_act: activations must be fp32, bf16 or fp16, got ", x.scalar_type());
  }
  return {xq, sx};
}

// Streaming read of a large buffer (the benchmark's memory bandwidth probe); returns a checksum.
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

inline int64_t read_bytes(const at::Tensor& buf) {
  TORCH_CHECK(buf.is_contiguous() && buf.scalar_type() == at::kByte, "read_bytes wants contiguous uint8");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t pages = buf.numel() / 4096;
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, pages, 64, [&](int64_t b, int64_t e) {
#ifdef ANYCHIP_X86
    if (quant_simd()) {
      total ^= xor_range_avx512(p + b * 4096, (e - b) * 4096);
      return;
    }
#endif
    total ^= xor_range(p + b * 4096, (e - b) * 4096);
  });
  return static_cast<int64_t>(total.load() & 0x7FFFFFFF);
}

}  // namespace anychip
