# Helpers shared by every folder's CMakeLists.txt.

# Warnings for tpserve's own code (not for third-party headers).
function(tpserve_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
      -Wno-missing-field-initializers
      # GCC 12 reports false -Wrestrict positives inside libstdc++'s
      # std::string operator+ at -O3 (GCC bug 105329).
      $<$<CXX_COMPILER_ID:GNU>:-Wno-restrict>>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
  if(TPSERVE_WERROR)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-Werror>
      $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
  endif()
endfunction()

# tpserve_library(NAME SOURCES ... [CUDA_SOURCES ...] [DEPS ...])
# One library per top-level folder; includes are rooted at the repository top
# ("comm/status.h").
function(tpserve_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;CUDA_SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(srcs ${ARG_SOURCES})
  if(TPSERVE_WITH_CUDA)
    list(APPEND srcs ${ARG_CUDA_SOURCES})
  endif()
  add_library(${name} STATIC ${srcs})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  if(TPSERVE_WITH_CUDA)
    target_compile_definitions(${name} PUBLIC TPSERVE_WITH_CUDA=1)
    set_target_properties(${name} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
  endif()
  tpserve_warnings(${name})
endfunction()

# tpserve_add_gtest(NAME SOURCES ... LABEL unit|gpu|e2e [DEPS ...])
# A GoogleTest executable whose tests CTest discovers one by one, with a label.
include(GoogleTest)
function(tpserve_add_gtest name)
  cmake_parse_arguments(ARG "" "LABEL;TIMEOUT" "SOURCES;DEPS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  tpserve_warnings(${name})
  gtest_discover_tests(${name}
    PROPERTIES LABELS ${ARG_LABEL} TIMEOUT ${ARG_TIMEOUT}
    DISCOVERY_TIMEOUT 60)
endfunction()
