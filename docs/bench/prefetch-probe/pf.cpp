// prefetch-during-serial-gap probe: does reading the next chunk on the idle core make the next "GEMV" faster?
#include <immintrin.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <pthread.h>
#include "probe.h"
__attribute__((noinline)) static void touch(const uint8_t*p,size_t n){ for(size_t i=0;i<n;i+=64) _mm_prefetch((const char*)p+i,_MM_HINT_T1);}
__attribute__((noinline)) static float touchload(const uint8_t*p,size_t n){ __m512i a=_mm512_setzero_si512(); for(size_t i=0;i<n;i+=64) a=_mm512_xor_si512(a,_mm512_loadu_si512(p+i)); return (float)_mm512_reduce_add_epi32(a);}
static void spin(double us){double t=now()+us*1e-6; volatile double x=1; while(now()<t){for(int i=0;i<100;i++)x=x*1.0000001;}}
std::atomic<int> phase{0}; std::atomic<int> done1{0}; volatile float sink;
int main(int argc,char**argv){
  size_t chunk=(size_t)(atof(argv[1])*1e6); int nch=atoi(argv[2]); double gap=atof(argv[3]); int mode=atoi(argv[4]); int steps=atoi(argv[5]);
  size_t tot=chunk*nch; uint8_t*buf=(uint8_t*)aligned_alloc(64,tot); memset(buf,1,tot);
  size_t half=chunk/2/64*64;
  std::thread w([&]{pin(1); int seen=0; for(;;){ int p; while((p=phase.load(std::memory_order_acquire))==seen) _mm_pause(); if(p<0) return; seen=p;
      int c=(p-1)/2 % nch; // odd phase: compute share of chunk c ; even phase: gap after chunk c
      if(p&1){ sink=readsum(buf+c*chunk+half,chunk-half); done1.fetch_add(1);} 
      else { int n=(c+1)%nch; if(mode==1) sink=touchload(buf+n*chunk,chunk); else if(mode==2) sink=touchload(buf+n*chunk+half,chunk-half); else if(mode==3) touch(buf+n*chunk,chunk); done1.fetch_add(1);} }});
  pin(0); int p=0; double best=1e9;
  for(int s=0;s<steps;s++){ double t0=now(); double comp=0;
    for(int c=0;c<nch;c++){ double a=now(); phase.store(++p,std::memory_order_release); sink=readsum(buf+c*chunk,half); while(done1.load()<p) _mm_pause(); comp+=now()-a;
      phase.store(++p,std::memory_order_release); spin(gap); while(done1.load()<p) _mm_pause(); }
    double t=now()-t0; if(t<best)best=t; if(s==steps-1||s<2) printf("step %d: %.3f ms (compute %.3f ms, %.1f GB/s during compute)\n",s,t*1e3,comp*1e3,tot/comp/1e9); }
  printf("mode %d best %.3f ms\n",mode,best*1e3); phase.store(-1); w.join(); }
