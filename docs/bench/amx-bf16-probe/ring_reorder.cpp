#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <chrono>
#include <vector>
#include <cmath>

struct alignas(64) Cfg { uint8_t palette=1, start=0; uint8_t r[14]={}; uint16_t colsb[16]={}; uint8_t rows[16]={}; };
constexpr int M=512, K=576, G=32, NG=K/G;
alignas(64) int8_t xq[M*K];
alignas(64) uint16_t xb[M*K];
alignas(64) int8_t wi[2][K/4*64];     // int8 B layout: K/4 rows of 16 cols x 4
alignas(64) uint16_t wb[2][K/2*32];   // bf16 B layout: K/2 rows of 16 cols x 2
alignas(64) float sw[2][NG][16];
alignas(64) float out1[M][32], out2[M][32];

static inline uint16_t f2bf(float f){uint32_t u; memcpy(&u,&f,4); return u>>16;} // exact for small ints

#define DOTS_I(S) for(int k0=g*G;k0<(g+1)*G;k0+=G){_tile_loadd(0,x+k0,K);_tile_loadd(1,w+k0/4*64,64);_tile_dpbssd(S,0,1);}
#define DOTS_B(S) for(int k0=g*G;k0<(g+1)*G;k0+=G){_tile_loadd(0,xbp+k0,2*K);_tile_loadd(1,wbp+k0/2*32,64);_tile_dpbf16ps(S,0,1);}

template<int S> inline void zero(){ _tile_zero(S); }

template<bool R> __attribute__((noinline)) void run_int8(){
  Cfg c; c.rows[0]=16;c.colsb[0]=G; c.rows[1]=G/4;c.colsb[1]=64; for(int t=4;t<8;++t)c.rows[t]=16,c.colsb[t]=64;
  _tile_loadconfig(&c);
  for(int b=0;b<2;++b){ const int8_t* w=wi[b];
    for(int t=0;t<M;t+=16){ const int8_t* x=xq+t*K; __m512 y[16]; for(int i=0;i<16;++i)y[i]=_mm512_setzero_ps();
      int g;
      g=0;_tile_zero(4);DOTS_I(4) g=1;_tile_zero(5);DOTS_I(5) g=2;_tile_zero(6);DOTS_I(6) g=3;_tile_zero(7);DOTS_I(7)
      for(int gg=0;gg<NG;++gg){ alignas(64) int32_t s[16][16];
        switch(gg%4){case 0:_tile_stored(4,s,64);break;case 1:_tile_stored(5,s,64);break;case 2:_tile_stored(6,s,64);break;default:_tile_stored(7,s,64);}
        if(R){
        g=gg+4; if(g<NG){ switch(gg%4){case 0:_tile_zero(4);DOTS_I(4) break;case 1:_tile_zero(5);DOTS_I(5) break;case 2:_tile_zero(6);DOTS_I(6) break;default:_tile_zero(7);DOTS_I(7)} }
        __m512 sc=_mm512_load_ps(sw[b][gg]);
#pragma GCC unroll 16
        for(int i=0;i<16;++i) y[i]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s[i])),sc,y[i]);
        } else {
        __m512 sc=_mm512_load_ps(sw[b][gg]);
#pragma GCC unroll 16
        for(int i=0;i<16;++i) y[i]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s[i])),sc,y[i]);
        g=gg+4; if(g<NG){ switch(gg%4){case 0:_tile_zero(4);DOTS_I(4) break;case 1:_tile_zero(5);DOTS_I(5) break;case 2:_tile_zero(6);DOTS_I(6) break;default:_tile_zero(7);DOTS_I(7)} }
        }
      }
      for(int i=0;i<16;++i)_mm512_storeu_ps(&(R?out2:out1)[t+i][b*16],y[i]);
    }}
  _tile_release();
}
__attribute__((noinline)) void run_bf16(){
  Cfg c; c.rows[0]=16;c.colsb[0]=2*G; c.rows[1]=G/2;c.colsb[1]=64; for(int t=4;t<8;++t)c.rows[t]=16,c.colsb[t]=64;
  _tile_loadconfig(&c);
  for(int b=0;b<2;++b){ const uint16_t* wbp=wb[b];
    for(int t=0;t<M;t+=16){ const uint16_t* xbp=xb+t*K; __m512 y[16]; for(int i=0;i<16;++i)y[i]=_mm512_setzero_ps();
      int g;
      g=0;_tile_zero(4);DOTS_B(4) g=1;_tile_zero(5);DOTS_B(5) g=2;_tile_zero(6);DOTS_B(6) g=3;_tile_zero(7);DOTS_B(7)
      for(int gg=0;gg<NG;++gg){ alignas(64) float s[16][16];
        switch(gg%4){case 0:_tile_stored(4,s,64);break;case 1:_tile_stored(5,s,64);break;case 2:_tile_stored(6,s,64);break;default:_tile_stored(7,s,64);}
        __m512 sc=_mm512_load_ps(sw[b][gg]);
#pragma GCC unroll 16
        for(int i=0;i<16;++i) y[i]=_mm512_fmadd_ps(_mm512_load_ps(s[i]),sc,y[i]);
        g=gg+4; if(g<NG){ switch(gg%4){case 0:_tile_zero(4);DOTS_B(4) break;case 1:_tile_zero(5);DOTS_B(5) break;case 2:_tile_zero(6);DOTS_B(6) break;default:_tile_zero(7);DOTS_B(7)} }
      }
      for(int i=0;i<16;++i)_mm512_storeu_ps(&out2[t+i][b*16],y[i]);
    }}
  _tile_release();
}
int main(){
  if(syscall(SYS_arch_prctl,0x1023,18)){puts("no amx");return 1;}
  srand(1);
  for(int i=0;i<M*K;++i){int v=rand()%255-127; xq[i]=v; xb[i]=f2bf((float)v);}
  for(int b=0;b<2;++b){
    for(int n=0;n<16;++n)for(int k=0;k<K;++k){int q=rand()%16-8; wi[b][(k/4)*64+n*4+k%4]=q; wb[b][(k/2)*32+n*2+k%2]=f2bf((float)q);}
    for(int g=0;g<NG;++g)for(int n=0;n<16;++n)sw[b][g][n]=(rand()%1000+1)*1e-5f;
  }
  for(int rep=0;rep<3;++rep){
  double best1=1e9,best2=1e9;
  for(int it=0;it<200;++it){
    auto a=std::chrono::steady_clock::now(); run_int8<false>(); auto b=std::chrono::steady_clock::now(); run_int8<true>(); auto c=std::chrono::steady_clock::now();
    best1=std::min(best1,std::chrono::duration<double>(b-a).count()); best2=std::min(best2,std::chrono::duration<double>(c-b).count());
  }
  printf("int8 %.2f us  reorder %.2f us  ratio %.3f  same=%d\n",best1*1e6,best2*1e6,best2/best1,memcmp(out1,out1,sizeof out1)==0);
  }
}
