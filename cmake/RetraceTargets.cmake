# Shared settings for every retrace target: warnings, sanitizers, and the LibTorch PCH.

# LibTorch as imported targets only: RETRACE_TORCH_TARGETS is ${TORCH_LIBRARIES} with each
# absolute path replaced by the imported target that names the same library. TorchConfig.cmake
# lists targets (torch, torch_library) beside absolute paths of the build machine (libc10.so,
# libc10_cuda.so under the wheel's torch/lib, CUDA's libnvrtc.so); a path would be baked into the
# installed retraceTargets.cmake, while a target is resolved again by the consumer's own
# find_package(Torch) (Caffe2Targets.cmake defines c10 and, in a CUDA build, c10_cuda; Caffe2's
# cuda.cmake finds CUDAToolkit, which defines CUDA::nvrtc).
set(RETRACE_TORCH_TARGETS)
foreach(_lib IN LISTS TORCH_LIBRARIES)
  if(_lib STREQUAL "")
    continue()
  elseif(TARGET "${_lib}")
    list(APPEND RETRACE_TORCH_TARGETS ${_lib})
    continue()
  endif()
  get_filename_component(_name "${_lib}" NAME_WE)
  string(REGEX REPLACE "^lib" "" _name "${_name}")
  if(IS_ABSOLUTE "${_lib}" AND TARGET ${_name})
    list(APPEND RETRACE_TORCH_TARGETS ${_name})
  elseif(IS_ABSOLUTE "${_lib}" AND TARGET CUDA::${_name})
    list(APPEND RETRACE_TORCH_TARGETS CUDA::${_name})
  else()
    # Not expressible as a target: link it here, but the installed package cannot carry it.
    message(WARNING "LibTorch's '${_lib}' (in TORCH_LIBRARIES) is no imported target; the build "
                    "links it, the installed retrace package does not")
    list(APPEND RETRACE_TORCH_TARGETS $<BUILD_INTERFACE:${_lib}>)
  endif()
endforeach()
message(STATUS "LibTorch targets: ${RETRACE_TORCH_TARGETS}")

# Torch's exported flags carry -D_GLIBCXX_USE_CXX11_ABI=1 and friends; apply them once here.
set(_retrace_warnings -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)

# One precompiled header shared by all targets (REUSE_FROM): LibTorch's headers are the bulk of
# every translation unit's compile time.
add_library(retrace_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch_stub.cpp)
target_link_libraries(retrace_pch PUBLIC ${RETRACE_TORCH_TARGETS})
# OpenMP (RETRACE_OPENMP, CMakeLists.txt) for the PCH and every target alike: -fopenmp decides
# how the PCH's at::parallel_for is parsed, and a PCH is used only with the flags it was built with.
if(RETRACE_OPENMP)
  target_link_libraries(retrace_pch PRIVATE OpenMP::OpenMP_CXX)
endif()
target_compile_options(retrace_pch PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${_retrace_warnings}>)
if(RETRACE_PCH)
  target_precompile_headers(retrace_pch PRIVATE $<$<COMPILE_LANGUAGE:CXX>:<torch/torch.h$<ANGLE-R>>)
endif()

set(_retrace_sanitize_flags "")
if(RETRACE_SANITIZE)
  set(_retrace_sanitize_flags -fsanitize=${RETRACE_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
endif()
if(RETRACE_FUZZ)
  # libFuzzer's coverage instrumentation in every library; the fuzz targets link -fsanitize=fuzzer.
  list(APPEND _retrace_sanitize_flags -fsanitize=fuzzer-no-link)
endif()
if(_retrace_sanitize_flags)
  target_compile_options(retrace_pch PRIVATE ${_retrace_sanitize_flags})
endif()

# retrace_configure(<target>): warnings, sanitizers, PCH reuse for C++ targets.
function(retrace_configure target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${_retrace_warnings}>)
  if(RETRACE_OPENMP)
    target_link_libraries(${target} PRIVATE OpenMP::OpenMP_CXX)
  endif()
  if(_retrace_sanitize_flags)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${_retrace_sanitize_flags}>)
    target_link_options(${target} PRIVATE ${_retrace_sanitize_flags})
  endif()
  if(RETRACE_PCH)
    target_precompile_headers(${target} REUSE_FROM retrace_pch)
    get_target_property(_type ${target} TYPE)
    if(_type STREQUAL "EXECUTABLE")
      # The shared PCH is built -fPIC; GCC rejects it for a -fPIE compile. PIC code links into a
      # PIE executable just as well.
      set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fPIC>)
    endif()
  endif()
endfunction()

# retrace_library(<name> SOURCES ... DEPS ...): one library per component folder, with a
# namespaced alias retrace::<name>, installed and exported as retrace::<name>
# (cmake/RetraceInstall.cmake).
#
# The dependency rule, enforced here: a component's public headers are FOLDER/include/retrace/*.h,
# and the only include directories a target gets are its own and those of the components it links
# (DEPS, transitively). An include of a header from a component not linked -- an upward include,
# core including recorder.h -- fails to compile ("retrace/recorder.h: No such file or directory").
# Headers beside a component's sources (core/trace_format.h) are its internals: no other
# component sees them; tests and benchmarks reach them as "core/trace_format.h" from the root.
function(retrace_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(retrace_${name} STATIC ${ARG_SOURCES})
  add_library(retrace::${name} ALIAS retrace_${name})
  target_include_directories(retrace_${name} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:include>)
  set_property(GLOBAL APPEND PROPERTY RETRACE_HEADER_DIRS ${CMAKE_CURRENT_SOURCE_DIR}/include/retrace)
  set_target_properties(retrace_${name} PROPERTIES EXPORT_NAME ${name})
  set_property(GLOBAL APPEND PROPERTY RETRACE_COMPONENTS ${name})
  target_link_libraries(retrace_${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  retrace_configure(retrace_${name})
endfunction()
