#pragma once
// Test support: compare two programs' states tensor by tensor, and list membership.

#include <retrace/diff.h>
#include <retrace/program.h>

#include <algorithm>
#include <string>
#include <vector>

namespace retrace {

namespace fs = std::filesystem;

// Every tensor of `a` bitwise equal to its namesake in `b`; returns how many differ.
inline int differing(const std::vector<NamedTensor>& a, const std::vector<NamedTensor>& b) {
  int n = 0;
  for (const NamedTensor& x : a) {
    for (const NamedTensor& y : b) {
      if (x.name == y.name && !bitwise_diff(x.tensor, y.tensor).bitwise_equal()) ++n;
    }
  }
  return n;
}

inline bool has(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace retrace
