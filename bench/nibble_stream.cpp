// The 4-bit decode kernels alone (csrc/nibble_kernels.cpp), without Python, threads or the MoE around
// them: one thread streams random experts of one projection's shape (MXFP4: gpt-oss-20b's gate_up,
// 5760 x 2880, 32 experts, 265 MB; int4: Qwen3-30B-A3B-like 1536 x 2048 group 128, 128 experts) at T
// tokens, against a float32 sum over 256 MiB in the same process; best of 6 rounds, CPU time of the
// thread. One line: kernel GB/s (codes + scales), probe GB/s, their ratio.
//
//   g++ -O3 -mavx2 -mfma -std=c++17 -Iexpertcache/kernels/csrc bench/nibble_stream.cpp \
//       expertcache/kernels/csrc/nibble_kernels.cpp -o /tmp/nibble_stream
//   /tmp/nibble_stream CODE MATH T PF   (CODE 0 mxfp4 / 1 int4, MATH 0 exact / 1 fast, PF rows ahead)
#include "nibble_kernels.h"
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include <ctime>
using namespace std;
static double now(){ timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+1e-9*t.tv_nsec; }
static double wall(){ return chrono::duration<double>(chrono::steady_clock::now().time_since_epoch()).count(); }
__attribute__((target("avx512f"))) float probe(const float* a, size_t n){
  __m512 s0=_mm512_setzero_ps(),s1=s0,s2=s0,s3=s0;
  for(size_t i=0;i<n;i+=64){ s0=_mm512_add_ps(s0,_mm512_loadu_ps(a+i)); s1=_mm512_add_ps(s1,_mm512_loadu_ps(a+i+16));
    s2=_mm512_add_ps(s2,_mm512_loadu_ps(a+i+32)); s3=_mm512_add_ps(s3,_mm512_loadu_ps(a+i+48)); }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0,s1),_mm512_add_ps(s2,s3)));
}
int main(int argc,char**argv){
  int code = argc>1? atoi(argv[1]) : 0; // 0 mxfp4 1 int4
  int math = argc>2? atoi(argv[2]) : 1; // 0 exact 1 fast
  int T = argc>3? atoi(argv[3]) : 1;
  int pf = argc>4? atoi(argv[4]) : 4;
  int64_t K = code==0? 2880 : 2048, N = code==0? 5760 : 1536, S = code==0? 32: 128;
  int64_t G = code==0? 32: 128;
  int64_t wrow=K/2, zrow=K/G, nb=K/32;
  size_t wb = S*N*wrow; vector<uint8_t> w(wb), z(S*N*zrow); vector<float> sc(S*N*zrow);
  mt19937 rng(0); for(auto&b:w) b=rng(); for(auto&b:z) b= code==0? 118+rng()%6 : 6+rng()%4; for(auto&f:sc) f=(rng()%1000)*1e-5f;
  vector<float> x(K*T); for(auto&f:x) f=(int(rng()%2001)-1000)*1e-3f;
  int64_t Kp=nib::padded(K);
  vector<float> xf(Kp*T), xs(Kp/8*T); vector<int8_t> xq(Kp*T); vector<float> qs(Kp/8*T); vector<int32_t> qc(Kp/8*T);
  vector<const float*> pf_(T), ps_(T), pqs(T); vector<const int8_t*> pq(T); vector<const int32_t*> pc(T);
  for(int t=0;t<T;t++){ nib::prep_f32(x.data()+t*K,K,xf.data()+t*Kp, code==1? xs.data()+t*Kp/8:nullptr);
    nib::prep_q8(code,x.data()+t*K,K,xq.data()+t*Kp,qs.data()+t*Kp/8,qc.data()+t*Kp/8);
    pf_[t]=xf.data()+t*Kp; ps_[t]=xs.data()+t*Kp/8; pq[t]=xq.data()+t*Kp; pqs[t]=qs.data()+t*Kp/8; pc[t]=qc.data()+t*Kp/8; }
  vector<float> y(N*T);
  size_t pn = 64<<20; vector<float> big(pn, 1.f);
  double best=0, bestp=0, chk=0;
  size_t per = N*wrow + N*zrow*(code==0?1:5);
  for(int round=0; round<6; ++round){
    double c0=now(); float s=probe(big.data(),pn); double c1=now(); chk+=s;
    double bw = pn*4/(c1-c0); if(bw>bestp) bestp=bw;
    double t0=now();
    int reps = 24;
    for(int r=0;r<reps;r++){ int64_t e = rng()%S;
      nib::Rows R{w.data()+e*N*wrow, wrow, z.data()+e*N*zrow, zrow, code==1? sc.data()+e*N*zrow:nullptr, zrow, G};
      if(math==0) nib::rows_f32(code,R,N,K,pf_.data(),ps_.data(),T,y.data(),N,pf);
      else nib::rows_q8(code,R,N,K,pq.data(),pqs.data(),pc.data(),T,y.data(),N,pf);
      chk+=y[0]; }
    double t1=now(); double g = reps*per/(t1-t0); if(g>best) best=g;
  }
  printf("nibble_stream: code=%s math=%s T=%d pf=%d kernel_GBps=%.1f probe_GBps=%.1f ratio=%.0f%% (sink %g)\n",code==0?"mxfp4":"int4",math==0?"exact":"fast",T,pf,best/1e9,bestp/1e9,100*best/bestp,chk);
}
