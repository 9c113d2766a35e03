# GPU tests of the convolution candidates the tuner chooses from (forward with its FixUp epilogue, and the CUTLASS
# backward convolutions of conv_backward.h) and of the encoder's
# non-GEMM backward kernels (backward_kernels.h), each against a float64 CPU computation on the same rounded inputs.
# include()d from tests/cpp/CMakeLists.txt when KFUSE_WITH_CUDA; the tests skip themselves without a fitting GPU.
add_executable(test_conv_backward_gpu ${CMAKE_CURRENT_LIST_DIR}/test_conv_dgrad_gpu.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_conv_wgrad_gpu.cpp ${CMAKE_CURRENT_LIST_DIR}/test_backward_selection_gpu.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_forward_selection_gpu.cpp ${CMAKE_CURRENT_LIST_DIR}/test_candidate_data_gpu.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_cudnn_fused_gpu.cpp)
target_link_libraries(test_conv_backward_gpu PRIVATE kfuse::kfuse GTest::gtest_main)
target_include_directories(test_conv_backward_gpu PRIVATE ${PROJECT_SOURCE_DIR}/src)
gtest_discover_tests(test_conv_backward_gpu DISCOVERY_MODE PRE_TEST PROPERTIES LABELS gpu)

add_executable(test_encoder_backward_gpu ${CMAKE_CURRENT_LIST_DIR}/test_se_backward_gpu.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_relu_mask_backward_gpu.cpp ${CMAKE_CURRENT_LIST_DIR}/test_stem_backward_gpu.cpp)
target_link_libraries(test_encoder_backward_gpu PRIVATE kfuse::kfuse GTest::gtest_main)
target_include_directories(test_encoder_backward_gpu PRIVATE ${PROJECT_SOURCE_DIR}/src)
gtest_discover_tests(test_encoder_backward_gpu DISCOVERY_MODE PRE_TEST PROPERTIES LABELS gpu)
