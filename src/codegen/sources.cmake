# The run-time generated fused MLP (include/kfuse/mlp.h): source generation and the disk cache are plain C++;
# NVRTC, the driver API (resolved at run time, no libcuda link) and the runtime object need the CUDA toolkit.
# Appends to KFUSE_CORE_SOURCES and sets KFUSE_CODEGEN_LIBS (linked by kfuse_configure_library).
list(APPEND KFUSE_CORE_SOURCES
  codegen/activation_table.cpp
  codegen/activation_validation.cpp
  codegen/mlp_spec.cpp
  codegen/mlp_layout.cpp
  codegen/mlp_wgrad_plan.cpp
  codegen/mlp_device_library.cpp
  codegen/mlp_source_writer.cpp
  codegen/mlp_wgmma_forward.cpp
  codegen/mlp_wgmma_stream_forward.cpp
  codegen/mlp_wgmma_backward.cpp
  codegen/kernel_cache.cpp)
set(KFUSE_CODEGEN_LIBS "")
if(KFUSE_WITH_CUDA)
  list(APPEND KFUSE_CORE_SOURCES
    codegen/nvrtc_compiler.cpp
    codegen/driver_api.cpp
    runtime/mlp_gpu.cpp
    runtime/mlp_tuning.cpp)
  # NVRTC and cuBLAS are host libraries that load without a driver; the weight gradients are cuBLAS GEMMs.
  set(KFUSE_CODEGEN_LIBS CUDA::nvrtc CUDA::cublas)
endif()
