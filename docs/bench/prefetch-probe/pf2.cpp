#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <pthread.h>
#include "probe.h"
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
