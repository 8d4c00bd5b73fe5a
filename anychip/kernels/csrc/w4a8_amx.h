// The x86 prefill tiles on AMX-INT8 (Intel Sapphire Rapids and later), over a pair of weight blocks unpacked once
// per token panel: route cpu.amx_int8 (kAmxInt8), which is cpu.avx512_vnni with these tiles for calls of 32 tokens
// and more (amx_usable, cpu_common.h: the CPU has AMX-INT8 and the OS granted the tile state).
//
// The unpacked layout (unpack_blocks_avx512, w4a8_x86.h) is already AMX's B layout: a chunk's low half holds k 0-3
// of its 16 rows as bytes 4n + j, its high half k 4-7, so the K/4 quads of a block are K/4 B rows of 64 bytes, one
// after the other. `tdpbsud` (signed activations x unsigned w + 8) would need the -8 * sum(xq) correction per token
// and group, so the pair is unpacked with 8 subtracted (unpack_blocks_avx512<true>) and `tdpbssd` gives a group's
// exact INT32 sums directly; they go through the same fp32 multiply-add, group after group, as the AVX512 tiles: the
// outputs are the same bits. A group's sums must leave the matrix unit to be scaled (a tile store, then a conversion
// and an FMA per 16 outputs). For groups of 32 and 64, 16 tokens x one block at a time with four C tiles taking the
// groups in turn (the unit computes the next three while the vector units scale one: tiles_amx); for groups of 128
// and more, 32 tokens x the pair, 2 x 2 C tiles, one group at a time (tiles_amx22).
#pragma once

#include "w4a8_tiles.h"
#include "w4a8_x86.h"

namespace anychip {

constexpr int64_t kAmxTokens = 16;  // an A tile's rows

// 1: 32 tokens x the pair at a time (2 x 2 tiles, tiles_amx22) for groups of 128+; 0: tiles_amx only.
#ifndef ANYCHIP_AMX_22
#define ANYCHIP_AMX_22 1
#endif
constexpr int64_t kAmxPanelTokens = ANYCHIP_AMX_22 ? 2 * kAmxTokens : kAmxTokens;  // run()'s panels: multiples

// Tokens [m0, m1) of the pair of blocks from nb0 (tiles_amx).
using AmxFn = void (*)(const Problem&, int64_t m0, int64_t m1, int64_t nb0);

// Group sizes the tile takes: one A tile of G bytes (G <= 64, a multiple of 4), or G / 64 steps of 64.
constexpr bool amx_fits(int64_t g) { return g % 64 == 0 || (g < 64 && g % 4 == 0); }

#ifdef ANYCHIP_X86

#define ANYCHIP_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 the activations (16 tokens x step bytes), 1 the block's B (step / 4 quads x 64 bytes), 4-7 a ring of
// sums, group g in tile 4 + g % 4. GCC's tile intrinsics paste their tile number into the assembly text, so each
// must be a literal: SLOT picks one.
template <int SLOT>
ANYCHIP_AMX inline void amx_group_dots(const Problem& p, const int8_t* x, const uint8_t* w, int64_t g, int64_t step) {
  if constexpr (SLOT == 0) _tile_zero(4);
  if constexpr (SLOT == 1) _tile_zero(5);
  if constexpr (SLOT == 2) _tile_zero(6);
  if constexpr (SLOT == 3) _tile_zero(7);
  for (int64_t k0 = g * p.group_size; k0 < (g + 1) * p.group_size; k0 += step) {
    _tile_loadd(0, x + k0, p.k);
    _tile_loadd(1, w + k0 / 4 * 64, 64);
    if constexpr (SLOT == 0) _tile_dpbssd(4, 0, 1);
    if constexpr (SLOT == 1) _tile_dpbssd(5, 0, 1);
    if constexpr (SLOT == 2) _tile_dpbssd(6, 0, 1);
    if constexpr (SLOT == 3) _tile_dpbssd(7, 0, 1);
  }
}

// Group g's sums out of its tile: y += float(sum) * scale (the AVX512 tiles' arithmetic), or stored as exact group
// dots (DOTS).
template <int SLOT, bool DOTS>
ANYCHIP_AMX inline void amx_scale_group(const Problem& p, int64_t m0, int64_t nb, int64_t g, __m512 (&y)[16]) {
  alignas(64) int32_t sums[16][16];
  if constexpr (SLOT == 0) _tile_stored(4, sums, 64);
  if constexpr (SLOT == 1) _tile_stored(5, sums, 64);
  if constexpr (SLOT == 2) _tile_stored(6, sums, 64);
  if constexpr (SLOT == 3) _tile_stored(7, sums, 64);
  const __m512 s = scales_avx512(p, (nb * p.groups + g) * kRows);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if constexpr (DOTS) {
      store_dots(p, m0 + i, nb, g, sums[i]);
    } else {
      y[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[i])), s, y[i]);
    }
  }
}

