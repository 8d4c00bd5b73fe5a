// W4A8 linear for CPUs: INT4 weights (one fp32 scale per group of G input channels), dynamic per-token INT8
// activations, INT32 accumulation per group.  One translation unit serves every x86 CPU: the SIMD paths are
// compiled with function-level target attributes and chosen at run time; on other CPUs only the portable
// path exists.  The torch oracle is anychip/kernels/reference.py.
//
// Prepared weight layout (anychip/kernels/prepare.py writes it):
//   weight (NB, K/8, 64) uint8, NB = ceil(N/16) blocks of 16 output rows (padded with zero-scale rows);
//          byte r*4+j of chunk c: low nibble w[r, 8c+j] + 8, high nibble w[r, 8c+4+j] + 8.
//   scales (NB, K/G, 16) fp32.
// The u8 nibbles (w+8) meet the s8 activations in vpdpbusd / vpmaddubsw; each group's INT32 sum is corrected by
// -8 * sum_{k in g} xq[m, k] (precomputed per token) before it is scaled.

#include "cpu_common.h"
#include "quantize_act.h"

namespace anychip {
namespace {

constexpr int64_t kRows = 16;       // output rows per weight block
constexpr int64_t kChunkBytes = 64;  // one vector: 16 rows x 8 k
#ifndef ANYCHIP_PREFETCH
#define ANYCHIP_PREFETCH 2048
#endif
constexpr int64_t kPrefetch = ANYCHIP_PREFETCH;  // bytes ahead in the weight stream (GEMV); 0: none

struct Problem {
  const int8_t* xq;     // (M, K)
  const float* sx;      // (M)
  const int32_t* xsum;  // (M, groups): sum of xq over each group
  const uint8_t* w;     // (NB, K/8, 64)
  const float* sw;      // (NB, groups, 16)
  const float* bias;    // (N) or nullptr
  void* out;            // (M, N) out_type, or (M, N, groups) int32 for the debug dots
  at::ScalarType out_type;
  int64_t m, n, k, groups, group_size;
};

// ---------------------------------------------------------------- epilogues (shared by every ISA)

inline void store_rows(const Problem& p, int64_t m, int64_t nb, const float* y) {
  const int64_t n0 = nb * kRows;
  const int64_t cnt = std::min<int64_t>(kRows, p.n - n0);
  const float s = p.sx[m];
  float v[kRows];
  for (int64_t r = 0; r < cnt; ++r) v[r] = y[r] * s + (p.bias ? p.bias[n0 + r] : 0.f);
  const int64_t off = m * p.n + n0;
  switch (p.out_type) {
    case at::kFloat:
      std::memcpy(static_cast<float*>(p.out) + off, v, cnt * sizeof(float));
      break;
    case at::kBFloat16: {
      auto* o = static_cast<c10::BFloat16*>(p.out) + off;
      for (int64_t r = 0; r < cnt; ++r) o[r] = c10::BFloat16(v[r]);
      break;
    }
    default: {
      auto* o = static_cast<c10::Half*>(p.out) + off;
      for (int64_t r = 0; r < cnt; ++r) o[r] = c10::Half(v[r]);
    }
  }
}

inline void store_dots(const Problem& p, int64_t m, int64_t nb, int64_t g, const int32_t* acc) {
  const int64_t n0 = nb * kRows;
  const int64_t cnt = std::min<int64_t>(kRows, p.n - n0);
  auto* o = static_cast<int32_t*>(p.out);
  for (int64_t r = 0; r < cnt; ++r) o[(m * p.n + n0 + r) * p.groups + g] = acc[r];
}

// ---------------------------------------------------------------- portable path

template <int MT, bool DOTS>
void tile_portable(const Problem& p, int64_t m0, int64_t nb) {
  const uint8_t* w = p.w + nb * (p.k / 8) * kChunkBytes;
  const float* sw = p.sw + nb * p.groups * kRows;
  const int64_t cpg = p.group_size / 8;
  float y[MT][kRows] = {};
  for (int64_t g = 0; g < p.groups; ++g) {
    int32_t acc[MT][kRows];
    for (int i = 0; i < MT; ++i) {
      const int32_t corr = -8 * p.xsum[(m0 + i) * p.groups + g];
      for (int r = 0; r < kRows; ++r) acc[i][r] = corr;
    }
    for (int64_t c = 0; c < cpg; ++c) {
      const uint8_t* wp = w + (g * cpg + c) * kChunkBytes;
      const int64_t kk = (g * cpg + c) * 8;
      for (int i = 0; i < MT; ++i) {
        const int8_t* x = p.xq + (m0 + i) * p.k + kk;
        for (int r = 0; r < kRows; ++r) {
          int32_t s = 0;
          for (int j = 0; j < 4; ++j) {
            const uint8_t b = wp[r * 4 + j];
            s += int32_t(b & 0x0F) * x[j] + int32_t(b >> 4) * x[4 + j];
          }
          acc[i][r] += s;
        }
      }
    }
    for (int i = 0; i < MT; ++i) {
      if constexpr (DOTS) {
        store_dots(p, m0 + i, nb, g, acc[i]);
      } else {
        for (int r = 0; r < kRows; ++r) y[i][r] += float(acc[i][r]) * sw[g * kRows + r];
      }
    }
  }
  if constexpr (!DOTS) {
    for (int i = 0; i < MT; ++i) store_rows(p, m0 + i, nb, y[i]);
  }
}

#ifdef ANYCHIP_X86

// ---------------------------------------------------------------- AVX512-VNNI path

// y * sx + bias for 16 rows, stored as fp32 / bf16 (round to nearest even, as c10::BFloat16) / fp16.
ANYCHIP_AVX512 inline void store_rows_avx512(const Problem& p, int64_t m, int64_t nb, __m512 y) {
  const int64_t n0 = nb * kRows;
  const int64_t cnt = std::min<int64_t>(kRows, p.n - n0);
  const __mmask16 mask = cnt == kRows ? __mmask16(0xFFFF) : __mmask16((1u << cnt) - 1);
  y = _mm512_mul_ps(y, _mm512_set1_ps(p.sx[m]));
  if (p.bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, p.bias + n0));
  const int64_t off = m * p.n + n0;
  if (p.out_type == at::kFloat) {
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + off, mask, y);
  } else if (p.out_type == at::kBFloat16) {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(static_cast<c10::BFloat16*>(p.out) + off, mask, _mm512_cvtepi32_epi16(r));
  } else {
    const __m256i h = _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(static_cast<c10::Half*>(p.out) + off, mask, h);
  }
}

