// The aarch64 tiles: arm.dotprod (SDOT by element, on the blocked layout) and arm.i8mm (SMMLA, on the pair layout).
// Each carries a function-level target attribute and runs only after getauxval reports the instructions
// (cpu_common.h), so one binary serves every aarch64 CPU.
//
// Blocked layout (w4a8_tiles.h) meets SDOT as is: a 16-byte quarter of a chunk holds 4 rows x 4 k in its low
// nibbles (k 0-3 of the chunk) and 4 rows x 4 k in its high nibbles (k 4-7), so `sdot acc.4s, w.16b, x.4b[lane]`
// adds one 4-k dot to each of the 4 rows.
//
// Pair layout (arm.i8mm; anychip/kernels/routes/arm_neon.py pair_layout writes it), the same size as the blocked one:
//   weight (NB, K/16, 8, 16) uint8: for chunk c of 16 k and row pair q, byte 8i+j holds w[2q+i, 16c+j] + 8 in its
//          low nibble and w[2q+i, 16c+8+j] + 8 in its high nibble, so either nibble plane is a 2 x 8 SMMLA operand.
//   scales as the blocked layout.
// SMMLA multiplies 2 tokens x 8 k by 2 rows x 8 k into 2 x 2 INT32 lanes (t0 r0, t0 r1, t1 r0, t1 r1).  An odd
// token (M = 1 decode included) pairs with itself: 16 useful multiply-adds per instruction, as many as SDOT.
#pragma once

#include "quantize_act.h"
#include "w4a8_tiles.h"

namespace anychip {

#ifdef ANYCHIP_ARM

constexpr int64_t kPairChunkBytes = 128;  // one pair-layout chunk: 16 rows x 16 k

// 4 (2) prepared scales from index i as fp32, fp32 or bf16 (quantize_act.h's loaders widen bf16 exactly).
inline float32x4_t scales4_neon(const Problem& p, int64_t i) {
  return p.sw_bf16 ? load4f(p.sw_bf16 + i) : load4f(p.sw + i);
}

inline float32x2_t scales2_neon(const Problem& p, int64_t i) {  // not 4 loaded: the last pair ends the array
  if (!p.sw_bf16) return vld1_f32(p.sw + i);
  return vset_lane_f32(to_f(p.sw_bf16[i + 1]), vdup_n_f32(to_f(p.sw_bf16[i])), 1);
}

template <int L>
ANYCHIP_DOTPROD inline int32x4_t sdot_lane(int32x4_t acc, int8x16_t w, int8x16_t x) {
  return vdotq_laneq_s32(acc, w, x, L);
}

// A accumulator sets per token: one token alone has only 4 SDOT chains (one per 4 rows), too few to hide the
// instruction's latency, so the GEMV splits low and high nibbles over 2 sets.
template <int MT, int A, bool DOTS>
ANYCHIP_DOTPROD void tile_dotprod(const Problem& p, int64_t m0, int64_t nb) {
  static_assert(A == 1 || A == 2, "A sets: 1, or 2 (low / high nibbles)");
  const uint8_t* w = p.w + nb * (p.k / 8) * kChunkBytes;
  const int64_t sw = nb * p.groups * kRows;  // the block's first scale
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  const int8_t* x[MT];
  for (int i = 0; i < MT; ++i) x[i] = p.xq + (m0 + i) * p.k;
  float32x4_t y[MT][4];
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < 4; ++v) y[i][v] = vdupq_n_f32(0.f);
  for (int64_t g = 0; g < p.groups; ++g) {
    int32x4_t acc[MT][4][A];
    for (int i = 0; i < MT; ++i) {
      const int32x4_t corr = vdupq_n_s32(p.xcorr[(m0 + i) * p.groups + g]);
      for (int v = 0; v < 4; ++v) {
        acc[i][v][0] = corr;
        if constexpr (A == 2) acc[i][v][1] = vdupq_n_s32(0);
      }
    }
    for (int64_t kk = g * p.group_size; kk < (g + 1) * p.group_size; kk += 16) {
      const uint8_t* wp = w + kk * 8;  // two chunks (64 bytes per 8 k): k kk..kk+7, kk+8..kk+15
      if constexpr (MT <= 2 && kPrefetch > 0) __builtin_prefetch(wp + kPrefetch);
      int8x16_t xv[MT];
      for (int i = 0; i < MT; ++i) xv[i] = vld1q_s8(x[i] + kk);
      for (int v = 0; v < 4; ++v) {
        const uint8x16_t a = vld1q_u8(wp + 16 * v), b = vld1q_u8(wp + kChunkBytes + 16 * v);
        const int8x16_t alo = vreinterpretq_s8_u8(vandq_u8(a, low4)), ahi = vreinterpretq_s8_u8(vshrq_n_u8(a, 4));
        const int8x16_t blo = vreinterpretq_s8_u8(vandq_u8(b, low4)), bhi = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
        for (int i = 0; i < MT; ++i) {
          int32x4_t& a0 = acc[i][v][0];
          int32x4_t& a1 = acc[i][v][A - 1];
          a0 = sdot_lane<0>(a0, alo, xv[i]);
          a1 = sdot_lane<1>(a1, ahi, xv[i]);
          a0 = sdot_lane<2>(a0, blo, xv[i]);
          a1 = sdot_lane<3>(a1, bhi, xv[i]);
        }
      }
    }
    for (int i = 0; i < MT; ++i) {
      int32x4_t s[4];
      for (int v = 0; v < 4; ++v) s[v] = A == 2 ? vaddq_s32(acc[i][v][0], acc[i][v][A - 1]) : acc[i][v][0];
      if constexpr (DOTS) {
        int32_t t[kRows];
        for (int v = 0; v < 4; ++v) vst1q_s32(t + 4 * v, s[v]);
        store_dots(p, m0 + i, nb, g, t);
      } else {
        for (int v = 0; v < 4; ++v)
          y[i][v] = vfmaq_f32(y[i][v], vcvtq_f32_s32(s[v]), scales4_neon(p, sw + g * kRows + 4 * v));
      }
    }
  }
  if constexpr (!DOTS) {
    for (int i = 0; i < MT; ++i) {
      float t[kRows];
      for (int v = 0; v < 4; ++v) vst1q_f32(t + 4 * v, y[i][v]);
      store_rows(p, m0 + i, nb, t);
    }
  }
}

