# Shared settings for every retrace target: warnings, sanitizers, and the LibTorch PCH.

# Torch's exported flags carry -D_GLIBCXX_USE_CXX11_ABI=1 and friends; apply them once here.
set(_retrace_warnings -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)

# One precompiled header shared by all targets (REUSE_FROM): LibTorch's headers are the bulk of
# every translation unit's compile time.
add_library(retrace_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch_stub.cpp)
target_link_libraries(retrace_pch PUBLIC ${TORCH_LIBRARIES})
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

# retrace_library(<name> SOURCES ... DEPS ...): one library per component, with a
# namespaced alias retrace::<name>, installed and exported as retrace::<name>
# (cmake/RetraceInstall.cmake).
function(retrace_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(retrace_${name} STATIC ${ARG_SOURCES})
  add_library(retrace::${name} ALIAS retrace_${name})
  target_include_directories(retrace_${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>
    $<INSTALL_INTERFACE:include>)
  set_target_properties(retrace_${name} PROPERTIES EXPORT_NAME ${name})
  set_property(GLOBAL APPEND PROPERTY RETRACE_COMPONENTS ${name})
  target_link_libraries(retrace_${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  retrace_configure(retrace_${name})
endfunction()
