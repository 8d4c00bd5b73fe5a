// g++ -O3 -std=c++17 -fopenmp -fno-math-errno -I anychip/kernels/csrc docs/bench/zen4-threads-s45/tile_ab.cpp -o tile_ab
// Same-process A/B of x86 prefill tile variants (single thread, M = 480, unpacked pairs of blocks), outputs compared bit for bit.
#include "w4a8_x86.h"
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
using namespace anychip;

namespace var {
// V1: shipped tile but the x broadcast embedded in each dpbusd ({1to16} memory operand)
template <int MT, int NB>
ANYCHIP_AVX512 void tile_embed(const Problem& p, int64_t m0, int64_t nb0) {
  const int64_t cpg = p.group_size / 8;
  const uint8_t* w[NB]; int64_t sw[NB];
  for (int b = 0; b < NB; ++b) { w[b] = p.wu + b * (p.k / 8) * kUnpackedChunkBytes; sw[b] = (nb0 + b) * p.groups * kRows; }
  const int8_t* x[MT];
  for (int i = 0; i < MT; ++i) x[i] = p.xq + (m0 + i) * p.k;
  __m512 y[MT][NB];
  for (int i = 0; i < MT; ++i) for (int b = 0; b < NB; ++b) y[i][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512i acc[MT][NB];
    for (int i = 0; i < MT; ++i) { const __m512i corr = _mm512_set1_epi32(p.xcorr[(m0 + i) * p.groups + g]); for (int b = 0; b < NB; ++b) acc[i][b] = corr; }
    const int64_t kg = g * p.group_size;
    for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
      const int64_t kk = kg + (c - g * cpg) * 8;
      for (int h = 0; h < 2; ++h) {
        __m512i wv[NB];
        for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w[b] + c * kUnpackedChunkBytes + h * kChunkBytes);
        for (int i = 0; i < MT; ++i) for (int b = 0; b < NB; ++b) acc[i][b] = dpbusd_bcast(acc[i][b], wv[b], x[i] + kk + 4 * h);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 s = scales_avx512(p, sw[b] + g * kRows);
      for (int i = 0; i < MT; ++i) y[i][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][b]), s, y[i][b]);
    }
  }
  for (int i = 0; i < MT; ++i) for (int b = 0; b < NB; ++b) store_rows_avx512(p, m0 + i, nb0 + b, y[i][b]);
}
// V2: y kept in memory (L1), more accumulators: MT tokens x NB blocks, shared broadcast
template <int MT, int NB>
ANYCHIP_AVX512 void tile_ymem(const Problem& p, int64_t m0, int64_t nb0) {
  const int64_t cpg = p.group_size / 8;
  const uint8_t* w[NB]; int64_t sw[NB];
  for (int b = 0; b < NB; ++b) { w[b] = p.wu + b * (p.k / 8) * kUnpackedChunkBytes; sw[b] = (nb0 + b) * p.groups * kRows; }
  const int8_t* x[MT];
  for (int i = 0; i < MT; ++i) x[i] = p.xq + (m0 + i) * p.k;
  alignas(64) float ym[MT][NB][16];
  std::memset(ym, 0, sizeof(ym));
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512i acc[MT][NB];
    for (int i = 0; i < MT; ++i) { const __m512i corr = _mm512_set1_epi32(p.xcorr[(m0 + i) * p.groups + g]); for (int b = 0; b < NB; ++b) acc[i][b] = corr; }
    const int64_t kg = g * p.group_size;
    for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
      const int64_t kk = kg + (c - g * cpg) * 8;
      for (int h = 0; h < 2; ++h) {
        __m512i wv[NB];
        for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w[b] + c * kUnpackedChunkBytes + h * kChunkBytes);
        for (int i = 0; i < MT; ++i) {
          const __m512i xv = _mm512_set1_epi32(load4(x[i] + kk + 4 * h));
          for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_dpbusd_epi32(acc[i][b], wv[b], xv);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 s = scales_avx512(p, sw[b] + g * kRows);
      for (int i = 0; i < MT; ++i) _mm512_store_ps(ym[i][b], _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][b]), s, _mm512_load_ps(ym[i][b])));
    }
  }
  for (int i = 0; i < MT; ++i) for (int b = 0; b < NB; ++b) store_rows_avx512(p, m0 + i, nb0 + b, _mm512_load_ps(ym[i][b]));
}
}  // namespace var

