#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <pthread.h>
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
__attribute__((noinline)) static float readsum(const uint8_t*p,size_t n){
  __m512i a0=_mm512_setzero_si512(),a1=a0,a2=a0,a3=a0; const __m512i m=_mm512_set1_epi8(15), x=_mm512_set1_epi8(3);
  for(size_t i=0;i+128<=n;i+=128){__m512i v=_mm512_loadu_si512(p+i), u=_mm512_loadu_si512(p+i+64);
    a0=_mm512_dpbusd_epi32(a0,_mm512_and_si512(v,m),x); a1=_mm512_dpbusd_epi32(a1,_mm512_and_si512(_mm512_srli_epi16(v,4),m),x);
    a2=_mm512_dpbusd_epi32(a2,_mm512_and_si512(u,m),x); a3=_mm512_dpbusd_epi32(a3,_mm512_and_si512(_mm512_srli_epi16(u,4),m),x);}
  return (float)_mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0,a1),_mm512_add_epi32(a2,a3)));}
volatile float sink;
int main(){ size_t n=885000/64*64; size_t big=400u<<20; uint8_t*flush=(uint8_t*)aligned_alloc(64,big); memset(flush,2,big);
  uint8_t*b=(uint8_t*)aligned_alloc(64,n*64); memset(b,1,n*64); pin(0);
  for(int r=0;r<5;r++){
    // cold: use a fresh region each time (walk through 64 regions)
    uint8_t*p=b+(size_t)(r*7%64)*n; sink=readsum(flush,big);  // evict
    double t=now(); sink=readsum(p,n); double cold=now()-t;
    t=now(); sink=readsum(p,n); double own=now()-t;
    uint8_t*q=b+(size_t)((r*7+3)%64)*n; sink=readsum(flush,big);
    std::thread th([&]{pin(1); sink=readsum(q,n);}); th.join();
    t=now(); sink=readsum(q,n); double rem=now()-t;
    printf("cold %.1f GB/s  own-L2 %.1f GB/s  other-core %.1f GB/s\n", n/cold/1e9, n/own/1e9, n/rem/1e9);
  }}