// Lanes (t0 r0, t0 r1, t1 r0, t1 r1) of the 8 row pairs -> 16 rows of token 0 and of token 1.
template <typename V, typename S>
inline void split_pairs(const V (&acc)[8], S* t0, S* t1) {
  for (int q = 0; q < 8; ++q) {
    S lanes[4];
    std::memcpy(lanes, &acc[q], sizeof(lanes));
    t0[2 * q] = lanes[0], t0[2 * q + 1] = lanes[1];
    t1[2 * q] = lanes[2], t1[2 * q + 1] = lanes[3];
  }
}

template <int MT, bool DOTS>
ANYCHIP_I8MM void tile_i8mm(const Problem& p, int64_t m0, int64_t nb) {
  constexpr int MP = (MT + 1) / 2;  // token pairs; an odd tile's last pair repeats its token
  const uint8_t* w = p.w + nb * (p.k / 8) * kChunkBytes;
  const int64_t sw = nb * p.groups * kRows;  // the block's first scale
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  int64_t tok[MP][2];
  for (int j = 0; j < MP; ++j) tok[j][0] = m0 + 2 * j, tok[j][1] = 2 * j + 1 < MT ? m0 + 2 * j + 1 : m0 + 2 * j;
  float32x4_t y[MP][8];
  for (int j = 0; j < MP; ++j)
    for (int q = 0; q < 8; ++q) y[j][q] = vdupq_n_f32(0.f);
  for (int64_t g = 0; g < p.groups; ++g) {
    int32x4_t acc[MP][8];
    for (int j = 0; j < MP; ++j) {
      const int32x4_t corr = vcombine_s32(vdup_n_s32(p.xcorr[tok[j][0] * p.groups + g]),
                                          vdup_n_s32(p.xcorr[tok[j][1] * p.groups + g]));
      for (int q = 0; q < 8; ++q) acc[j][q] = corr;
    }
    for (int64_t kk = g * p.group_size; kk < (g + 1) * p.group_size; kk += 16) {
      const uint8_t* wp = w + kk * (kPairChunkBytes / 16);
      if constexpr (MT <= 2 && kPrefetch > 0) __builtin_prefetch(wp + kPrefetch);
      int8x16_t xlo[MP], xhi[MP];  // (t0 k 0-7, t1 k 0-7), (t0 k 8-15, t1 k 8-15)
      for (int j = 0; j < MP; ++j) {
        const int8_t* x0 = p.xq + tok[j][0] * p.k + kk;
        const int8_t* x1 = p.xq + tok[j][1] * p.k + kk;
        xlo[j] = vcombine_s8(vld1_s8(x0), vld1_s8(x1));
        xhi[j] = vcombine_s8(vld1_s8(x0 + 8), vld1_s8(x1 + 8));
      }
      for (int q = 0; q < 8; ++q) {
        const uint8x16_t v = vld1q_u8(wp + 16 * q);
        const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(v, low4)), hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
        for (int j = 0; j < MP; ++j) {
          acc[j][q] = vmmlaq_s32(acc[j][q], xlo[j], lo);
          acc[j][q] = vmmlaq_s32(acc[j][q], xhi[j], hi);
        }
      }
    }
    for (int j = 0; j < MP; ++j) {
      if constexpr (DOTS) {
        int32_t t0[kRows], t1[kRows];
        split_pairs(acc[j], t0, t1);
        store_dots(p, tok[j][0], nb, g, t0);
        if (tok[j][1] != tok[j][0]) store_dots(p, tok[j][1], nb, g, t1);
      } else {
        for (int q = 0; q < 8; ++q) {
          const float32x2_t s = scales2_neon(p, sw + g * kRows + 2 * q);
          y[j][q] = vfmaq_f32(y[j][q], vcvtq_f32_s32(acc[j][q]), vcombine_f32(s, s));
        }
      }
    }
  }
  if constexpr (!DOTS) {
    for (int j = 0; j < MP; ++j) {
      float t0[kRows], t1[kRows];
      split_pairs(y[j], t0, t1);
      store_rows(p, tok[j][0], nb, t0);
      if (tok[j][1] != tok[j][0]) store_rows(p, tok[j][1], nb, t1);
    }
  }
}

#endif  // ANYCHIP_ARM

}  // namespace anychip
