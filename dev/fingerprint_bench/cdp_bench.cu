// The weight check's verdict as a device-side (CUDA dynamic parallelism) tail launch of the repack instead of a
// conditional graph node (dev only). Build: nvcc -O3 -std=c++17 -arch=sm_90a -rdc=true -o cdp_bench cdp_bench.cu
// -lcudadevrt. Graph per replay: pollute (32 MB written) -> [force] -> check -> 3 small kernels; GPU time per replay,
// 200 back to back, median of 5 rounds.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e = (x);                                                                        \
    if (e != cudaSuccess) {                                                                     \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));             \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

struct State {
  unsigned long long sum, stored;
  unsigned arrived, changed, force, pad;
};

__device__ __forceinline__ unsigned long long mix64(unsigned long long w, unsigned long long index) {
  unsigned long long z = w + index * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void repack_child(uint4* dst, const uint4* src, long long n) {  // stands for the pack: reads + writes
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

// mode 0: plain; 1: sets the conditional handle; 2: tail-launches repack_child where changed.
__global__ void __launch_bounds__(256) fp_kernel(const uint4* p, long long words, State* st,
                                                 cudaGraphConditionalHandle h, int mode, uint4* dst, int child_grid) {
  __shared__ unsigned long long warp_sums[8];
  unsigned long long s = 0;
  const long long chunk = 1024, chunks = (words + chunk - 1) / chunk;
  for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
    const long long b = c * chunk, e = min(words, b + chunk);
    for (long long j0 = b; j0 < e; j0 += 256 * 4) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const long long j = j0 + u * 256 + threadIdx.x;
        v[u] = j < e ? __ldcs(p + j) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const long long j = j0 + u * 256 + threadIdx.x;
        if (j < e) {
          s += mix64((unsigned long long)v[u].y << 32 | v[u].x, 2 * j);
          s += mix64((unsigned long long)v[u].w << 32 | v[u].z, 2 * j + 1);
        }
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x != 0) return;
  s = 0;
  for (int w = 0; w < 8; ++w) s += warp_sums[w];
  atomicAdd(&st->sum, s);
  __threadfence();
  if (atomicAdd(&st->arrived, 1u) != gridDim.x - 1) return;
  __threadfence();
  const unsigned long long total = atomicExch(&st->sum, 0ull);
  const unsigned changed = st->force != 0 || total != st->stored;
  st->stored = total;
  st->force = 0;
  st->changed = changed;
  st->arrived = 0;
  if (mode == 1) cudaGraphSetConditional(h, changed);
  if (mode == 2 && changed) {
    repack_child<<<child_grid, 256, 0, cudaStreamTailLaunch>>>(dst, p, words);
    repack_child<<<child_grid, 256, 0, cudaStreamTailLaunch>>>(dst + words, p, words);
  }
}

__global__ void small_kernel(float* out) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0) out[blockIdx.x] += 1.f;
}
__global__ void pollute_kernel(uint4* buf, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    buf[i] = make_uint4(unsigned(i), 1, 2, 3);
}
__global__ void force_kernel(State* st) { st->force = 1; }

struct Ctx {
  uint4 *params, *dst, *junk;
  long long words, junk_words;
  State* st;
  float* out;
  int sms;
};

