// shared by pf.cpp and pf2.cpp: pin a thread to a CPU, a clock, and a GEMV-like read of n bytes (nibbles
// unpacked, vpdpbusd into four accumulators)
#pragma once
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstddef>
#include <pthread.h>
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
__attribute__((noinline)) static float readsum(const uint8_t*p,size_t n){
  __m512i a0=_mm512_setzero_si512(),a1=a0,a2=a0,a3=a0; const __m512i m=_mm512_set1_epi8(15), x=_mm512_set1_epi8(3);
  for(size_t i=0;i+128<=n;i+=128){__m512i v=_mm512_loadu_si512(p+i), u=_mm512_loadu_si512(p+i+64);
    a0=_mm512_dpbusd_epi32(a0,_mm512_and_si512(v,m),x); a1=_mm512_dpbusd_epi32(a1,_mm512_and_si512(_mm512_srli_epi16(v,4),m),x);
    a2=_mm512_dpbusd_epi32(a2,_mm512_and_si512(u,m),x); a3=_mm512_dpbusd_epi32(a3,_mm512_and_si512(_mm512_srli_epi16(u,4),m),x);}
  return (float)_mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0,a1),_mm512_add_epi32(a2,a3)));}