using Tile = void (*)(const Problem&, int64_t, int64_t);

// whole GEMM single-threaded: per group of NB blocks, unpack, then every MT-token tile
double gemm(Problem p, Tile t, int mt, int nb, std::vector<uint8_t>& buf) {
  auto t0 = std::chrono::steady_clock::now();
  const int64_t nblocks = p.n / kRows;
  for (int64_t b0 = 0; b0 < nblocks; b0 += nb) {
    unpack_blocks_avx512<false>(p, b0, nb, buf.data());
    p.wu = buf.data();
    for (int64_t m0 = 0; m0 + mt <= p.m; m0 += mt) t(p, m0, b0);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main(int argc, char** argv) {
  const int64_t M = 480;  // divisible by 6, 8, 4, 12, 10
  const int64_t shapes[][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}};
  std::mt19937 rng(1);
  struct V { const char* name; Tile t; int mt, nb; };
  V vs[] = {{"ship6x2", &tile_avx512<6, 2, 1, false, true>, 6, 2},
            {"embed6x2", &var::tile_embed<6, 2>, 6, 2},
            {"ymem6x2", &var::tile_ymem<6, 2>, 6, 2},
            {"ymem6x4", &var::tile_ymem<6, 4>, 6, 4},
            {"ymem8x3", &var::tile_ymem<8, 3>, 8, 3},
            {"ymem12x2", &var::tile_ymem<12, 2>, 12, 2},
            {"ymem4x4", &var::tile_ymem<4, 4>, 4, 4},
            {"embed4x4", &var::tile_embed<4, 4>, 4, 4},
            {"ymem10x2", &var::tile_ymem<10, 2>, 10, 2}};
  const int nv = sizeof(vs) / sizeof(vs[0]);
  double tot[16] = {0};
  for (auto& s : shapes) {
    const int64_t K = s[0], N = s[1], G = 32, groups = K / G, nblocks = N / kRows;
    std::vector<uint8_t> w(nblocks * K * 8);
    for (auto& b : w) b = rng();
    std::vector<int8_t> xq(M * K);
    for (auto& v : xq) v = int8_t(int(rng() % 255) - 127);
    std::vector<int32_t> corr(M * groups);
    for (int64_t m = 0; m < M; ++m) for (int64_t g = 0; g < groups; ++g) { int32_t sum = 0; for (int j = 0; j < G; ++j) sum += xq[m * K + g * G + j]; corr[m * groups + g] = -8 * sum; }
    std::vector<float> sx(M), sw(nblocks * groups * 16);
    for (auto& v : sx) v = 0.01f + (rng() % 1000) * 1e-5f;
    for (auto& v : sw) v = 0.001f + (rng() % 1000) * 1e-6f;
    std::vector<uint16_t> out[16];
    std::vector<uint8_t> buf(12 * (K / 8) * kUnpackedChunkBytes + 4096);
    Problem p{};
    p.xq = xq.data(); p.sx = sx.data(); p.xcorr = corr.data(); p.w = w.data(); p.sw = sw.data(); p.sw_bf16 = nullptr;
    p.bias = nullptr; p.out_type = OutType::kBF16; p.m = M; p.n = N; p.k = K; p.groups = groups; p.group_size = G;
    double best[16];
    for (int v = 0; v < nv; ++v) { best[v] = 1e9; out[v].assign(M * N, 0); }
    for (int rep = 0; rep < 15; ++rep)
      for (int v = 0; v < nv; ++v) {
        if (nblocks % vs[v].nb) continue;
        p.out = out[v].data();
        best[v] = std::min(best[v], gemm(p, vs[v].t, vs[v].mt, vs[v].nb, buf));
      }
    printf("K=%ld N=%ld:", K, N);
    for (int v = 0; v < nv; ++v) {
      if (nblocks % vs[v].nb) { printf("  %s n/a", vs[v].name); continue; }
      const bool same = out[v] == out[0];
      printf("  %s %.3f ms %.0f GMAC/s%s", vs[v].name, best[v] * 1e3, M * N * K / best[v] / 1e9, same ? "" : " MISMATCH");
      tot[v] += best[v];
    }
    printf("\n");
  }
}
