# GPU tests of the FixUp-epilogue conv launchers (conv_fixup.h); include()d from tests/cpp/CMakeLists.txt when
# KFUSE_WITH_CUDA. Plain C++ (no CUTLASS): the launchers are exported from libkfuse. Tests skip themselves without a
# fitting GPU, and PRE_TEST discovery lists them at ctest time, so building needs no GPU.
add_executable(test_conv_fixup_gpu ${CMAKE_CURRENT_LIST_DIR}/test_conv_fixup_gpu.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_conv_fp8_gpu.cpp ${CMAKE_CURRENT_LIST_DIR}/test_conv_selection.cpp)
target_link_libraries(test_conv_fixup_gpu PRIVATE kfuse::kfuse GTest::gtest_main)
target_include_directories(test_conv_fixup_gpu PRIVATE ${PROJECT_SOURCE_DIR}/src)
gtest_discover_tests(test_conv_fixup_gpu DISCOVERY_MODE PRE_TEST PROPERTIES LABELS gpu)