constexpr int64_t kAmxRing = 4;  // groups in flight: the unit computes g + 1 .. g + 3 while group g is scaled

// Group g: scale it out of its slot, then start group g + kAmxRing in that slot.
template <int SLOT, bool DOTS>
ANYCHIP_AMX inline void amx_ring_step(const Problem& p, const int8_t* x, const uint8_t* w, int64_t m0, int64_t nb,
                                      int64_t g, int64_t step, __m512 (&y)[16]) {
  amx_scale_group<SLOT, DOTS>(p, m0, nb, g, y);
  if (g + kAmxRing < p.groups) amx_group_dots<SLOT>(p, x, w, g + kAmxRing, step);
}

// Tokens [m0, m1) (a multiple of 16 of them) x blocks nb0, nb0 + 1, from the pair p.wu as
// unpack_blocks_avx512<true> leaves it: each block, 16 tokens at a time, its 16 x 16 fp32 sums in registers while
// four C tiles hold the groups in flight, scaled in group order. The tile configuration is loaded once for them and
// the tiles released after (other code on this thread, oneDNN's, configures its own). amx_fits(p.group_size) is the
// caller's.
template <bool DOTS>
ANYCHIP_AMX void tiles_amx(const Problem& p, int64_t m0, int64_t m1, int64_t nb0) {
  const int64_t step = p.group_size % 64 == 0 ? 64 : p.group_size;
  AmxConfig cfg;
  cfg.rows[0] = kAmxTokens;
  cfg.colsb[0] = uint16_t(step);
  cfg.rows[1] = uint8_t(step / 4);
  cfg.colsb[1] = 64;
  for (int t = 4; t < 8; ++t) cfg.rows[t] = kAmxTokens, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const int64_t groups = p.groups;
  for (int b = 0; b < 2; ++b) {
    const uint8_t* w = p.wu + b * (p.k / 8) * kUnpackedChunkBytes;
    for (int64_t t = m0; t < m1; t += kAmxTokens) {
      const int8_t* x = p.xq + t * p.k;
      __m512 y[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) y[i] = _mm512_setzero_ps();
      if (groups > 0) amx_group_dots<0>(p, x, w, 0, step);
      if (groups > 1) amx_group_dots<1>(p, x, w, 1, step);
      if (groups > 2) amx_group_dots<2>(p, x, w, 2, step);
      if (groups > 3) amx_group_dots<3>(p, x, w, 3, step);
      for (int64_t g = 0; g < groups; ++g) {
        switch (g % kAmxRing) {
          case 0: amx_ring_step<0, DOTS>(p, x, w, t, nb0 + b, g, step, y); break;
          case 1: amx_ring_step<1, DOTS>(p, x, w, t, nb0 + b, g, step, y); break;
          case 2: amx_ring_step<2, DOTS>(p, x, w, t, nb0 + b, g, step, y); break;
          default: amx_ring_step<3, DOTS>(p, x, w, t, nb0 + b, g, step, y); break;
        }
      }
      if constexpr (!DOTS) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) store_rows_avx512(p, t + i, nb0 + b, y[i]);
      }
    }
  }
  _tile_release();
}

