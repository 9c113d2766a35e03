// Microbenchmark of the parameter fingerprint's variants and of the graph nodes around it (dev only; not built by
// CMake). Build: nvcc -O3 -std=c++17 -arch=sm_90a -o fingerprint_bench fingerprint_bench.cu
// Each figure: GPU time per replay of a graph, 200 replays back to back, median of 5 rounds. Every graph starts with
// a kernel that writes 32 MB (the forward's own traffic, evicting the parameters from L2 the way a forward does)
// unless --no-pollute.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
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
__device__ __forceinline__ unsigned mix32(unsigned w, unsigned index) {
  unsigned z = w + index * 0x9E3779B9u;
  z = (z ^ (z >> 16)) * 0x85EBCA6Bu;
  z = (z ^ (z >> 13)) * 0xC2B2AE35u;
  return z ^ (z >> 16);
}

template <int kThreads>
__device__ unsigned long long block_sum(unsigned long long v) {
  __shared__ unsigned long long warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  v = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) v += warp_sums[w];
  return v;
}

// words: 16-byte words; chunk: 16-byte words per chunk. kLoads loads per thread in flight; hash 0: mix64, 1: mix32.
template <int kThreads, int kLoads, int kHash, bool kStreaming>
__global__ void __launch_bounds__(kThreads) fp_kernel(const uint4* p, long long words, long long chunk, State* st,
                                                      cudaGraphConditionalHandle h, int set) {
  unsigned long long s = 0;
  const long long chunks = (words + chunk - 1) / chunk;
  for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
    const long long b = c * chunk, e = min(words, b + chunk);
    for (long long j0 = b; j0 < e; j0 += (long long)kThreads * kLoads) {
      uint4 v[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const long long j = j0 + u * kThreads + threadIdx.x;
        v[u] = j < e ? (kStreaming ? __ldcs(p + j) : __ldg(p + j)) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const long long j = j0 + u * kThreads + threadIdx.x;
        if (j < e) {
          if (kHash == 0) {
            s += mix64((unsigned long long)v[u].y << 32 | v[u].x, 2 * j);
            s += mix64((unsigned long long)v[u].w << 32 | v[u].z, 2 * j + 1);
          } else {
            const unsigned i = unsigned(4 * j);
            s += (unsigned long long)(mix32(v[u].x, i) ^ (mix32(v[u].y, i + 1) << 1)) +
                 (unsigned long long)mix32(v[u].z, i + 2) * 3 + mix32(v[u].w, i + 3);
          }
        }
      }
    }
  }
  s = block_sum<kThreads>(s);
  if (threadIdx.x != 0) return;
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
  if (set) cudaGraphSetConditional(h, changed);
}

__global__ void small_kernel(float* out) {
  if (threadIdx.x == 0) out[blockIdx.x] += 1.f;
}
__global__ void pollute_kernel(uint4* buf, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    buf[i] = make_uint4(unsigned(i), 1, 2, 3);
}

using Launch = std::function<void(cudaStream_t, cudaGraphConditionalHandle, int)>;

struct Ctx {
  uint4* params;
  long long words;
  State* st;
  float* out;
  uint4* junk;
  long long junk_words;
  int sms;
  bool pollute;
};

// The graph: [pollute] -> fingerprint (launch) -> [IF(false){small}] -> small x 3.
float time_graph(Ctx& c, const Launch& fp, bool with_if, cudaStream_t s) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  if (c.pollute) pollute_kernel<<<c.sms * 4, 256, 0, s>>>(c.junk, c.junk_words);
  cudaGraphConditionalHandle h = 0;
  if (fp) {
    if (with_if) {
      cudaStreamCaptureStatus status;
      cudaGraph_t cg;
      CK(cudaStreamGetCaptureInfo(s, &status, nullptr, &cg));
      CK(cudaGraphConditionalHandleCreate(&h, cg, 0, 0));
    }
    fp(s, h, with_if ? 1 : 0);
    if (with_if) {
      cudaStreamCaptureStatus status;
      cudaGraph_t cg;
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
      cudaGraphNode_t kn;
      cudaKernelNodeParams kp{};
      void* args[] = {&c.out};
      kp.func = (void*)small_kernel;
      kp.gridDim = dim3(1);
      kp.blockDim = dim3(32);
      kp.kernelParams = args;
      CK(cudaGraphAddKernelNode(&kn, body, nullptr, 0, &kp));
    }
  }
  for (int i = 0; i < 3; ++i) small_kernel<<<c.sms, 128, 0, s>>>(c.out);
  CK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ex;
  CK(cudaGraphInstantiate(&ex, g, 0));
  for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ex, s));
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

