// Holds device memory on GPU 0 through the CUDA driver API (dlopen'ed, so it
// builds without the CUDA toolkit): prints "ready" once allocated, then sleeps.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
typedef int (*init_t)(unsigned);
typedef int (*devget_t)(int *, int);
typedef int (*ctx_t)(void **, unsigned, int);
typedef int (*alloc_t)(unsigned long long *, size_t);
int main(int argc, char **argv) {
  size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 1024;
  unsigned secs = argc > 2 ? strtoul(argv[2], 0, 10) : 30;
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 3; }
  init_t cuInit = (init_t)dlsym(h, "cuInit");
  devget_t cuDeviceGet = (devget_t)dlsym(h, "cuDeviceGet");
  ctx_t cuCtxCreate = (ctx_t)dlsym(h, "cuCtxCreate_v2");
  alloc_t cuMemAlloc = (alloc_t)dlsym(h, "cuMemAlloc_v2");
  int dev, r; void *ctx; unsigned long long p;
  if ((r = cuInit(0))) { fprintf(stderr, "cuInit %d\n", r); return 4; }
  if ((r = cuDeviceGet(&dev, 0))) { fprintf(stderr, "cuDeviceGet %d\n", r); return 4; }
  if ((r = cuCtxCreate(&ctx, 0, dev))) { fprintf(stderr, "cuCtxCreate %d\n", r); return 4; }
  if ((r = cuMemAlloc(&p, mib << 20))) { fprintf(stderr, "cuMemAlloc %d\n", r); return 4; }
  printf("ready %d\n", getpid()); fflush(stdout);
  sleep(secs);
  return 0;
}