// 32 tokens x the pair (2 x 2 tiles of 16 x 16: each A and B tile loaded once for two dots): A 0-1, B 2-3, sums
// 4-7, one group at a time, its 64 rows of fp32 sums in memory. Tokens [m0, m1), a multiple of 32.
template <bool DOTS>
ANYCHIP_AMX void tiles_amx22(const Problem& p, int64_t m0, int64_t m1, int64_t nb0) {
  const int64_t step = p.group_size % 64 == 0 ? 64 : p.group_size;
  AmxConfig cfg;
  for (int t = 0; t < 2; ++t) cfg.rows[t] = kAmxTokens, cfg.colsb[t] = uint16_t(step);
  for (int t = 2; t < 4; ++t) cfg.rows[t] = uint8_t(step / 4), cfg.colsb[t] = 64;
  for (int t = 4; t < 8; ++t) cfg.rows[t] = kAmxTokens, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const uint8_t* w0 = p.wu;
  const uint8_t* w1 = p.wu + (p.k / 8) * kUnpackedChunkBytes;
  for (int64_t t = m0; t < m1; t += 2 * kAmxTokens) {
    const int8_t* x0 = p.xq + t * p.k;
    const int8_t* x1 = x0 + kAmxTokens * p.k;
    alignas(64) float y[4][16][16] = {};  // (token tile, block) = (0, 0), (0, 1), (1, 0), (1, 1)
    for (int64_t g = 0; g < p.groups; ++g) {
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t k0 = g * p.group_size; k0 < (g + 1) * p.group_size; k0 += step) {
        _tile_loadd(0, x0 + k0, p.k);
        _tile_loadd(1, x1 + k0, p.k);
        _tile_loadd(2, w0 + k0 / 4 * 64, 64);
        _tile_loadd(3, w1 + k0 / 4 * 64, 64);
        _tile_dpbssd(4, 0, 2);
        _tile_dpbssd(5, 0, 3);
        _tile_dpbssd(6, 1, 2);
        _tile_dpbssd(7, 1, 3);
      }
      alignas(64) int32_t sums[4][16][16];
      _tile_stored(4, sums[0], 64);
      _tile_stored(5, sums[1], 64);
      _tile_stored(6, sums[2], 64);
      _tile_stored(7, sums[3], 64);
      for (int c = 0; c < 4; ++c) {
        const int64_t nb = nb0 + c % 2, m = t + (c / 2) * kAmxTokens;
        const __m512 s = scales_avx512(p, (nb * p.groups + g) * kRows);
        for (int i = 0; i < 16; ++i) {
          if constexpr (DOTS) {
            store_dots(p, m + i, nb, g, sums[c][i]);
          } else {
            const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(sums[c][i]));
            _mm512_store_ps(y[c][i], _mm512_fmadd_ps(v, s, _mm512_load_ps(y[c][i])));
          }
        }
      }
    }
    if constexpr (!DOTS) {
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 16; ++i)
          store_rows_avx512(p, t + (c / 2) * kAmxTokens + i, nb0 + c % 2, _mm512_load_ps(y[c][i]));
    }
  }
  _tile_release();
}

// The AMX tiles for [m0, m1). Groups of 128 and more: 32 tokens at a time (tiles_amx22; a group's several dots
// per tile pay for its scaling without the ring), the last 16 by tiles_amx; smaller groups: tiles_amx, whose ring
// hides the scaling that follows every one or two dots (same-process A/B, 2 threads, M = 512: the 2 x 2 tiles 0.38-0.46
// of the AVX512 time at G128 against the ring's 0.45-0.57, but 0.73-0.80 against 0.64-0.75 at G32).
template <bool DOTS>
ANYCHIP_AMX void run_amx(const Problem& p, int64_t m0, int64_t m1, int64_t nb0) {
  int64_t mid = m0;
  if (ANYCHIP_AMX_22 && p.group_size >= 128) {
    mid = m0 + (m1 - m0) / (2 * kAmxTokens) * (2 * kAmxTokens);
    if (mid > m0) tiles_amx22<DOTS>(p, m0, mid, nb0);
  }
  if (m1 > mid) tiles_amx<DOTS>(p, mid, m1, nb0);
}

#endif  // ANYCHIP_X86

}  // namespace anychip
