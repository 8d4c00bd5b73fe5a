// The x86 tiles: AVX512-VNNI (vpdpbusd) and AVX2 (vpmaddubsw + vpmaddwd), on the blocked layout (w4a8_tiles.h).
// Compiled with function-level target attributes and chosen at run time (w4a8_run.h).
#pragma once

#include "quantize_act.h"
#include "w4a8_tiles.h"

namespace anychip {

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
  if (p.out_type == OutType::kF32) {
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + off, mask, y);
  } else if (p.out_type == OutType::kBF16) {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + off, mask, _mm512_cvtepi32_epi16(r));
  } else {
    const __m256i h = _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + off, mask, h);
  }
}

#ifndef ANYCHIP_EMBED_BCAST
#define ANYCHIP_EMBED_BCAST 1
#endif

// 16 (AVX2: 8) prepared scales from index i as fp32, fp32 or bf16 (quantize_act.h's loaders widen bf16 exactly).
ANYCHIP_AVX512 inline __m512 scales_avx512(const Problem& p, int64_t i) {
  return p.sw_bf16 ? load16(p.sw_bf16 + i, 0xFFFF) : load16(p.sw + i, 0xFFFF);
}

ANYCHIP_AVX2 inline __m256 scales_avx2(const Problem& p, int64_t i) {
  return p.sw_bf16 ? load8(p.sw_bf16 + i) : load8(p.sw + i);
}

// acc += u8 w . s8 x[0..3] broadcast.  GCC does not fold the broadcast into vpdpbusd's {1to16} memory operand
// by itself, and the separate vpbroadcastd per token and half-chunk costs about 10% of the GEMM.  Used where a
// broadcast serves one dot (one weight block); a tile of NB > 1 blocks broadcasts once into a register instead.
ANYCHIP_AVX512 inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* x) {
#if ANYCHIP_EMBED_BCAST
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(load4(x)));
#endif
}
// Prefill: the unpacked layout of NB blocks, (NB, K/8, 2, 64) u8: per chunk its low nibbles (the chunk's k 0-3 of
// each row, as the dot wants them), then its high nibbles (k 4-7).  A GEMM tile unpacks each chunk for only MT tokens
// (an and, a shift and an and per 2 MT dots); unpacked once per token panel into a buffer that stays in L1 / L2,
// the 6 x 2 tile reads both halves with plain loads instead.  SIGNED: the bytes w (-8..7) instead of w + 8 (the
// AMX tiles' `tdpbssd` operand, w4a8_amx.h).
template <bool SIGNED = false>
ANYCHIP_AVX512 inline void unpack_blocks_avx512(const Problem& p, int64_t nb0, int64_t nb, uint8_t* dst) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8(SIGNED ? 8 : 0);
  const int64_t chunks = nb * (p.k / 8);  // the NB blocks are contiguous in the blocked layout
  const uint8_t* src = p.w + nb0 * (p.k / 8) * kChunkBytes;
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512i v = _mm512_loadu_si512(src + c * kChunkBytes);
    const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    _mm512_storeu_si512(dst + c * kUnpackedChunkBytes, SIGNED ? _mm512_sub_epi8(lo, bias) : lo);
    _mm512_storeu_si512(dst + c * kUnpackedChunkBytes + kChunkBytes, SIGNED ? _mm512_sub_epi8(hi, bias) : hi);
  }
}

