// Causal attention for a step of prompts (prefill and its chunks; context in vLLM's paged KV cache), AVX2 + FMA.
//
// Where vLLM's CPU attention runs its generic "vec" kernels on an AVX2-only x86 (no AVX512), a 512-token prefill of
// SmolLM2-135M spent about a quarter of its time there, much of it in scalar libm expf (perf, session 21). This
// kernel computes the same function from the step's own q, k, v (BF16, any row strides): fp32 arithmetic
// throughout, an online softmax in base 2 (scores scaled by scale * log2(e), exp2 as a degree-6 polynomial,
// relative error about 1e-7), BF16 output rounded to nearest even. Not bit-identical to vLLM's kernel (another
// summation order, another exp), so it is a route of its own that the coverage report names. Keys and values come
// from the step's k, v (a step of fresh prompts) or from vLLM's paged cache (any step: each sequence's context,
// chunked-prefill chunks and prefix-cache hits included), after the step's own were written there.
//
// Work: keys and values of each KV head are first converted to fp32 once (keys transposed in blocks of 16, so the
// score tile reads them as vectors); then items (sequence, query head, block of 6 query rows) are taken from a
// shared counter, most expensive first, by every thread. Per item: scores of 6 rows x 16 keys a tile (12 fp32
// accumulators), masked on the diagonal blocks, then P V into the rows' fp32 accumulators.
#pragma once

#include "cpu_common.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

namespace anychip {

struct PrefillAttention {
  const uint16_t* q = nullptr;  // BF16 bits, (T, H, D): element (t, h, d) at q[t * q_t + h * q_h + d]
  int64_t q_t = 0, q_h = 0;
  const uint16_t* k = nullptr;  // (T, Hkv, D)
  int64_t k_t = 0, k_h = 0;
  const uint16_t* v = nullptr;  // (T, Hkv, D)
  int64_t v_t = 0, v_h = 0;
  uint16_t* out = nullptr;  // (T, H, D)
  int64_t o_t = 0, o_h = 0;
  std::vector<int64_t> starts;  // nseq + 1 offsets of the step's (query) rows
  int64_t heads = 0, kv_heads = 0, dim = 0;
  float scale = 1.0f;
  // Keys and values from vLLM's paged cache instead of k, v (which then go unread): every sequence's context and the
  // step's own rows, written there before the call. Element (block b, KV head g, slot j, d) at
  // kc[b * c_b + g * c_h + j * c_j + d] (vc likewise); a sequence's block i is block_table[s * bt_s + i].
  const uint16_t* kc = nullptr;
  const uint16_t* vc = nullptr;
  int64_t c_b = 0, c_h = 0, c_j = 0, block = 0;
  const int32_t* block_table = nullptr;
  int64_t bt_s = 0;
  std::vector<int64_t> context;  // per sequence: tokens before the step's rows (0 when reading k, v)

  int64_t ctx(int64_t s) const { return context.empty() ? 0 : context[s]; }
  const uint16_t* key_row(int64_t s, int64_t pos, int64_t g) const {
    if (!kc) return k + (starts[s] + pos) * k_t + g * k_h;
    return kc + block_table[s * bt_s + pos / block] * c_b + g * c_h + (pos % block) * c_j;
  }
  const uint16_t* value_row(int64_t s, int64_t pos, int64_t g) const {
    if (!vc) return v + (starts[s] + pos) * v_t + g * v_h;
    return vc + block_table[s * bt_s + pos / block] * c_b + g * c_h + (pos % block) * c_j;
  }
};

constexpr int64_t kAttnRows = 6;    // query rows a tile
constexpr int64_t kAttnKeys = 16;   // keys a tile
constexpr int64_t kAttnMaxDim = 256;

// Whether this build and CPU run the kernel, and a head dimension it takes.
inline bool prefill_attention_supported(int64_t dim) {
#ifdef ANYCHIP_X86
  return isa_supported(kAvx2) && dim > 0 && dim % 8 == 0 && dim <= kAttnMaxDim;
#else
  (void)dim;
  return false;
#endif
}

#ifdef ANYCHIP_X86

ANYCHIP_AVX2 inline __m256 bf16x8_to_f32(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 2^x for x <= 128; 0 where x < -126 (a masked score is -inf).
ANYCHIP_AVX2 inline __m256 exp2_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-126.0f);
  const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);  // false for x < -126 and for -inf / NaN
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(127.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);  // [-0.5, 0.5]
  __m256 p = _mm256_set1_ps(1.5403530393381609e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), zero_mask);
}

ANYCHIP_AVX2 inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

