// The example program's scenarios as GoogleTest tests, run in this process: the program is
// registered under its name, and each scenario names it (program: example.encoder).
#include "encoder_classifier.h"

#include <retrace/gtest_scenario.h>

static retrace::ProgramRegistration encoder(example::EncoderClassifier::kName, [](const std::string& config) {
  return std::make_unique<example::EncoderClassifier>(config);
});

#include <cstdlib>

// The scenario files' folder comes from the environment (ctest sets it), else the working
// directory's examples/encoder/scenarios.
static std::string SCENARIO(const char* file) {
  const char* dir = std::getenv("RETRACE_EXAMPLE_SCENARIOS");
  return std::string(dir ? dir : "examples/encoder/scenarios") + "/" + file;
}

RETRACE_SCENARIO_TEST(Encoder, Fp16OverflowLossScaling, SCENARIO("fp16-overflow-loss-scaling.yaml"));
RETRACE_SCENARIO_TEST(Encoder, Fp16OverflowNoDefense, SCENARIO("fp16-overflow-no-defense.yaml"));
RETRACE_SCENARIO_TEST(Encoder, WeightBitFlipRollback, SCENARIO("weight-bitflip-rollback.yaml"));
RETRACE_SCENARIO_TEST(Encoder, WeightBitFlipNoDefense, SCENARIO("weight-bitflip-no-defense.yaml"));
RETRACE_SCENARIO_TEST(Encoder, BadTokensValidated, SCENARIO("bad-tokens-validated.yaml"));
RETRACE_SCENARIO_TEST(Encoder, BadTokensNoDefense, SCENARIO("bad-tokens-no-defense.yaml"));