// A accumulators per token: one token alone would be bound by the vpdpbusd latency chain, not by memory, so small
// tiles spread a group over several accumulators; big tiles already have MT independent chains.
// UNPACKED: the weights come from p.wu (blocks nb0.., unpack_blocks_avx512), not from p.w.
template <int MT, int NB, int A, bool DOTS, bool UNPACKED = false>
ANYCHIP_AVX512 void tile_avx512(const Problem& p, int64_t m0, int64_t nb0) {
  static_assert(A == 1 || A == 2 || A == 4, "A must divide the 4 dpbusd of a chunk pair");
  const int64_t cpg = p.group_size / 8;  // a multiple of 4
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* w[NB];
  int64_t sw[NB];  // each block's first scale
  for (int b = 0; b < NB; ++b) {
    w[b] = UNPACKED ? p.wu + b * (p.k / 8) * kUnpackedChunkBytes : p.w + (nb0 + b) * (p.k / 8) * kChunkBytes;
    sw[b] = (nb0 + b) * p.groups * kRows;
  }
  const int8_t* x[MT];
  for (int i = 0; i < MT; ++i) x[i] = p.xq + (m0 + i) * p.k;
  __m512 y[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int b = 0; b < NB; ++b) y[i][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512i acc[MT][NB][A];
    for (int i = 0; i < MT; ++i) {
      const __m512i corr = _mm512_set1_epi32(p.xcorr[(m0 + i) * p.groups + g]);
      for (int b = 0; b < NB; ++b) {
        acc[i][b][0] = corr;
        for (int a = 1; a < A; ++a) acc[i][b][a] = _mm512_setzero_si512();
      }
    }
    const int64_t kg = g * p.group_size;
    for (int64_t c = g * cpg; c < (g + 1) * cpg; c += 2) {
      for (int u = 0; u < 2; ++u) {
        __m512i lo[NB], hi[NB];
        for (int b = 0; b < NB && !UNPACKED; ++b) {
          const uint8_t* wp = w[b] + (c + u) * kChunkBytes;
          if constexpr (MT <= 4 && kPrefetchL2 > 0)
            _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchL2), _MM_HINT_T1);
          const __m512i v = _mm512_loadu_si512(wp);
          lo[b] = _mm512_and_si512(v, low4);
          hi[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        const int64_t kk = kg + (c - g * cpg + u) * 8;
        // every token's low nibbles (k kk..kk+3), then the high ones: a dot's accumulator was written MT * NB dots
        // earlier, not NB, and Intel cores, which assign an instruction its port when they issue it, keep both
        // vpdpbusd ports busy (with the shared broadcast below: the 6 x 2 tile 3% faster on a Xeon)
        for (int h = 0; h < 2; ++h) {
          const int a = (2 * u + h) % A;
          if constexpr (UNPACKED) {  // loaded per half: NB registers live, not 2 NB (the 6 x 2 tile spilled its y)
            for (int b = 0; b < NB; ++b)
              (h ? hi : lo)[b] = _mm512_loadu_si512(w[b] + (c + u) * kUnpackedChunkBytes + h * kChunkBytes);
          }
          for (int i = 0; i < MT; ++i) {
            if constexpr (NB == 1) {
              acc[i][0][a] = dpbusd_bcast(acc[i][0][a], h ? hi[0] : lo[0], x[i] + kk + 4 * h);
            } else {  // one broadcast serves the NB blocks: half the loads of a {1to16} operand per dot
              const __m512i xv = _mm512_set1_epi32(load4(x[i] + kk + 4 * h));
              for (int b = 0; b < NB; ++b) acc[i][b][a] = _mm512_dpbusd_epi32(acc[i][b][a], h ? hi[b] : lo[b], xv);
            }
          }
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 s = scales_avx512(p, sw[b] + g * kRows);
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

// 8 fp32 -> bf16 bits in the low half of each int32 lane: round to nearest even, NaN -> 0x7FC0 (as bf16_bits).
ANYCHIP_AVX2 inline __m256i bf16_round_avx2(__m256 y) {
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
}

// fma(y, sx, bias) for the 16 rows of block nb (the Finish::kFused epilogue, same bits), stored as fp32 or bf16.
// fp16 outputs and a partial last block take store_rows: compiled without FMA, its std::fma is a call into libm
// per output (about 15% of a hot K=576 GEMV's time when every block went that way).
ANYCHIP_AVX2 inline void store_rows_avx2(const Problem& p, int64_t m, int64_t nb, __m256 y0, __m256 y1) {
  const int64_t n0 = nb * kRows;
  if (n0 + kRows > p.n || p.out_type == OutType::kF16) {
    alignas(32) float t[kRows];
    _mm256_store_ps(t, y0);
    _mm256_store_ps(t + 8, y1);
    return store_rows<Finish::kFused>(p, m, nb, t);
  }
  const __m256 sx = _mm256_set1_ps(p.sx[m]);
  const __m256 b0 = p.bias ? _mm256_loadu_ps(p.bias + n0) : _mm256_setzero_ps();
  const __m256 b1 = p.bias ? _mm256_loadu_ps(p.bias + n0 + 8) : _mm256_setzero_ps();
  y0 = _mm256_fmadd_ps(y0, sx, b0);
  y1 = _mm256_fmadd_ps(y1, sx, b1);
  const int64_t off = m * p.n + n0;
  if (p.out_type == OutType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(p.out) + off, y0);
    _mm256_storeu_ps(static_cast<float*>(p.out) + off + 8, y1);
  } else {  // packus works per 128-bit lane: (0-3, 8-11, 4-7, 12-15) -> rows in order
    const __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_round_avx2(y0), bf16_round_avx2(y1)), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p.out) + off), h);
  }
}