#ifndef ANYCHIP_EMBED_BCAST
#define ANYCHIP_EMBED_BCAST 1
#endif

// acc += u8 w . s8 x[0..3] broadcast.  GCC does not fold the broadcast into vpdpbusd's {1to16} memory operand
// by itself, and the separate vpbroadcastd per token and half-chunk costs about 10% of the GEMM.
ANYCHIP_AVX512 inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* x) {
#if ANYCHIP_EMBED_BCAST
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(load4(x)));
#endif
}
// A accumulators per token: one token alone would be bound by the vpdpbusd latency chain, not by memory, so small
// tiles spread a group over several accumulators; big tiles already have MT independent chains.

template <int MT, int NB, int A, bool DOTS>
ANYCHIP_AVX512 void tile_avx512(const Problem& p, int64_t m0, int64_t nb0) {
  static_assert(A == 1 || A == 2 || A == 4, "A must divide the 4 dpbusd of a chunk pair");
  const int64_t cpg = p.group_size / 8;  // a multiple of 4
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* w[NB];
  const float* sw[NB];
  for (int b = 0; b < NB; ++b) {
    w[b] = p.w + (nb0 + b) * (p.k / 8) * kChunkBytes;
    sw[b] = p.sw + (nb0 + b) * p.groups * kRows;
  }
  const int8_t* x[MT];
  for (int i = 0; i < MT; ++i) x[i] = p.xq + (m0 + i) * p.k;
  __m512 y[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int b = 0; b < NB; ++b) y[i][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512i acc[MT][NB][A];
    for (int i = 0; i < MT; ++i) {
      const __m512i corr = _mm512_set1_epi32(-8 * p.xsum[(m0 + i) * p.groups + g]);
      for (int b = 0; b < NB; ++b) {
        acc[i][b][0] = corr;
        for (int a = 1; a < A; ++a) acc[i][b][a] = _mm512_setzero_si512();
      }
    }
    const int64_t kg = g * p.group_size;
    for (int64_t c = g * cpg; c < (g + 1) * cpg; c += 2) {
      for (int u = 0; u < 2; ++u) {
        __m512i lo[NB], hi[NB];
        for (int b = 0; b < NB; ++b) {
          const uint8_t* wp = w[b] + (c + u) * kChunkBytes;
          if constexpr (MT <= 4 && kPrefetch > 0) _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetch), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(wp);
          lo[b] = _mm512_and_si512(v, low4);
          hi[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        const int64_t kk = kg + (c - g * cpg + u) * 8;
        for (int i = 0; i < MT; ++i) {
          for (int b = 0; b < NB; ++b) {
            auto& a0 = acc[i][b][(2 * u) % A];
            a0 = dpbusd_bcast(a0, lo[b], x[i] + kk);
            auto& a1 = acc[i][b][(2 * u + 1) % A];
            a1 = dpbusd_bcast(a1, hi[b], x[i] + kk + 4);
          }
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 s = _mm512_loadu_ps(sw[b] + g * kRows);
      for (int i = 0; i < MT; ++i) {
        __m512i a = acc[i][b][0];
        for (int u = 1; u < A; ++u) a = _mm512_add_epi32(a, acc[i][b][u]);
        if constexpr (DOTS) {
          alignas(64) int32_t t[kRows];
          _mm512_store_si512(t, a);
          store_dots(p, m0 + i, nb0 + b, g, t);
        } else {
          y[i][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s, y[i][b]);
        }
      }
    }
  }
  if constexpr (!DOTS) {
    for (int i = 0; i < MT; ++i)
      for (int b = 0; b < NB; ++b) store_rows_avx512(p, m0 + i, nb0 + b, y[i][b]);
  }
}

// ---------------------------------------------------------------- AVX2 path
// The 64-byte chunk as two 32-byte halves (rows 0-7, rows 8-15).  vpmaddubsw(u4, s8) pair sums are at most
// 2 * 15 * 127 = 3810, so adding the low- and high-nibble products in int16 cannot saturate either.

template <int MT, bool DOTS>
ANYCHIP_AVX2 void tile_avx2(const Problem& p, int64_t m0, int64_t nb) {
  const uint8_t* w = p.w + nb * (p.k / 8) * kChunkBytes;
  const float* sw = p.sw + nb * p.groups * kRows;
  const int64_t cpg = p.group_size / 8;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* x[MT];
  for (int i = 0; i < MT; ++i) x[i] = p.xq + (m0 + i) * p.k;
  __m256 y[MT][2];
  for (int i = 0; i < MT; ++i) y[i][0] = y[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256i acc[MT][2];
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_set1_epi32(-8 * p.xsum[(m0 + i) * p.groups + g]);
    const uint8_t* wg = w + g * cpg * kChunkBytes;
    const int64_t kg = g * p.group_size;
    for (int64_t c = 0; c < cpg; ++c) {
      const uint8_t* wp = wg + c * kChunkBytes;
      if constexpr (MT <= 2 && kPrefetch > 0) _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetch), _MM_HINT_T0);
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32));
      const __m256i lo0 = _mm256_and_si256(v0, low4);
      const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
      const __m256i lo1 = _mm256_and_si256(v1, low4);
      const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
      const int64_t kk = kg + c * 8;
      for (int i = 0; i < MT; ++i) {
        const __m256i xa = _mm256_set1_epi32(load4(x[i] + kk));
        const __m256i xb = _mm256_set1_epi32(load4(x[i] + kk + 4));
        const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa), _mm256_maddubs_epi16(hi0, xb));
        const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa), _mm256_maddubs_epi16(hi1, xb));
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(s0, ones));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(s1, ones));
      }
    }
    const __m256 s0 = _mm256_loadu_ps(sw + g * kRows);
    const __m256 s1 = _mm256_loadu_ps(sw + g * kRows + 8);
    for (int i = 0; i < MT; ++i) {
      if constexpr (DOTS) {
        alignas(32) int32_t t[kRows];
        _mm256_store_si256(reinterpret_cast<__m256i*>(t), acc[i][0]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(t + 8), acc[i][1]);
        store_dots(p, m0 + i, nb, g, t);
      } else {
        y[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][0]), s0, y[i][0]);
        y[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][1]), s1, y[i][1]);
      }
    }
  }
  if constexpr (!DOTS) {
    for (int i = 0; i < MT; ++i) {
      alignas(32) float t[kRows];
      _mm256_store_ps(t, y[i][0]);
      _mm256_store_ps(t + 8, y[i][1]);
      store_rows(p, m0 + i, nb, t);
    }
  }
}

