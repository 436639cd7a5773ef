# `cmake --install BUILD --prefix PREFIX` installs the component libraries, the headers, the CLI
# and a CMake package. A project outside this tree then does
#
#   find_package(retrace REQUIRED)      # CMAKE_PREFIX_PATH: PREFIX and LibTorch's prefix
#   target_link_libraries(app PRIVATE retrace::retrace)   # or components: retrace::core, ...
#
# examples/ is such a project; the test `example.installed_package` builds it against an install.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

get_property(_retrace_components GLOBAL PROPERTY RETRACE_COMPONENTS)
set(_retrace_installed retrace_all)
foreach(_c IN LISTS _retrace_components)
  list(APPEND _retrace_installed retrace_${_c})
endforeach()

set(_retrace_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/retrace)
install(TARGETS ${_retrace_installed} EXPORT retraceTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
if(TARGET retrace)
  # The installed CLI finds LibTorch (a wheel's lib/, outside the system paths) where it was built:
  # its RUNPATH is absolute, the build machine's torch/lib. The libraries and the CMake package
  # carry no path (a consumer relinks against its own LibTorch); a moved CLI needs that LibTorch
  # at the same path, or LD_LIBRARY_PATH.
  set_target_properties(retrace PROPERTIES INSTALL_RPATH_USE_LINK_PATH TRUE)
  install(TARGETS retrace RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
# Every component's public headers (FOLDER/include/retrace/*.h) and the umbrella retrace.h, into
# one PREFIX/include/retrace; internal headers beside the sources are not installed.
get_property(_retrace_header_dirs GLOBAL PROPERTY RETRACE_HEADER_DIRS)
foreach(_dir IN LISTS _retrace_header_dirs ITEMS ${PROJECT_SOURCE_DIR}/include/retrace)
  install(DIRECTORY ${_dir} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
endforeach()
install(FILES ${PROJECT_BINARY_DIR}/include/retrace/version.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/retrace)
install(EXPORT retraceTargets NAMESPACE retrace:: DESTINATION ${_retrace_cmake_dir})

set(RETRACE_PACKAGE_COMPONENTS "${_retrace_components}")
# The exported link interface names only imported targets (no path of this machine): LibTorch's
# (RETRACE_TORCH_TARGETS, cmake/RetraceTargets.cmake), CUDA::*, nlohmann_json, yaml-cpp, Boost
# and RetraceDeps::*; retraceConfig.cmake finds each again on the consumer's machine. CUDA::*
# come from CUDAToolkit when retrace has CUDA sources or LibTorch's libraries name one.
set(RETRACE_PACKAGE_NEEDS_CUDA ${RETRACE_WITH_CUDA})
if(RETRACE_TORCH_TARGETS MATCHES "(^|;)CUDA::")
  set(RETRACE_PACKAGE_NEEDS_CUDA ON)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/retraceConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/retraceConfig.cmake INSTALL_DESTINATION ${_retrace_cmake_dir})
# 0.x: a minor version may break the API, so only the same minor version is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/retraceConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/retraceConfig.cmake ${PROJECT_BINARY_DIR}/retraceConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/RetraceDependencies.cmake
        DESTINATION ${_retrace_cmake_dir})
