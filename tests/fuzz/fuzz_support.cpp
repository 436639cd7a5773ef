#include "fuzz_support.h"

#include <cstdio>
#include <cstdlib>
#include <cxxabi.h>
#include <memory>
#include <typeinfo>

namespace retrace::fuzz {

void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz: invariant broken: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

std::string current_exception_type() {
  const std::type_info* type = abi::__cxa_current_exception_type();
  if (type == nullptr) return "?";
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(type->name(), nullptr, nullptr, &status), std::free);
  return status == 0 && name ? name.get() : type->name();
}

}  // namespace retrace::fuzz
