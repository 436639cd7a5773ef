# zstd, xxHash and Blosc as imported targets PkgConfig::ZSTD, PkgConfig::XXHASH, PkgConfig::BLOSC.
# Included by the build and by the installed package's retraceConfig.cmake (the static libraries
# link them privately, so a consumer needs the same targets). They ship pkg-config files; where
# pkg-config itself is missing (the GPU machine's bundle, scripts/gpu-bundle) the header and the
# library are found directly.
find_package(PkgConfig QUIET)
foreach(_retrace_dep IN ITEMS ZSTD:libzstd:zstd.h:zstd XXHASH:libxxhash:xxhash.h:xxhash BLOSC:blosc:blosc.h:blosc)
  string(REPLACE ":" ";" _retrace_parts ${_retrace_dep})
  list(GET _retrace_parts 0 _var)
  list(GET _retrace_parts 1 _module)
  list(GET _retrace_parts 2 _header)
  list(GET _retrace_parts 3 _lib)
  if(TARGET PkgConfig::${_var})
    continue()
  endif()
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(${_var} QUIET IMPORTED_TARGET ${_module})
  endif()
  if(NOT TARGET PkgConfig::${_var})
    find_path(${_var}_INCLUDE_DIR ${_header} REQUIRED)
    find_library(${_var}_LIBRARY ${_lib} REQUIRED)
    add_library(PkgConfig::${_var} UNKNOWN IMPORTED)
    set_target_properties(PkgConfig::${_var} PROPERTIES IMPORTED_LOCATION ${${_var}_LIBRARY}
                          INTERFACE_INCLUDE_DIRECTORIES ${${_var}_INCLUDE_DIR})
  endif()
endforeach()