ANYCHIP_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// s (6 x 16) = q (6 x D, row stride D) . kt (D x 16)
ANYCHIP_AVX2 inline void score_tile(const float* q, const float* kt, int64_t dim, float* s) {
  __m256 a[kAttnRows][2];
  for (int r = 0; r < kAttnRows; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m256 k0 = _mm256_load_ps(kt + d * kAttnKeys), k1 = _mm256_load_ps(kt + d * kAttnKeys + 8);
    for (int r = 0; r < kAttnRows; ++r) {
      const __m256 b = _mm256_broadcast_ss(q + r * dim + d);
      a[r][0] = _mm256_fmadd_ps(b, k0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(b, k1, a[r][1]);
    }
  }
  for (int r = 0; r < kAttnRows; ++r) {
    _mm256_store_ps(s + r * kAttnKeys, a[r][0]);
    _mm256_store_ps(s + r * kAttnKeys + 8, a[r][1]);
  }
}

// o[r][d0 .. d0 + 8 NV) += sum over keys j < nk of p[r][j] * v[j][d0 ..], for rows r0 .. r0 + 3
template <int NV>
ANYCHIP_AVX2 inline void pv_part(const float* p, const float* v, int64_t vstride, int64_t nk, float* o, int64_t dim,
                                 int64_t r0, int64_t d0) {
  __m256 acc[3][NV];
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm256_load_ps(o + (r0 + r) * dim + d0 + 8 * i);
  for (int64_t j = 0; j < nk; ++j) {
    __m256 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = _mm256_load_ps(v + j * vstride + d0 + 8 * i);
    for (int r = 0; r < 3; ++r) {
      const __m256 b = _mm256_broadcast_ss(p + (r0 + r) * kAttnKeys + j);
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm256_fmadd_ps(b, vv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < NV; ++i) _mm256_store_ps(o + (r0 + r) * dim + d0 + 8 * i, acc[r][i]);
}

ANYCHIP_AVX2 inline void pv_tile(const float* p, const float* v, int64_t nk, float* o, int64_t dim) {
  for (int64_t r0 = 0; r0 < kAttnRows; r0 += 3) {
    int64_t d0 = 0;
    for (; d0 + 32 <= dim; d0 += 32) pv_part<4>(p, v, dim, nk, o, dim, r0, d0);
    switch ((dim - d0) / 8) {
      case 3: pv_part<3>(p, v, dim, nk, o, dim, r0, d0); break;
      case 2: pv_part<2>(p, v, dim, nk, o, dim, r0, d0); break;
      case 1: pv_part<1>(p, v, dim, nk, o, dim, r0, d0); break;
      default: break;
    }
  }
}

inline uint16_t bf16_round(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Converts one KV head's keys and values of sequence s (its `len` positions: context, then the step's rows) to
// fp32: kt blocks of (D x 16), zero past the end; v rows (D).
ANYCHIP_AVX2 inline void convert_kv(const PrefillAttention& a, int64_t g, int64_t s, int64_t len, float* kt, float* v) {
  const int64_t dim = a.dim;
  for (int64_t b = 0; b * kAttnKeys < len; ++b) {
    float* blk = kt + b * dim * kAttnKeys;
    for (int64_t j = 0; j < kAttnKeys; ++j) {
      const int64_t t = b * kAttnKeys + j;
      if (t >= len) {
        for (int64_t d = 0; d < dim; ++d) blk[d * kAttnKeys + j] = 0.0f;
        continue;
      }
      const uint16_t* src = a.key_row(s, t, g);
      for (int64_t d = 0; d < dim; ++d) blk[d * kAttnKeys + j] = f32_from_bits(uint32_t(src[d]) << 16);
    }
  }
  for (int64_t t = 0; t < len; ++t) {
    const uint16_t* src = a.value_row(s, t, g);
    for (int64_t d = 0; d < dim; d += 8) _mm256_store_ps(v + t * dim + d, bf16x8_to_f32(src + d));
  }
}

// One item: query head h, the step's rows [r0, r0 + 6) of sequence s (at positions ctx + r0 ..), against keys
// 0 .. the last row's position.
ANYCHIP_AVX2 inline void attend_rows(const PrefillAttention& a, int64_t s, int64_t h, int64_t r0, const float* kt,
                                     const float* v) {
  const int64_t dim = a.dim, t0 = a.starts[s], len = a.starts[s + 1] - t0, ctx = a.ctx(s);
  const int64_t rows = std::min<int64_t>(kAttnRows, len - r0);
  alignas(32) float q[kAttnRows * kAttnMaxDim];
  alignas(32) float o[kAttnRows * kAttnMaxDim];
  alignas(32) float p[kAttnRows * kAttnKeys];
  float m[kAttnRows], l[kAttnRows];
  const __m256 qscale = _mm256_set1_ps(a.scale * 1.4426950408889634f);  // log2(e): softmax in base 2
  for (int64_t r = 0; r < kAttnRows; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
    for (int64_t d = 0; d < dim; d += 8) {
      _mm256_store_ps(o + r * dim + d, _mm256_setzero_ps());
      const __m256 x = r < rows ? _mm256_mul_ps(bf16x8_to_f32(a.q + (t0 + r0 + r) * a.q_t + h * a.q_h + d), qscale)
                                : _mm256_setzero_ps();
      _mm256_store_ps(q + r * dim + d, x);
    }
  }
  const int64_t first = ctx + r0, last = first + rows - 1;  // the rows' positions: keys 0 .. last
  for (int64_t k0 = 0; k0 <= last; k0 += kAttnKeys) {
    score_tile(q, kt + (k0 / kAttnKeys) * dim * kAttnKeys, dim, p);
    const int64_t nk = std::min<int64_t>(kAttnKeys, last + 1 - k0);
    for (int64_t r = 0; r < kAttnRows; ++r) {
      float* pr = p + r * kAttnKeys;
      const int64_t visible = std::clamp<int64_t>(first + r - k0 + 1, 0, kAttnKeys);  // causal: keys <= row
      for (int64_t j = visible; j < kAttnKeys; ++j) pr[j] = -std::numeric_limits<float>::infinity();
      if (visible == 0) {  // a padding row past the sequence, or a row that sees none of this tile's keys
        for (int64_t j = 0; j < kAttnKeys; ++j) pr[j] = 0.0f;
        continue;
      }
      const __m256 s0 = _mm256_load_ps(pr), s1 = _mm256_load_ps(pr + 8);
      const float mx = std::max(m[r], hmax8(_mm256_max_ps(s0, s1)));
      const __m256 mv = _mm256_set1_ps(mx);
      const __m256 e0 = exp2_ps(_mm256_sub_ps(s0, mv)), e1 = exp2_ps(_mm256_sub_ps(s1, mv));
      _mm256_store_ps(pr, e0);
      _mm256_store_ps(pr + 8, e1);
      const float alpha = m[r] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp2(m[r] - mx);
      l[r] = l[r] * alpha + hsum8(_mm256_add_ps(e0, e1));
      m[r] = mx;
      if (alpha != 1.0f) {
        const __m256 av = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < dim; d += 8)
          _mm256_store_ps(o + r * dim + d, _mm256_mul_ps(_mm256_load_ps(o + r * dim + d), av));
      }
    }
    pv_tile(p, v + k0 * dim, nk, o, dim);
  }
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst = a.out + (t0 + r0 + r) * a.o_t + h * a.o_h;
    const float inv = 1.0f / l[r];
    for (int64_t d = 0; d < dim; ++d) dst[d] = bf16_round(o[r * dim + d] * inv);
  }
}

// Runs the step on `threads` threads through `parallel(threads, work)` (work() once on each).
template <typename Parallel>
void prefill_attention_avx2(const PrefillAttention& a, int64_t threads, Parallel&& parallel) {
  const int64_t nseq = int64_t(a.starts.size()) - 1, dim = a.dim, rep = a.heads / a.kv_heads;
  // fp32 keys (transposed blocks) and values of every (KV head, sequence), at offsets by sequence
  std::vector<int64_t> kt_off(nseq + 1, 0), v_off(nseq + 1, 0);
  const auto keys_of = [&](int64_t s) { return a.ctx(s) + a.starts[s + 1] - a.starts[s]; };
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t len = keys_of(s);
    kt_off[s + 1] = kt_off[s] + (len + kAttnKeys - 1) / kAttnKeys * kAttnKeys * dim;
    v_off[s + 1] = v_off[s] + len * dim;
  }
  thread_local std::vector<float> kt_buf, v_buf;
  kt_buf.resize(a.kv_heads * kt_off[nseq] + 8);
  v_buf.resize(a.kv_heads * v_off[nseq] + 8);
  float* kt_all = kt_buf.data() + (8 - reinterpret_cast<uintptr_t>(kt_buf.data()) / 4 % 8) % 8;
  float* v_all = v_buf.data() + (8 - reinterpret_cast<uintptr_t>(v_buf.data()) / 4 % 8) % 8;
  auto kt_of = [&](int64_t g, int64_t s) { return kt_all + g * kt_off[nseq] + kt_off[s]; };
  auto v_of = [&](int64_t g, int64_t s) { return v_all + g * v_off[nseq] + v_off[s]; };
  {
    std::atomic<int64_t> next{0};
    const int64_t n = a.kv_heads * nseq;
    parallel(threads, [&]() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        const int64_t g = i / nseq, s = i % nseq;
        convert_kv(a, g, s, keys_of(s), kt_of(g, s), v_of(g, s));
      }
    });
  }
  struct Item {
    int64_t cost, s, h, r0;
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t len = a.starts[s + 1] - a.starts[s];
    for (int64_t r0 = 0; r0 < len; r0 += kAttnRows)
      for (int64_t h = 0; h < a.heads; ++h) items.push_back({a.ctx(s) + r0 + kAttnRows, s, h, r0});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = int64_t(items.size());
  parallel(threads, [&]() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      const Item& it = items[i];
      const int64_t g = it.h / rep;
      attend_rows(a, it.s, it.h, it.r0, kt_of(g, it.s), v_of(g, it.s));
    }
  });
  // kept between calls (a prefill's layers allocate once), unless a long context made them large
  constexpr size_t kKeepFloats = size_t(16) << 20;  // 64 MB of fp32 each
  if (kt_buf.capacity() > kKeepFloats) std::vector<float>().swap(kt_buf);
  if (v_buf.capacity() > kKeepFloats) std::vector<float>().swap(v_buf);
}

#endif  // ANYCHIP_X86

}  // namespace anychip
