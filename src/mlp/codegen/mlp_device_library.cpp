// The fixed part of every generated MLP module (device/mlp_device_library.cuh): self-contained device helpers (no
// #include, so NVRTC needs no header search path): 16-bit conversions, mma.sync m16n8k16 with fp32 accumulation,
// ldmatrix, cp.async, the tile loops that the generated kernels call with compile-time sizes. The source writer
// prepends `#define KFUSE_BF16 0|1`.
//
// Fragment layouts (PTX ISA, mma.m16n8k16): lane = 4 g + q. Accumulator ("C layout") of a 16x8 tile: rows g and
// g + 8, columns 2q and 2q + 1. A operand of a 16x16 tile: regs {row g, k 2q..}, {row g+8, k 2q..},
// {row g, k 2q+8..}, {row g+8, k 2q+8..}. Two adjacent 16x8 accumulator tiles are therefore exactly one A tile
// (to_a): a layer's output feeds the next layer without leaving the registers.
#include "mlp/codegen/device/device_code.h"
#include "mlp/codegen/mlp_codegen.h"

namespace kfuse::codegen {

const char* mlp_device_library() { return device_code::kMlpDeviceLibrary; }

}  // namespace kfuse::codegen
