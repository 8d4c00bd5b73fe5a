// The output head (logits = x @ W^T) as a GEMV for CPUs, torch-free like the W4A8 core:
//   BF16 head  W (N, K) bf16 row-major, x bf16/fp32; products and sums in fp32 (BF16 x BF16, FP32 accumulation)
//     AVX512-BF16  vdpbf16ps on 32 bf16 pairs (x must be bf16)
//     AVX2         16 bf16 of a row as two fp32 vectors: evens = bits << 16, odds = bits & 0xFFFF0000, against x
//                  pre-split into its even and odd elements (head_split_x), so a row costs no shuffle
//     portable     scalar
//   INT8 head (opt-in)  W (N, K) int8, one fp32 scale per row; x per-token INT8 (quantize_act.h); exact INT32 dots
//     AVX512-VNNI  vpdpbusd(w ^ 0x80, x): the flipped sign bit reads w as the unsigned w + 128, so each dot is
//                  sum(w x) + 128 sum(x), and 128 sum(x) (per token, once per call) comes off: 3 operations per
//                  64 bytes of a row instead of 5 per 32
//     AVX2         vpmaddubsw(|w|, sign(x, w)): |w|, |x| <= 127, so a pair sum (<= 32258) cannot saturate
//     portable     scalar
// The head is read once per decode step (49152 x 576 x 2 bytes = 57 MB for SmolLM2), so it is bound by memory:
// threads take chunks of rows from a shared counter, and within a chunk a few rows stream side by side.
#pragma once

#include "cpu_common.h"

#ifdef ANYCHIP_X86
#define ANYCHIP_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace anychip {

// Head ISA codes (the Python head routes' `code`): separate from the W4A8 Isa enum, as the instruction sets differ.
enum HeadIsa : int64_t { kHeadPortable = 0, kHeadAvx2 = 1, kHeadAvx512Bf16 = 2, kHeadAvx512Vnni = 3 };
constexpr int64_t kHeadIsaCount = 4;

inline bool head_isa_supported(int64_t isa) {
#ifdef ANYCHIP_X86
  __builtin_cpu_init();
  if (isa == kHeadAvx512Bf16)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  // the INT8 and AVX2 tiles are built for the W4A8 kernels' targets (ANYCHIP_AVX512, ANYCHIP_AVX2): the same check
  if (isa == kHeadAvx512Vnni) return isa_supported(kAvx512Vnni);
  if (isa == kHeadAvx2) return isa_supported(kAvx2);
#endif
  return isa == kHeadPortable;
}

// Which kind of head an ISA code serves: AVX512-BF16 only the BF16 head, AVX512-VNNI only the INT8 one.
inline bool head_isa_serves(int64_t isa, bool int8) {
  return int8 ? isa != kHeadAvx512Bf16 : isa != kHeadAvx512Vnni;
}

struct HeadProblem {
  int64_t m = 0, n = 0, k = 0;
  // BF16 head
  const Bf16* w = nullptr;    // (N, K)
  const Bf16* xb = nullptr;   // (M, K) bf16, or nullptr when x is fp32 (AVX512-BF16 needs it)
  const float* xf = nullptr;  // (M, K) fp32; for AVX2 each full 16-block is split (head_split_x)
  // INT8 head
  const int8_t* wq = nullptr;  // (N, K)
  const float* sw = nullptr;   // (N,)
  const int8_t* xq = nullptr;  // (M, K)
  const float* sx = nullptr;   // (M,)
  const int32_t* xsum = nullptr;  // (M,) sum of each token's xq (the AVX512-VNNI tile's offset), else nullptr
  const float* bias = nullptr;  // (N,) or nullptr
  void* out = nullptr;          // (M, N)
  OutType out_type = OutType::kF32;
};

inline void head_store(const HeadProblem& p, int64_t m, int64_t n, float y) {
  if (p.bias) y += p.bias[n];
  const int64_t off = m * p.n + n;
  switch (p.out_type) {
    case OutType::kBF16: static_cast<uint16_t*>(p.out)[off] = bf16_bits(y); break;
    case OutType::kF16: static_cast<uint16_t*>(p.out)[off] = fp16_bits(y); break;
    default: static_cast<float*>(p.out)[off] = y;
  }
}

// x (K,) -> the AVX2 path's order: each full block of 16 as its 8 even then its 8 odd elements; the tail as is.
template <typename T>
void head_split_x(const T* x, int64_t k, float* out) {
  const int64_t k16 = k / 16 * 16;
  for (int64_t b = 0; b < k16; b += 16)
    for (int j = 0; j < 8; ++j) out[b + j] = to_f(x[b + 2 * j]), out[b + 8 + j] = to_f(x[b + 2 * j + 1]);
  for (int64_t i = k16; i < k; ++i) out[i] = to_f(x[i]);
}

