// vpdpbusd throughput: 12 independent zmm (and ymm) accumulator chains, registers only (session 45).
// g++ -O2 -fopenmp vnni_peak.cpp -o vnni_peak && ./vnni_peak
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <omp.h>
__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) long run(long iters, int* out) {
  __m512i a[12]; __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(5);
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], x, y);
    asm volatile("" : "+v"(x));
  }
  __m512i s = a[0]; for (int i = 1; i < 12; ++i) s = _mm512_add_epi32(s, a[i]);
  *out = _mm512_reduce_add_epi32(s); return iters * 12;
}
__attribute__((target("avx2,avxvnni"), noinline)) long run256(long iters, int* out) {
  __m256i a[12]; __m256i x = _mm256_set1_epi8(3), y = _mm256_set1_epi8(5);
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_epi32(i);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm256_dpbusd_avx_epi32(a[i], x, y);
    asm volatile("" : "+v"(x));
  }
  __m256i s = a[0]; for (int i = 1; i < 12; ++i) s = _mm256_add_epi32(s, a[i]);
  int o[8]; _mm256_storeu_si256((__m256i*)o, s); *out = o[0]; return iters * 12;
}
int main() {
  int o; long iters = 200000000;
  for (int rep = 0; rep < 2; ++rep) {
    auto t0 = std::chrono::steady_clock::now(); long n = run(iters, &o);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("zmm 1 thread: %.2f G instr/s = %.0f GMAC/s (%d)\n", n / s / 1e9, n * 64 / s / 1e9, o);
  }
  double t0 = omp_get_wtime(); long tot = 0;
#pragma omp parallel num_threads(2) reduction(+:tot)
  { int oo; tot += run(iters, &oo); }
  double s = omp_get_wtime() - t0;
  printf("zmm 2 threads: %.0f GMAC/s total\n", tot * 64 / s / 1e9);
}