#endif  // ANYCHIP_X86

// ---------------------------------------------------------------- dispatch

using TileFn = void (*)(const Problem&, int64_t, int64_t);

// Tuning knobs (compile-time; the defaults won on a 2-core AMD EPYC Zen 5, AVX512-VNNI, single-thread CPU time):
//   tokens per AVX512 GEMM tile  4 (acc x2): 714 GOPS, 6 (acc x1): 670, 8 (acc x1): 770, 8 (acc x2): 775
//   token panel in L2            128 KiB: +3-4% over no panels (K=6144), same as 256 KiB
//   GEMV accumulators per token  4 vs 2: within noise; prefetch 2048 B ahead: ~+8% over 1024 or none, 512 B: -15%
//   wide tile, 2 blocks (32 rows) x 6 tokens: 752-768 GOPS at K=2048 (8x16: 732), 723 at K=576 (8x16: 640);
//                                   2 blocks x 4 tokens: 705-712
//   vectorized epilogue (vs scalar stores): K=576 550 -> 640 GOPS; vpdpbusd {1to16} broadcast: +0-10% (small M)
//   measured vpdpbusd peak of one core: about 930 GOPS, so the GEMM runs at about 80% of it
#ifndef ANYCHIP_TILE_M
#define ANYCHIP_TILE_M 8
#endif
#ifndef ANYCHIP_GEMV_ACC
#define ANYCHIP_GEMV_ACC 4
#endif
#ifndef ANYCHIP_GEMM_ACC
#define ANYCHIP_GEMM_ACC 1
#endif
// Tokens sharing each unpacked weight vector in the GEMM path: AVX512 has 32 registers for 8 x (acc, sum), AVX2
// only 16.
constexpr int64_t tile_m(int64_t isa) { return isa == kAvx512Vnni ? ANYCHIP_TILE_M : 4; }