// ---------------------------------------------------------------- portable

inline void bf16_rows_portable(const HeadProblem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const Bf16* w = p.w + n * p.k;
    for (int64_t m = 0; m < p.m; ++m) {
      const float* x = p.xf + m * p.k;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
      int64_t i = 0;
      for (; i + 4 <= p.k; i += 4)
        for (int j = 0; j < 4; ++j) s[j] += x[i + j] * to_f(w[i + j]);
      for (; i < p.k; ++i) s[0] += x[i] * to_f(w[i]);
      head_store(p, m, n, (s[0] + s[1]) + (s[2] + s[3]));
    }
  }
}

inline void int8_rows_portable(const HeadProblem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = p.wq + n * p.k;
    for (int64_t m = 0; m < p.m; ++m) {
      const int8_t* x = p.xq + m * p.k;
      int32_t s = 0;
      for (int64_t i = 0; i < p.k; ++i) s += int32_t(x[i]) * int32_t(w[i]);
      head_store(p, m, n, float(s) * (p.sx[m] * p.sw[n]));
    }
  }
}

// Software prefetch, ANYCHIP_HEAD_PREFETCH_TILES row tiles ahead of the one being read: a tile of R rows is R * K
// contiguous elements, and iteration `it` of a tile's K loop reads `step` bytes of it, so prefetching the same linear
// position that many tiles ahead keeps the stream that far in front.  Without it the hardware prefetchers left the
// AVX2 BF16 head at 14 GB/s of a 32-35 GB/s read bandwidth on the 2-core EPYC (2 threads); with it 22-26 GB/s.
// Into L2 (prefetcht1), not L1: on the 2-vCPU Xeon with AMX (session 35, docs/kernels-cpu.md) the BF16 head took
// 8% (AVX512) and 13-15% (AVX2) less time so, the INT8 head about the same; three tiles ahead did no better.
// Addresses past the end of the weight are harmless: prefetches never fault.
#ifndef ANYCHIP_HEAD_PREFETCH_TILES
#define ANYCHIP_HEAD_PREFETCH_TILES 2
#endif

inline void head_prefetch(const void* tile, int64_t tile_bytes, int64_t it, int64_t step) {
  if constexpr (ANYCHIP_HEAD_PREFETCH_TILES > 0) {
    const char* a = static_cast<const char*>(tile) + ANYCHIP_HEAD_PREFETCH_TILES * tile_bytes + it * step;
    for (int64_t j = 0; j < step; j += 64) __builtin_prefetch(a + j, 0, 2);
  }
}

#ifdef ANYCHIP_X86

ANYCHIP_AVX2 inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

ANYCHIP_AVX2 inline int32_t hsum_epi32_avx2(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// ---------------------------------------------------------------- BF16, AVX2 + FMA
// MT tokens x R rows. Every tile sums a (token, row) dot the same way, in one accumulator (even elements, then odd
// ones, a 16-block at a time), so a token's logits do not depend on how many tokens share the call or where it
// sits among them (batch invariance: a request's output does not change with what else is batched with it). One
// token takes 8 rows at a time (8 FMA chains, Bf16Avx2::rows).
template <int MT, int R>
ANYCHIP_AVX2 void bf16_tile_avx2(const HeadProblem& p, int64_t m0, int64_t n0) {
  const int64_t k16 = p.k / 16 * 16;
  const __m256i hi_mask = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  __m256 acc[MT][R];
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  const Bf16* w[R];
  for (int r = 0; r < R; ++r) w[r] = p.w + (n0 + r) * p.k;
  for (int64_t kk = 0; kk < k16; kk += 16) {
    head_prefetch(w[0], R * p.k * 2, kk / 16, R * 32);
    __m256 xe[MT], xo[MT];
    for (int i = 0; i < MT; ++i) {
      xe[i] = _mm256_loadu_ps(p.xf + (m0 + i) * p.k + kk);
      xo[i] = _mm256_loadu_ps(p.xf + (m0 + i) * p.k + kk + 8);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + kk));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
      for (int i = 0; i < MT; ++i) acc[i][r] = _mm256_fmadd_ps(wo, xo[i], _mm256_fmadd_ps(we, xe[i], acc[i][r]));
    }
  }
  for (int i = 0; i < MT; ++i) {
    const float* x = p.xf + (m0 + i) * p.k;
    for (int r = 0; r < R; ++r) {
      float s = hsum_avx2(acc[i][r]);
      for (int64_t kk = k16; kk < p.k; ++kk) s += x[kk] * to_f(w[r][kk]);
      head_store(p, m0 + i, n0 + r, s);
    }
  }
}

