# zstd, xxHash, Blosc and simdjson as imported targets RetraceDeps::zstd, RetraceDeps::xxhash,
# RetraceDeps::blosc and RetraceDeps::simdjson. Included by the build and by the installed package's retraceConfig.cmake
# (the static libraries link them privately, so a consumer needs the same targets).
#
# Each is one header and one library, found with find_path/find_library, so CMAKE_PREFIX_PATH
# (and CMAKE_INCLUDE_PATH/CMAKE_LIBRARY_PATH) wins over the system: the GPU machine's bundle
# (scripts/gpu-bundle) is an unpacked Debian prefix whose pkg-config files still say prefix=/usr,
# so pkg-config's answer cannot be trusted for paths there. Where pkg-config is installed, what it
# says is only a hint, searched after CMAKE_PREFIX_PATH and before the system folders.
find_package(PkgConfig QUIET)
foreach(_retrace_dep IN ITEMS zstd:libzstd:zstd.h:zstd:libzstd-dev
                              xxhash:libxxhash:xxhash.h:xxhash:libxxhash-dev
                              blosc:blosc:blosc.h:blosc:libblosc-dev
                              simdjson:simdjson:simdjson.h:simdjson:libsimdjson-dev)
  string(REPLACE ":" ";" _retrace_parts ${_retrace_dep})
  list(GET _retrace_parts 0 _name)
  list(GET _retrace_parts 1 _module)
  list(GET _retrace_parts 2 _header)
  list(GET _retrace_parts 3 _lib)
  list(GET _retrace_parts 4 _debian)
  if(TARGET RetraceDeps::${_name})
    continue()
  endif()
  set(_hint_inc)
  set(_hint_lib)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(_retrace_pc_${_name} QUIET ${_module})
    set(_hint_inc ${_retrace_pc_${_name}_INCLUDEDIR} ${_retrace_pc_${_name}_INCLUDE_DIRS})
    set(_hint_lib ${_retrace_pc_${_name}_LIBDIR} ${_retrace_pc_${_name}_LIBRARY_DIRS})
  endif()
  find_path(RETRACE_${_name}_INCLUDE_DIR ${_header} HINTS ${_hint_inc})
  find_library(RETRACE_${_name}_LIBRARY ${_lib} HINTS ${_hint_lib})
  if(NOT RETRACE_${_name}_INCLUDE_DIR OR NOT RETRACE_${_name}_LIBRARY)
    message(FATAL_ERROR "retrace needs ${_name}: ${_header} -> '${RETRACE_${_name}_INCLUDE_DIR}', "
                        "lib${_lib} -> '${RETRACE_${_name}_LIBRARY}'; install Debian's ${_debian} "
                        "(scripts/setup does) or put its prefix on CMAKE_PREFIX_PATH")
  endif()
  add_library(RetraceDeps::${_name} UNKNOWN IMPORTED)
  set_target_properties(RetraceDeps::${_name} PROPERTIES
                        IMPORTED_LOCATION ${RETRACE_${_name}_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${RETRACE_${_name}_INCLUDE_DIR})
endforeach()
