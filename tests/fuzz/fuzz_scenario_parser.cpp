// libFuzzer target: bytes -> retrace::parse_scenario_text. A bad scenario must be a retrace::Error;
// anything else — another exception (a YAML::Exception included), a crash, a sanitizer report, a
// leak — fails the run. A scenario that parses must also round-trip as scenario.h promises:
// to_yaml() of it parses again, to the same canonical YAML.
//
//   build-fuzz/bin/fuzz_scenario_parser CORPUS_DIR tests/fuzz/corpus/scenario -dict=tests/fuzz/scenario.dict
//   build-fuzz/bin/fuzz_scenario_parser crash-file        # reproduce one input

#include "fuzz_support.h"

#include <retrace/scenario.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <string>

namespace {

void parse_and_round_trip(const std::string& text) {
  const retrace::ScenarioSpec spec = retrace::parse_scenario_text(text, "fuzz");
  const std::string yaml = retrace::to_yaml(spec);
  retrace::ScenarioSpec again;
  try {
    again = retrace::parse_scenario_text(yaml, "fuzz-round-trip");
  } catch (const retrace::Error& e) {
    retrace::fuzz::fail(std::string("to_yaml() of a parsed scenario does not parse again: ") + e.what() + "\n" + yaml);
  }
  const std::string yaml_again = retrace::to_yaml(again);
  if (yaml_again != yaml) {
    retrace::fuzz::fail("to_yaml() does not round-trip:\n--- first\n" + yaml + "--- after parsing it again\n" +
                        yaml_again);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  retrace::fuzz::only_retrace_errors([&] { parse_and_round_trip(text); });
  return 0;
}