// ---------------------------------------------------------------- INT8, AVX2
template <int MT, int R>
ANYCHIP_AVX2 void int8_tile_avx2(const HeadProblem& p, int64_t m0, int64_t n0) {
  const int64_t k32 = p.k / 32 * 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MT][R];
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_si256();
  const int8_t* w[R];
  for (int r = 0; r < R; ++r) w[r] = p.wq + (n0 + r) * p.k;
  for (int64_t kk = 0; kk < k32; kk += 32) {
    head_prefetch(w[0], R * p.k, kk / 32, R * 32);
    __m256i xv[MT];
    for (int i = 0; i < MT; ++i) xv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.xq + (m0 + i) * p.k + kk));
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + kk));
      const __m256i aw = _mm256_abs_epi8(wv);
      for (int i = 0; i < MT; ++i) {
        const __m256i s16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[i], wv));
        acc[i][r] = _mm256_add_epi32(acc[i][r], _mm256_madd_epi16(s16, ones));
      }
    }
  }
  for (int i = 0; i < MT; ++i) {
    const int8_t* x = p.xq + (m0 + i) * p.k;
    for (int r = 0; r < R; ++r) {
      int32_t s = hsum_epi32_avx2(acc[i][r]);
      for (int64_t kk = k32; kk < p.k; ++kk) s += int32_t(x[kk]) * int32_t(w[r][kk]);
      head_store(p, m0 + i, n0 + r, float(s) * (p.sx[m0 + i] * p.sw[n0 + r]));
    }
  }
}

// ---------------------------------------------------------------- BF16, AVX512-BF16
ANYCHIP_AVX512_BF16 inline __m512bh load_bh(const Bf16* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

// One accumulator per (token, row) in every tile, as the AVX2 tile (batch invariance); one token takes 8 rows.
template <int MT, int R>
ANYCHIP_AVX512_BF16 void bf16_tile_avx512(const HeadProblem& p, int64_t m0, int64_t n0) {
  __m512 acc[MT][R];
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  const Bf16* w[R];
  for (int r = 0; r < R; ++r) w[r] = p.w + (n0 + r) * p.k;
  const __mmask32 all = ~__mmask32(0);
  int64_t kk = 0;
  for (; kk + 64 <= p.k; kk += 64) {
    head_prefetch(w[0], R * p.k * 2, kk / 64, R * 128);
    for (int u = 0; u < 2; ++u) {
      __m512bh xv[MT];
      for (int i = 0; i < MT; ++i) xv[i] = load_bh(p.xb + (m0 + i) * p.k + kk + 32 * u, all);
      for (int r = 0; r < R; ++r) {
        const __m512bh wv = load_bh(w[r] + kk + 32 * u, all);
        for (int i = 0; i < MT; ++i) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wv, xv[i]);
      }
    }
  }
  for (; kk < p.k; kk += 32) {  // masked tail: zero pairs add nothing
    const __mmask32 mask = p.k - kk >= 32 ? all : __mmask32((1u << (p.k - kk)) - 1);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = load_bh(w[r] + kk, mask);
      for (int i = 0; i < MT; ++i)
        acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wv, load_bh(p.xb + (m0 + i) * p.k + kk, mask));
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < R; ++r) head_store(p, m0 + i, n0 + r, _mm512_reduce_add_ps(acc[i][r]));
}

// ---------------------------------------------------------------- INT8, AVX512-VNNI
// w ^ 0x80 is w + 128 read as unsigned; x stays signed: vpdpbusd sums (w + 128) x exactly in int32 (|lane| <=
// 4 * 255 * 127 a step), and 128 * sum(x) is taken off at the end. A masked tail loads zeros for both: the zero x
// bytes cancel the 0x80 that the flip makes of a zero w byte.
template <int MT, int R>
ANYCHIP_AVX512 void int8_tile_avx512_vnni(const HeadProblem& p, int64_t m0, int64_t n0) {
  const __m512i flip = _mm512_set1_epi8(int8_t(0x80));
  __m512i acc[MT][R];
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_si512();
  const int8_t* w[R];
  for (int r = 0; r < R; ++r) w[r] = p.wq + (n0 + r) * p.k;
  for (int64_t kk = 0; kk < p.k; kk += 64) {
    const __mmask64 mask = p.k - kk >= 64 ? ~__mmask64(0) : (__mmask64(1) << (p.k - kk)) - 1;
    head_prefetch(w[0], R * p.k, kk / 64, R * 64);
    __m512i xv[MT];
    for (int i = 0; i < MT; ++i) xv[i] = _mm512_maskz_loadu_epi8(mask, p.xq + (m0 + i) * p.k + kk);
    for (int r = 0; r < R; ++r) {
      const __m512i wu = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w[r] + kk), flip);
      for (int i = 0; i < MT; ++i) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], wu, xv[i]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < R; ++r) {
      const int32_t s = _mm512_reduce_add_epi32(acc[i][r]) - 128 * p.xsum[m0 + i];
      head_store(p, m0 + i, n0 + r, float(s) * (p.sx[m0 + i] * p.sw[n0 + r]));
    }
}