template <int T, int L, int H, bool S>
Launch variant(Ctx& c, long long chunk_words, int grid) {
  return [&c, chunk_words, grid](cudaStream_t s, cudaGraphConditionalHandle h, int set) {
    fp_kernel<T, L, H, S><<<grid, T, 0, s>>>(c.params, c.words, chunk_words, c.st, h, set);
  };
}

int main(int argc, char** argv) {
  Ctx c{};
  c.pollute = !(argc > 1 && std::strcmp(argv[1], "--no-pollute") == 0);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  c.sms = prop.multiProcessorCount;
  const size_t bytes = 9876512;  // the default network's fp16 parameters (4,938,256 x 2 bytes)
  c.words = bytes / 16;
  CK(cudaMalloc(&c.params, bytes));
  CK(cudaMemset(c.params, 1, bytes));
  CK(cudaMalloc(&c.st, sizeof(State)));
  CK(cudaMemset(c.st, 0, sizeof(State)));
  CK(cudaMalloc(&c.out, 4096 * 4));
  c.junk_words = (32ll << 20) / 16;
  CK(cudaMalloc(&c.junk, c.junk_words * 16));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("%s, %d SMs, %.1f MB of parameters, pollute %d\n", prop.name, c.sms, bytes / 1e6, int(c.pollute));
  const float base = time_graph(c, nullptr, false, s);
  std::printf("%-52s %7.2f us per replay\n", "no fingerprint (pollute + 3 small kernels)", base);
  struct V {
    const char* name;
    Launch fp;
  };
  const long long k16 = 1024, k32 = 2048, k64 = 4096;  // 16-byte words: 16, 32, 64 KB chunks
  const int chunks16 = int((c.words + k16 - 1) / k16);
  std::vector<V> vs = {
      {"main: 256 thr, 4 loads, 16 KB chunks, 1 wave", variant<256, 4, 0, true>(c, k16, std::min(chunks16, 8 * c.sms))},
      {"cached loads", variant<256, 4, 0, false>(c, k16, std::min(chunks16, 8 * c.sms))},
      {"mix32", variant<256, 4, 1, true>(c, k16, std::min(chunks16, 8 * c.sms))},
      {"8 loads, 32 KB chunks, grid 2 x SMs", variant<256, 8, 0, true>(c, k32, 2 * c.sms)},
      {"8 loads, 32 KB chunks, grid 4 x SMs", variant<256, 8, 0, true>(c, k32, 4 * c.sms)},
      {"4 loads, 16 KB, grid 2 x SMs", variant<256, 4, 0, true>(c, k16, 2 * c.sms)},
      {"4 loads, 16 KB, grid 4 x SMs", variant<256, 4, 0, true>(c, k16, 4 * c.sms)},
      {"512 thr, 8 loads, 64 KB chunks, grid SMs", variant<512, 8, 0, true>(c, k64, c.sms)},
      {"512 thr, 4 loads, 32 KB chunks, grid 2 x SMs", variant<512, 4, 0, true>(c, k32, 2 * c.sms)},
      {"1024 thr, 4 loads, 64 KB chunks, grid SMs", variant<1024, 4, 0, true>(c, k64, c.sms)},
      {"mix32, 8 loads, 32 KB, grid 2 x SMs", variant<256, 8, 1, true>(c, k32, 2 * c.sms)},
  };
  for (auto& v : vs) {
    const float t = time_graph(c, v.fp, false, s);
    const float ti = time_graph(c, v.fp, true, s);
    std::printf("%-52s +%6.2f us, with IF(false) node +%6.2f us\n", v.name, t - base, ti - base);
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