template <int MT, bool DOTS>
TileFn tile_for(int64_t isa) {
  switch (isa) {
#ifdef ANYCHIP_X86
    case kAvx512Vnni:
      return &tile_avx512<MT, 1, (MT == 1 ? ANYCHIP_GEMV_ACC : MT < 8 ? 2 : ANYCHIP_GEMM_ACC), DOTS>;
    case kAvx2:
      return &tile_avx2<MT, DOTS>;
#endif
    default:
      return &tile_portable<MT, DOTS>;
  }
}

template <bool DOTS>
TileFn tile_fn(int64_t isa, int64_t mt) {
  switch (mt) {
    case 1: return tile_for<1, DOTS>(isa);
    case 2: return tile_for<2, DOTS>(isa);
    case 3: return tile_for<3, DOTS>(isa);
    case 4: return tile_for<4, DOTS>(isa);
    case 5: return tile_for<5, DOTS>(isa);
    case 6: return tile_for<6, DOTS>(isa);
    case 7: return tile_for<7, DOTS>(isa);
    default: return tile_for<8, DOTS>(isa);
  }
}

#ifndef ANYCHIP_WIDE_TILE_M
#define ANYCHIP_WIDE_TILE_M 6
#endif

// GEMM tile over two neighbouring weight blocks (32 rows), or nullptr where the ISA has none.
template <bool DOTS>
TileFn wide_tile_fn(int64_t isa) {
#ifdef ANYCHIP_X86
  if (ANYCHIP_WIDE_TILE_M > 0 && isa == kAvx512Vnni) {
    constexpr int mt = ANYCHIP_WIDE_TILE_M > 0 ? ANYCHIP_WIDE_TILE_M : 1;
    return &tile_avx512<mt, 2, 1, DOTS>;
  }
#endif
  return nullptr;
}

