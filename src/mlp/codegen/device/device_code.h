// The device code that generated modules hold verbatim, kept as real CUDA source in src/mlp/codegen/device/*.cuh and
// compiled into the library as string constants (sources.cmake writes their definitions from device_code.cpp.in):
// readable and editable as code, and nothing to find on disk at run time. The files need the definitions of the
// texts before them (u32, cp_async16, ...), so they compile only inside a module.
#pragma once

namespace kfuse::codegen::device_code {

extern const char* const kMlpDeviceLibrary;  // mlp_device_library.cuh: every module's helpers
extern const char* const kWgmmaLibrary;      // wgmma_library.cuh: the wgmma forward's and backward's helpers
extern const char* const kWgmmaStreamChunk;  // wgmma_stream_chunk.cuh: the wgmma forward with streamed weights
extern const char* const kWgmmaLayers;       // wgmma_layers.cuh: one chain layer, forward and backward

}  // namespace kfuse::codegen::device_code