#endif  // ANYCHIP_X86

// ---------------------------------------------------------------- dispatch and threads

using HeadTileFn = void (*)(const HeadProblem&, int64_t, int64_t);

// Tiles of (tokens, rows): each kind's `rows(tokens)` says how many rows a tile of that many tokens takes (16
// ymm registers on AVX2); a row tile's leftover rows take the one-row tile.
template <template <int, int> class Tiles>
HeadTileFn head_tile(int64_t mt, bool one_row) {
  switch (mt) {
    case 1: return one_row ? Tiles<1, 1>::fn : Tiles<1, Tiles<1, 1>::rows(1)>::fn;
    case 2: return one_row ? Tiles<2, 1>::fn : Tiles<2, Tiles<1, 1>::rows(2)>::fn;
    case 3: return one_row ? Tiles<3, 1>::fn : Tiles<3, Tiles<1, 1>::rows(3)>::fn;
    default: return one_row ? Tiles<4, 1>::fn : Tiles<4, Tiles<1, 1>::rows(4)>::fn;
  }
}
// 1 or 2 tokens x 4 rows, 3 or 4 tokens x 2 rows; the BF16 tiles take 8 rows for one token
constexpr int64_t head_tile_rows(int64_t mt) { return mt <= 2 ? 4 : 2; }
constexpr int64_t head_tile_rows_bf16(int64_t mt) { return mt == 1 ? 8 : head_tile_rows(mt); }

#ifdef ANYCHIP_X86
template <int MT, int R>
struct Bf16Avx2 {
  static constexpr HeadTileFn fn = &bf16_tile_avx2<MT, R>;
  static constexpr int64_t rows(int64_t mt) { return head_tile_rows_bf16(mt); }
};
template <int MT, int R>
struct Bf16Avx512 {
  static constexpr HeadTileFn fn = &bf16_tile_avx512<MT, R>;
  static constexpr int64_t rows(int64_t mt) { return head_tile_rows_bf16(mt); }
};
template <int MT, int R>
struct Int8Avx2 {
  static constexpr HeadTileFn fn = &int8_tile_avx2<MT, R>;
  static constexpr int64_t rows(int64_t mt) { return head_tile_rows(mt); }
};
template <int MT, int R>
struct Int8Avx512Vnni {
  static constexpr HeadTileFn fn = &int8_tile_avx512_vnni<MT, R>;
  static constexpr int64_t rows(int64_t mt) { return head_tile_rows(mt); }
};
#endif

#ifndef ANYCHIP_HEAD_CHUNKS_PER_THREAD
#define ANYCHIP_HEAD_CHUNKS_PER_THREAD 16
#endif

// Rows [n0, n1) for all tokens: token tiles inside row tiles, so a row tile stays in L1 while the tokens pass it.
template <template <int, int> class Tiles>
void head_rows_tiled(const HeadProblem& p, int64_t n0, int64_t n1) {
  for (int64_t t0 = 0; t0 < p.m; t0 += 4) {
    const int64_t mt = std::min<int64_t>(4, p.m - t0);
    const int64_t rows = Tiles<1, 1>::rows(mt);
    const HeadTileFn tile = head_tile<Tiles>(mt, false), one = head_tile<Tiles>(mt, true);
    int64_t n = n0;
    for (; n + rows <= n1; n += rows) tile(p, t0, n);
    for (; n < n1; ++n) one(p, t0, n);
  }
}

template <typename Parallel>
void head_run(const HeadProblem& p, bool int8, int64_t isa, int64_t max_threads, Parallel&& parallel) {
  void (*rows)(const HeadProblem&, int64_t, int64_t) = int8 ? &int8_rows_portable : &bf16_rows_portable;
#ifdef ANYCHIP_X86
  if (int8 && isa == kHeadAvx2) rows = &head_rows_tiled<Int8Avx2>;
  if (int8 && isa == kHeadAvx512Vnni) rows = &head_rows_tiled<Int8Avx512Vnni>;
  if (!int8 && isa == kHeadAvx2) rows = &head_rows_tiled<Bf16Avx2>;
  if (!int8 && isa == kHeadAvx512Bf16) rows = &head_rows_tiled<Bf16Avx512>;
#endif
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(max_threads, p.n / 64));
  const int64_t chunk = std::max<int64_t>(16, p.n / (threads * ANYCHIP_HEAD_CHUNKS_PER_THREAD)) / 4 * 4;
  std::atomic<int64_t> next{0};
  parallel(threads, [&]() {
    for (int64_t n0 = next.fetch_add(chunk); n0 < p.n; n0 = next.fetch_add(chunk)) rows(p, n0, std::min(p.n, n0 + chunk));
  });
}

}  // namespace anychip
