#pragma once
// The environment fingerprint stored in every trace header: what must match for a replay to be
// bitwise (library versions, devices, thread count, CPU kernel level, determinism flags), and
// what is recorded only for the reader's information (host name, time).

#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

namespace retrace {

struct EnvironmentDifference {
  std::string field;
  std::string recorded;
  std::string current;
  std::string fix;  // how to make them match, where we know
};

struct Environment {
  // Fields that change bits when they differ.
  std::map<std::string, std::string> bitwise;
  // Recorded for information only.
  std::map<std::string, std::string> info;

  // This process now: LibTorch version, CPU capability (the vectorized kernel set, e.g.
  // AVX512), intra-op threads, CUDA runtime and cuDNN versions and device names when CUDA is
  // available, deterministic-algorithm, cuDNN and TF32 flags.
  static Environment current();
  nlohmann::json to_json() const;
  // Lenient: unknown fields are kept, missing ones are absent.
  static Environment from_json(const nlohmann::json& j);
  // Bitwise-relevant fields that differ between `recorded` (this) and `now`.
  std::vector<EnvironmentDifference> differences(const Environment& now) const;
};

// The cores this process may run on: its CPU affinity (a container's or taskset's), not the
// machine's; hardware_concurrency() where the affinity cannot be read. At least 1.
int usable_cores();

}  // namespace retrace
