// A straightforward single-threaded C forward pass for llama2.c legacy files
// (written from shared/models/README.md), greedy from BOS: the reference point
// of the single-stream goal in BENCHMARKS.md.
//   gcc -O3 -o /tmp/llama2c_run benches/reference/llama2c_run.c -lm
//   /tmp/llama2c_run ../shared/models/stories260K.bin 256
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <time.h>
typedef struct { int dim, hid, L, nh, nkv, vocab, seq; } Cfg;
static void rmsnorm(float* o, const float* x, const float* w, int n){ float ss=0; for(int i=0;i<n;i++) ss+=x[i]*x[i]; ss/=n; ss+=1e-5f; ss=1.0f/sqrtf(ss); for(int i=0;i<n;i++) o[i]=w[i]*(ss*x[i]); }
static void matmul(float* o, const float* x, const float* w, int n, int d){ for(int i=0;i<d;i++){ float v=0; for(int j=0;j<n;j++) v+=w[i*n+j]*x[j]; o[i]=v; } }
static void softmax(float* x, int n){ float m=x[0]; for(int i=1;i<n;i++) if(x[i]>m) m=x[i]; float s=0; for(int i=0;i<n;i++){ x[i]=expf(x[i]-m); s+=x[i]; } for(int i=0;i<n;i++) x[i]/=s; }
int main(int argc, char** argv){
  FILE* f=fopen(argv[1],"rb"); Cfg c; fread(&c,sizeof(int),7,f); int shared=c.vocab>0; c.vocab=abs(c.vocab);
  fseek(f,0,SEEK_END); long sz=ftell(f); fseek(f,28,SEEK_SET); float* data=malloc(sz); fread(data,1,sz-28,f); fclose(f);
  int hd=c.dim/c.nh, kvd=c.nkv*hd, steps=atoi(argv[2]);
  float *p=data; float* emb=p; p+=c.vocab*c.dim; float* ratt=p; p+=c.L*c.dim; float* wq=p; p+=c.L*c.dim*c.dim; float* wk=p; p+=c.L*c.dim*kvd; float* wv=p; p+=c.L*c.dim*kvd;
  float* wo=p; p+=c.L*c.dim*c.dim; float* rffn=p; p+=c.L*c.dim; float* w1=p; p+=c.L*c.dim*c.hid; float* w2=p; p+=c.L*c.dim*c.hid; float* w3=p; p+=c.L*c.dim*c.hid; float* rfin=p;
  float *x=calloc(c.dim,4),*xb=calloc(c.dim,4),*xb2=calloc(c.dim,4),*hb=calloc(c.hid,4),*hb2=calloc(c.hid,4),*q=calloc(c.dim,4),*att=calloc(c.nh*c.seq,4),*logits=calloc(c.vocab,4);
  float *kc=calloc((size_t)c.L*c.seq*kvd,4),*vc=calloc((size_t)c.L*c.seq*kvd,4);
  int tok=1; struct timespec t0,t1; clock_gettime(CLOCK_MONOTONIC,&t0); long sum=0;
  for(int pos=0;pos<steps;pos++){
    memcpy(x,emb+tok*c.dim,c.dim*4);
    for(int l=0;l<c.L;l++){
      rmsnorm(xb,x,ratt+l*c.dim,c.dim);
      float* k=kc+((size_t)l*c.seq+pos)*kvd; float* v=vc+((size_t)l*c.seq+pos)*kvd;
      matmul(q,xb,wq+l*c.dim*c.dim,c.dim,c.dim); matmul(k,xb,wk+l*c.dim*kvd,c.dim,kvd); matmul(v,xb,wv+l*c.dim*kvd,c.dim,kvd);
      for(int i=0;i<c.dim;i+=2){ int hi=i%hd; float fr=1.0f/powf(10000.0f,hi/(float)hd); float val=pos*fr; float fcr=cosf(val),fci=sinf(val);
        int rot= i<kvd?2:1; for(int r=0;r<rot;r++){ float* vec=r==0?q:k; float a=vec[i],b=vec[i+1]; vec[i]=a*fcr-b*fci; vec[i+1]=a*fci+b*fcr; } }
      for(int h=0;h<c.nh;h++){ float* qh=q+h*hd; float* a=att+h*c.seq; int kh=h/(c.nh/c.nkv);
        for(int t=0;t<=pos;t++){ float* kk=kc+((size_t)l*c.seq+t)*kvd+kh*hd; float s=0; for(int i=0;i<hd;i++) s+=qh[i]*kk[i]; a[t]=s/sqrtf(hd); }
        softmax(a,pos+1); float* o=xb+h*hd; memset(o,0,hd*4);
        for(int t=0;t<=pos;t++){ float* vv=vc+((size_t)l*c.seq+t)*kvd+kh*hd; for(int i=0;i<hd;i++) o[i]+=a[t]*vv[i]; } }
      matmul(xb2,xb,wo+l*c.dim*c.dim,c.dim,c.dim); for(int i=0;i<c.dim;i++) x[i]+=xb2[i];
      rmsnorm(xb,x,rffn+l*c.dim,c.dim); matmul(hb,xb,w1+l*c.dim*c.hid,c.dim,c.hid); matmul(hb2,xb,w3+l*c.dim*c.hid,c.dim,c.hid);
      for(int i=0;i<c.hid;i++){ float vv=hb[i]; vv*=1.0f/(1.0f+expf(-vv)); hb[i]=vv*hb2[i]; }
      matmul(xb,hb,w2+l*c.dim*c.hid,c.hid,c.dim); for(int i=0;i<c.dim;i++) x[i]+=xb[i];
    }
    rmsnorm(x,x,rfin,c.dim); matmul(logits,x,emb,c.dim,c.vocab);
    int best=0; for(int i=1;i<c.vocab;i++) if(logits[i]>logits[best]) best=i; tok=best; sum+=tok; if(pos<20) printf("%d ",tok);
  }
  clock_gettime(CLOCK_MONOTONIC,&t1); double dt=(t1.tv_sec-t0.tv_sec)+(t1.tv_nsec-t0.tv_nsec)/1e9;
  printf("\n%d tokens in %.4fs: %.1f tok/s (sum %ld)\n",steps,dt,steps/dt,sum); return 0; }
