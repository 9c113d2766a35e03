# The run-time generated fused MLP (include/kfuse/mlp.h): source generation and the disk cache are plain C++;
# NVRTC, the driver API (resolved at run time, no libcuda link) and the runtime object need the CUDA toolkit.
# Appends to KFUSE_CORE_SOURCES and sets KFUSE_CODEGEN_LIBS (linked by kfuse_configure_library).
list(APPEND KFUSE_CORE_SOURCES
  mlp/codegen/activation_table.cpp
  mlp/codegen/activation_validation.cpp
  mlp/codegen/mlp_spec.cpp
  mlp/codegen/mlp_layout.cpp
  mlp/codegen/mlp_wgrad_plan.cpp
  mlp/codegen/mlp_device_library.cpp
  mlp/codegen/mlp_source_writer.cpp
  mlp/codegen/mlp_wgmma_forward.cpp
  mlp/codegen/mlp_wgmma_stream_forward.cpp
  mlp/codegen/mlp_wgmma_backward.cpp
  mlp/codegen/kernel_cache.cpp)
# The device code the generated modules hold (mlp/codegen/device/*.cuh) as string constants of the library: each
# file's text goes verbatim into a raw string literal of device_code.cpp (mlp/codegen/device/device_code.h).
# Editing a file configures again.
foreach(name mlp_device_library wgmma_library wgmma_stream_chunk wgmma_layers)
  set(device_file ${CMAKE_CURRENT_SOURCE_DIR}/mlp/codegen/device/${name}.cuh)
  file(READ ${device_file} KFUSE_DEVICE_${name})
  string(FIND "${KFUSE_DEVICE_${name}}" ")KFUSE_DEVICE\"" delimiter_at)
  if(NOT delimiter_at EQUAL -1)
    message(FATAL_ERROR "kfuse: ${device_file} contains the raw-string delimiter )KFUSE_DEVICE\" of device_code.cpp.in")
  endif()
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${device_file})
endforeach()
configure_file(${CMAKE_CURRENT_SOURCE_DIR}/mlp/codegen/device/device_code.cpp.in
  ${CMAKE_CURRENT_BINARY_DIR}/mlp/codegen/device_code.cpp @ONLY)
list(APPEND KFUSE_CORE_SOURCES ${CMAKE_CURRENT_BINARY_DIR}/mlp/codegen/device_code.cpp)
set(KFUSE_CODEGEN_LIBS "")
if(KFUSE_WITH_CUDA)
  list(APPEND KFUSE_CORE_SOURCES
    mlp/codegen/nvrtc_compiler.cpp
    mlp/codegen/driver_api.cpp
    mlp/mlp_gpu.cpp
    mlp/mlp_tuning.cpp)
  # NVRTC and cuBLAS are host libraries that load without a driver; the weight gradients are cuBLAS GEMMs.
  set(KFUSE_CODEGEN_LIBS CUDA::nvrtc CUDA::cublas)
endif()
