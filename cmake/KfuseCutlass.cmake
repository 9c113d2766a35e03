# Locates the CUTLASS 4.2 C++ headers. They come from the PyPI wheel nvidia-cutlass==4.2.0.0 (installed with
# --no-deps), which puts them under <site-packages>/cutlass_library/source/{include,tools/util/include}.
# Override with -DKFUSE_CUTLASS_DIR=<root> or the environment variable KFUSE_CUTLASS_DIR, where <root> is either a
# CUTLASS source tree or the wheel's cutlass_library/source folder (both have include/ and tools/util/include/).
set(KFUSE_CUTLASS_DIR "$ENV{KFUSE_CUTLASS_DIR}" CACHE PATH "CUTLASS root (holding include/ and tools/util/include/)")

include(${CMAKE_CURRENT_LIST_DIR}/KfusePythonProbe.cmake)
kfuse_python_guess(KFUSE_CUTLASS_DIR
  "import importlib.util,os;s=importlib.util.find_spec('cutlass_library');print(os.path.join(s.submodule_search_locations[0],'source') if s else '')")

if(NOT KFUSE_CUTLASS_DIR)
  message(FATAL_ERROR
    "kfuse: CUTLASS headers not found. Install them with\n"
    "  python -m pip install --no-deps nvidia-cutlass==4.2.0.0\n"
    "into the Python that CMake finds (-DPython3_EXECUTABLE=...), or pass -DKFUSE_CUTLASS_DIR=<root> / set "
    "KFUSE_CUTLASS_DIR, where <root> holds include/ and tools/util/include/.")
endif()

set(KFUSE_CUTLASS_INCLUDE_DIRS "${KFUSE_CUTLASS_DIR}/include" "${KFUSE_CUTLASS_DIR}/tools/util/include")
foreach(_hdr cute/tensor.hpp cutlass/conv/collective/collective_builder.hpp cutlass/util/packed_stride.hpp)
  find_file(_kfuse_found_${_hdr} NAMES "${_hdr}" PATHS ${KFUSE_CUTLASS_INCLUDE_DIRS} NO_DEFAULT_PATH NO_CACHE)
  if(NOT _kfuse_found_${_hdr})
    message(FATAL_ERROR
      "kfuse: CUTLASS at '${KFUSE_CUTLASS_DIR}' is incomplete: '${_hdr}' is missing under "
      "${KFUSE_CUTLASS_DIR}/include or ${KFUSE_CUTLASS_DIR}/tools/util/include. kfuse needs CUTLASS 4.2 "
      "(pip install --no-deps nvidia-cutlass==4.2.0.0).")
  endif()
endforeach()
message(STATUS "kfuse: CUTLASS headers in ${KFUSE_CUTLASS_DIR}")

add_library(kfuse_cutlass INTERFACE)
target_include_directories(kfuse_cutlass SYSTEM INTERFACE ${KFUSE_CUTLASS_INCLUDE_DIRS})
# CUTLASS 4.2 device asserts serialize wgmma (ptxas warning C7510); NDEBUG also shortens the build.
target_compile_definitions(kfuse_cutlass INTERFACE NDEBUG)
target_compile_options(kfuse_cutlass INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