// mode: -1 no check; 0 plain; 1 IF node (body: the two repack kernels); 2 tail launch. force: every replay changes.
float time_graph(Ctx& c, int mode, bool force, bool pdl, cudaStream_t s) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  pollute_kernel<<<c.sms * 4, 256, 0, s>>>(c.junk, c.junk_words);
  if (force) force_kernel<<<1, 1, 0, s>>>(c.st);
  cudaGraphConditionalHandle h = 0;
  const int grid = std::min<int>(int((c.words * 16 + 16383) / 16384), 8 * c.sms), child = 2 * c.sms;
  if (mode >= 0) {
    cudaStreamCaptureStatus status;
    cudaGraph_t cg;
    if (mode == 1) {
      CK(cudaStreamGetCaptureInfo(s, &status, nullptr, &cg));
      CK(cudaGraphConditionalHandleCreate(&h, cg, 0, 0));
    }
    fp_kernel<<<grid, 256, 0, s>>>(c.params, c.words, c.st, h, mode, c.dst, child);
    if (mode == 1) {
      const cudaGraphNode_t* deps;
      size_t nd;
      CK(cudaStreamGetCaptureInfo(s, &status, nullptr, &cg, &deps, nullptr, &nd));
      cudaGraphNodeParams p{};
      p.type = cudaGraphNodeTypeConditional;
      p.conditional.handle = h;
      p.conditional.type = cudaGraphCondTypeIf;
      p.conditional.size = 1;
      cudaGraphNode_t node;
      CK(cudaGraphAddNode(&node, cg, deps, nullptr, nd, &p));
      CK(cudaStreamUpdateCaptureDependencies(s, &node, nullptr, 1, cudaStreamSetCaptureDependencies));
      cudaGraph_t body = p.conditional.phGraph_out[0];
      cudaGraphNode_t k1, k2;
      uint4* d2 = c.dst + c.words;
      void* a1[] = {&c.dst, &c.params, &c.words};
      void* a2[] = {&d2, &c.params, &c.words};
      cudaKernelNodeParams kp{};
      kp.func = (void*)repack_child;
      kp.gridDim = dim3(child);
      kp.blockDim = dim3(256);
      kp.kernelParams = a1;
      CK(cudaGraphAddKernelNode(&k1, body, nullptr, 0, &kp));
      kp.kernelParams = a2;
      CK(cudaGraphAddKernelNode(&k2, body, &k1, 1, &kp));
    }
  }
  for (int i = 0; i < 3; ++i) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(c.sms);
    cfg.blockDim = dim3(128);
    cfg.stream = s;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = (pdl && (i > 0 || mode != 1)) ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, small_kernel, c.out));
  }
  CK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ex;
  CK(cudaGraphInstantiate(&ex, g, 0));
  for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ex, s));
  CK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> r;
  for (int round = 0; round < 5; ++round) {
    CK(cudaEventRecord(a, s));
    for (int i = 0; i < 200; ++i) CK(cudaGraphLaunch(ex, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    r.push_back(ms * 1e3f / 200);
  }
  std::sort(r.begin(), r.end());
  CK(cudaGraphExecDestroy(ex));
  CK(cudaGraphDestroy(g));
  return r[2];
}

// Correctness of the tail launch's ordering: the kernel after the check must see the children's writes.
__global__ void verify_kernel(const uint4* dst, const uint4* src, long long n, unsigned* bad) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < 2 * n; i += (long long)gridDim.x * blockDim.x) {
    const uint4 a = dst[i], b = src[i % n];
    if (a.x != b.x || a.y != b.y || a.z != b.z || a.w != b.w) atomicAdd(bad, 1u);
  }
}
__global__ void fill_kernel(uint4* p, long long n, unsigned v) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    p[i] = make_uint4(v, unsigned(i), v ^ 0x55u, 7);
}

int main() {
  Ctx c{};
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  c.sms = prop.multiProcessorCount;
  c.words = 9876512 / 16;
  CK(cudaMalloc(&c.params, c.words * 16));
  CK(cudaMalloc(&c.dst, 2 * c.words * 16));
  CK(cudaMemset(c.params, 1, c.words * 16));
  CK(cudaMalloc(&c.st, sizeof(State)));
  CK(cudaMemset(c.st, 0, sizeof(State)));
  CK(cudaMalloc(&c.out, 4096 * 4));
  c.junk_words = (32ll << 20) / 16;
  CK(cudaMalloc(&c.junk, c.junk_words * 16));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("%s, %d SMs\n", prop.name, c.sms);
  for (int pdl = 0; pdl < 2; ++pdl) {
    const float base = time_graph(c, -1, false, pdl, s);
    std::printf("pdl %d: no check %.2f us; unchanged: plain +%.2f, IF +%.2f, tail launch +%.2f; changed every replay: "
                "IF +%.2f, tail launch +%.2f us\n",
                pdl, base, time_graph(c, 0, false, pdl, s) - base, time_graph(c, 1, false, pdl, s) - base,
                time_graph(c, 2, false, pdl, s) - base, time_graph(c, 1, true, pdl, s) - base,
                time_graph(c, 2, true, pdl, s) - base);
  }
  // Ordering: a graph fill(params, v) -> check (tail launch copies params twice into dst) -> verify (PDL after the
  // check) -> 50 replays with a new v each time (a changed verdict every replay).
  unsigned* bad;
  CK(cudaMalloc(&bad, 4));
  CK(cudaMemset(bad, 0, 4));
  for (int pdl = 0; pdl < 2; ++pdl) {
    for (unsigned v = 1; v <= 50; ++v) {
      fill_kernel<<<c.sms * 4, 256, 0, s>>>(c.params, c.words, v + 1000 * pdl);
      const int grid = std::min<int>(int((c.words * 16 + 16383) / 16384), 8 * c.sms);
      fp_kernel<<<grid, 256, 0, s>>>(c.params, c.words, c.st, 0, 2, c.dst, 2 * c.sms);
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(c.sms);
      cfg.blockDim = dim3(256);
      cfg.stream = s;
      cudaLaunchAttribute attr{};
      attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr.val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = &attr;
      cfg.numAttrs = pdl;
      CK(cudaLaunchKernelEx(&cfg, verify_kernel, (const uint4*)c.dst, (const uint4*)c.params, c.words, bad));
    }
    CK(cudaStreamSynchronize(s));
    unsigned nbad;
    CK(cudaMemcpy(&nbad, bad, 4, cudaMemcpyDeviceToHost));
    std::printf("ordering (eager, pdl %d): %u mismatching words over 50 changes\n", pdl, nbad);
  }
  return 0;
}
