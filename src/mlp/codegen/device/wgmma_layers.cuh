// One layer of a chain: every K = 16 slice (the next slice's two core matrices are 256 bytes further).
template <int NT, int KT>
__device__ __forceinline__ void wgmma_layer(float (&d)[1][NT][4], const u32 (&a)[1][KT][4], unsigned long long desc) {
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) wgmma_mma(d, a[0][kt], desc + static_cast<unsigned long long>(kt * 16));
}
// A chain layer of the wgmma backward: A = a tile (K-major: the next K = 16 slice is two units, 256 bytes, further)
// or A fragments in registers, B = MN-major weights of B_UNITS units per K row (the next slice: 16 rows further).
template <int B_UNITS, int KT, int NT>
__device__ __forceinline__ void wgmma_layer_chain(float (&d)[1][NT][4], unsigned long long desc_a,
                                                  unsigned long long desc_b) {
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
    wgmma_mma_chain(d, desc_a + static_cast<unsigned long long>(kt * 16),
                    desc_b + static_cast<unsigned long long>(kt * 16 * B_UNITS));
}
template <int B_UNITS, int NT, int KT>
__device__ __forceinline__ void wgmma_layer_chain(float (&d)[1][NT][4], const u32 (&a)[1][KT][4],
                                                  unsigned long long desc_b) {
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
    wgmma_mma_mn(d, a[0][kt], desc_b + static_cast<unsigned long long>(kt * 16 * B_UNITS));
}