// Widening the int16 pair sums to int32 (vpmaddwd with ones) waits for kWidenChunks chunks: each chunk adds at
// most 2 x 3810 = 7620 to an int16 lane (|x| <= 127; 7680 at -128), so four chunks stay below 32767.  A group of
// 32 (four chunks) widens once instead of four times; the multiplies, which the Zen 2 cores run on one pipe, drop
// from 6 to 4.5 a chunk and token.
constexpr int64_t kWidenChunks = 4;

template <int MT, bool DOTS>
ANYCHIP_AVX2 void tile_avx2(const Problem& p, int64_t m0, int64_t nb) {
  const uint8_t* w = p.w + nb * (p.k / 8) * kChunkBytes;
  const int64_t sw = nb * p.groups * kRows;  // the block's first scale
  const int64_t cpg = p.group_size / 8;  // a multiple of 4 (group sizes are multiples of 32)
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* x[MT];
  for (int i = 0; i < MT; ++i) x[i] = p.xq + (m0 + i) * p.k;
  __m256 y[MT][2];
  for (int i = 0; i < MT; ++i) y[i][0] = y[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256i acc[MT][2];
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_set1_epi32(p.xcorr[(m0 + i) * p.groups + g]);
    const uint8_t* wg = w + g * cpg * kChunkBytes;
    const int64_t kg = g * p.group_size;
    for (int64_t c0 = 0; c0 < cpg; c0 += kWidenChunks) {
      __m256i s16[MT][2];
      for (int i = 0; i < MT; ++i) s16[i][0] = s16[i][1] = _mm256_setzero_si256();
      // not unrolled: GCC, given the four chunks at once, hoisted every vpmaddubsw and spilled the products to the
      // stack (tiles of 3-4 tokens 8-9% slower on hot weights)
#pragma GCC unroll 1
      for (int64_t c = c0; c < c0 + kWidenChunks; ++c) {
        const uint8_t* wp = wg + c * kChunkBytes;
        if constexpr (MT <= 2 && kPrefetchL2 > 0)
          _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchL2), _MM_HINT_T1);
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
          s16[i][0] = _mm256_add_epi16(s16[i][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa),
                                                                   _mm256_maddubs_epi16(hi0, xb)));
          s16[i][1] = _mm256_add_epi16(s16[i][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa),
                                                                   _mm256_maddubs_epi16(hi1, xb)));
        }
      }
      for (int i = 0; i < MT; ++i) {
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(s16[i][0], ones));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(s16[i][1], ones));
      }
    }
    const __m256 s0 = scales_avx2(p, sw + g * kRows);
    const __m256 s1 = scales_avx2(p, sw + g * kRows + 8);
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
    for (int i = 0; i < MT; ++i) store_rows_avx2(p, m0 + i, nb, y[i][0], y[i][1]);
  }
}

#endif  // ANYCHIP_X86

}  // namespace anychip
