// K = 16 slices KT0 .. KT1 - 1 of a streamed layer: A's from its tile, B's from the chunk at desc_b (slice KT0).
// A layer's first slice overwrites the accumulators (scale-d 0); its epilogue adds the bias.
template <int KT0, int KT1, int NT>
__device__ __forceinline__ void wgmma_chunk_ss(float (&d)[1][NT][4], unsigned long long desc_a,
                                               unsigned long long desc_b) {
#pragma unroll
  for (int kt = KT0; kt < KT1; ++kt)
    wgmma_mma_kk(d, desc_a + static_cast<unsigned long long>(kt * 16),
                 desc_b + static_cast<unsigned long long>((kt - KT0) * 16), kt == 0 ? 0 : 1);
}
// acc += bias (per column; the thread's columns 8 nt + 2q and + 1).
template <int NT>
__device__ __forceinline__ void add_bias(float (&acc)[1][NT][4], const float* __restrict__ bias, int q) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float2 b = *reinterpret_cast<const float2*>(bias + nt * 8 + 2 * q);
    acc[0][nt][0] += b.x;
    acc[0][nt][1] += b.y;
    acc[0][nt][2] += b.x;
    acc[0][nt][3] += b.y;
  }
}
