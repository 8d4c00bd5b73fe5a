// The W4A8 problem as the tile kernels see it, the epilogues every ISA shares, and the portable tile.
//
// Blocked weight layout (anychip/kernels/routes/cpu_x86.py blocked_layout writes it; the x86 paths, the portable
// path and arm.dotprod read it):
//   weight (NB, K/8, 64) uint8, NB = ceil(N/16) blocks of 16 output rows (padded with zero-scale rows);
//          byte r*4+j of chunk c: low nibble w[r, 8c+j] + 8, high nibble w[r, 8c+4+j] + 8.
//   scales (NB, K/G, 16) fp32, or bf16 where the checkpoint's scales are bf16 (exact either way; a bf16 scale is
//          the top half of its fp32, so it widens with a shift: 10% fewer bytes a decode step at G = 32).
// The u4 nibbles (w+8) meet the s8 activations in the dot instructions; each group's INT32 sum starts from the
// correction -8 * sum_{k in g} xq[m, k] (precomputed per token: Problem::xcorr) before it is scaled.
//
// Float epilogue: y = sum over groups, in order, of float(dot_g) * sw[n, g]; out = y * sx[m] + bias[n] (bias 0
// when absent).  On aarch64 every path fuses both steps (fma), so all Arm paths give the same bits.  On x86 the
// SIMD paths fuse the group step, AVX2 also the last one, portable code neither (tests/arm/driver.cpp checks each
// order exactly; the torch tests compare within fp32 tolerance).
#pragma once

#include "cpu_common.h"

namespace anychip {

constexpr int64_t kRows = 16;        // output rows per weight block
constexpr int64_t kChunkBytes = 64;  // one chunk: 16 rows x 8 k
constexpr int64_t kUnpackedChunkBytes = 2 * kChunkBytes;  // a chunk unpacked to u8 (x86 prefill, w4a8_x86.h)
#ifndef ANYCHIP_PREFETCH
#define ANYCHIP_PREFETCH 2048
#endif
constexpr int64_t kPrefetch = ANYCHIP_PREFETCH;  // bytes ahead in the weight stream (Arm GEMV); 0: none
// x86 GEMV: bytes ahead in the weight stream, fetched into L2 (prefetcht1); 0: none.  On the 2-vCPU Xeon with AMX
// (session 35, docs/kernels-cpu.md) the decode step's 120 linears took 10-15% less time than with 2048 bytes into
// L1 (the earlier default, tuned on a Zen 5 EPYC): far enough ahead to cover the L3's latency at both threads'
// rate, and the L2's queue holds more misses in flight than the L1's fill buffers; 6-16 KB all did about as well.
#ifndef ANYCHIP_PREFETCH_L2
#define ANYCHIP_PREFETCH_L2 12288
#endif
constexpr int64_t kPrefetchL2 = ANYCHIP_PREFETCH_L2;

struct Problem {
  const int8_t* xq;      // (M, K)
  const float* sx;       // (M)
  const int32_t* xcorr;  // (M, groups): -8 * the sum of xq over each group (group_corr_row)
  const uint8_t* w;      // (NB, K/8, 64) blocked, or the route's own layout of the same size
  const uint8_t* wu;     // x86 prefill tile only: its blocks, from nb0, unpacked (unpack_blocks_avx512); else unused
  const float* sw;       // (NB, groups, 16) fp32 scales, or nullptr when sw_bf16 holds them
  const Bf16* sw_bf16;   // (NB, groups, 16) bf16 scales, or nullptr when sw holds them
  const float* bias;     // (N) or nullptr
  void* out;             // (M, N) out_type, or (M, N, groups) int32 for the debug dots
  OutType out_type;
  int64_t m, n, k, groups, group_size;
};

// Prepared scale i (index into (NB, groups, 16)) as fp32, whichever dtype the layout holds.
inline float scale_at(const Problem& p, int64_t i) {
  return p.sw_bf16 ? to_f(p.sw_bf16[i]) : p.sw[i];
}

// y += acc * s, one group's contribution to one output.
inline float accumulate_group(float y, int32_t acc, float s) {
#ifdef ANYCHIP_ARM
  return std::fma(float(acc), s, y);
#else
  return y + float(acc) * s;
#endif
}

// out = y * sx + bias: rounded once (fused) on aarch64 and in the AVX2 path, twice in x86 portable code.
enum class Finish { kPlain, kFused };
#ifdef ANYCHIP_ARM
constexpr Finish kFinish = Finish::kFused;
#else
constexpr Finish kFinish = Finish::kPlain;
#endif

template <Finish F = kFinish>
inline float finish(float y, float sx, const float* bias, int64_t n) {
  const float b = bias ? bias[n] : 0.f;
  if constexpr (F == Finish::kFused) return std::fma(y, sx, b);
  return y * sx + b;
}

// ---------------------------------------------------------------- epilogues (shared by every ISA)

// Stores already-finished values v[0..cnt) of token m at output rows n0.. in p.out_type.
inline void store_values(const Problem& p, int64_t m, int64_t n0, int64_t cnt, const float* v) {
  const int64_t off = m * p.n + n0;
  switch (p.out_type) {
    case OutType::kF32:
      std::memcpy(static_cast<float*>(p.out) + off, v, cnt * sizeof(float));
      break;
    case OutType::kBF16: {
      auto* o = static_cast<uint16_t*>(p.out) + off;
      for (int64_t r = 0; r < cnt; ++r) o[r] = bf16_bits(v[r]);
      break;
    }
    default: {
      auto* o = static_cast<uint16_t*>(p.out) + off;
      for (int64_t r = 0; r < cnt; ++r) o[r] = fp16_bits(v[r]);
    }
  }
}

// Block nb's 16 group-accumulated sums y of token m -> y * sx + bias in the output.
template <Finish F = kFinish>
inline void store_rows(const Problem& p, int64_t m, int64_t nb, const float* y) {
  const int64_t n0 = nb * kRows;
  const int64_t cnt = std::min<int64_t>(kRows, p.n - n0);
  float v[kRows];
  for (int64_t r = 0; r < cnt; ++r) v[r] = finish<F>(y[r], p.sx[m], p.bias, n0 + r);
  store_values(p, m, n0, cnt, v);
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
  const int64_t s0 = nb * p.groups * kRows;  // the block's scales
  const int64_t cpg = p.group_size / 8;
  float y[MT][kRows] = {};
  for (int64_t g = 0; g < p.groups; ++g) {
    int32_t acc[MT][kRows];
    for (int i = 0; i < MT; ++i) {
      const int32_t corr = p.xcorr[(m0 + i) * p.groups + g];
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
        for (int r = 0; r < kRows; ++r) y[i][r] = accumulate_group(y[i][r], acc[i][r], scale_at(p, s0 + g * kRows + r));
      }
    }
  }
  if constexpr (!DOTS) {
    for (int i = 0; i < MT; ++i) store_rows(p, m0 + i, nb, y[i]);
  }
}

}  // namespace anychip