void check_isa(int64_t isa) {
  TORCH_CHECK(isa == kPortable || isa == kAvx2 || isa == kAvx512Vnni, "anychip: unknown ISA code ", isa);
  TORCH_CHECK(isa_supported(isa), "anychip: this CPU (or this build) lacks ISA code ", isa,
              "; unset ANYCHIP_KERNEL_ISA or pick one from anychip.kernels.dispatch.available_isas()");
}

#ifndef ANYCHIP_PANEL_BYTES
#define ANYCHIP_PANEL_BYTES (128 * 1024)
#endif

#ifndef ANYCHIP_CHUNKS_PER_THREAD
#define ANYCHIP_CHUNKS_PER_THREAD 8
#endif

// Threads take chunks of weight blocks from a shared counter (a thread that the OS preempts on a shared machine
// delays only its current chunk, not a fixed half of the work).  Within a chunk, tokens go in panels whose
// activations stay in L2 (about ANYCHIP_PANEL_BYTES of int8) while the chunk's blocks stream past; without panels
// every block would re-read all M x K activations from L3.
template <bool DOTS>
void run(const Problem& p, int64_t isa) {
  const int64_t nblocks = (p.n + kRows - 1) / kRows;
  // the wide tile always takes ANYCHIP_WIDE_TILE_M tokens: never hand it fewer (that would read and write past M)
  const TileFn wide = p.m >= ANYCHIP_WIDE_TILE_M ? wide_tile_fn<DOTS>(isa) : nullptr;
  const int64_t mt = wide ? std::min<int64_t>(p.m, ANYCHIP_WIDE_TILE_M) : std::min(p.m, tile_m(isa));
  const int64_t panel = std::max<int64_t>(mt, (ANYCHIP_PANEL_BYTES / p.k) / mt * mt);
  const TileFn tile = tile_fn<DOTS>(isa, mt);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), nblocks);
  const int64_t chunk = std::max<int64_t>(1, nblocks / (threads * ANYCHIP_CHUNKS_PER_THREAD));
  std::atomic<int64_t> next{0};
  auto body = [&](int64_t b0, int64_t b1) {
    for (int64_t t0 = 0; t0 < p.m; t0 += panel) {
      const int64_t t1 = std::min(p.m, t0 + panel);
      const int64_t full_end = t0 + (t1 - t0) / mt * mt;
      const TileFn tail = t1 > full_end ? tile_fn<DOTS>(isa, t1 - full_end) : nullptr;
      int64_t nb = b0;
      if (wide) {
        for (; nb + 2 <= b1; nb += 2) {
          for (int64_t t = t0; t < full_end; t += mt) wide(p, t, nb);
          if (tail) tail(p, full_end, nb), tail(p, full_end, nb + 1);
        }
      }
      for (; nb < b1; ++nb) {
        for (int64_t t = t0; t < full_end; t += mt) tile(p, t, nb);
        if (tail) tail(p, full_end, nb);
      }
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b0 = next.fetch_add(chunk); b0 < nblocks; b0 = next.fetch_add(chunk)) {
      body(b0, std::min(nblocks, b0 + chunk));
    }
  });
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
              "anychip: weight must be the prepared (N/16, K/8, 64) uint8 layout for N=", n, " K=", k,
              "; build it with anychip.kernels.prepare.prepare_w4a8");
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
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "anychip: output dtype must be fp32, bf16 or fp16");
  const at::Tensor xq = xq_in.contiguous();
  const at::Tensor sx = sx_in.to(at::kFloat).contiguous();
  c10::optional<at::Tensor> bias;
  if (bias_in.has_value()) bias = bias_in->to(at::kFloat).contiguous();
  const at::Tensor xsum = group_sums(xq, group_size);
  Problem p = make_problem(xq, sx, xsum, weight, scales, bias, n, group_size);
  at::Tensor out = at::empty({p.m, n}, xq.options().dtype(out_dtype));
  p.out = out.data_ptr();
  p.out_type = out_dtype;
  if (p.m) run<false>(p, isa);
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
  p.out_type = at::kInt;
  if (p.m) run<true>(p, isa);
  return out;
}

std::vector<std::string> cpu_isas() {
  std::vector<std::string> out;
  if (isa_supported(kAvx512Vnni)) out.push_back("avx512_vnni");
  if (isa_supported(kAvx2)) out.push_back("avx2");
  out.push_back("portable");
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
}
