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

// "held" on a user's program needs a fault that bites: with seed 1 the flip lands on a weight
// whose exponent bit leaves the run finite, rollback never acts, and the run without rollback
// holds too -- not exercised (fault_bites). Control: seed 5's flip breaks the undefended run,
// and the held verdict stands. (min_rollbacks, which would also catch seed 1, is dropped to see
// the counterfactual alone.)
TEST(Encoder, AHarmlessFlipOnTheUsersProgramHeldNothing) {
  for (const int seed : {1, 5}) {
    retrace::ScenarioSpec spec = retrace::load_scenario(SCENARIO("weight-bitflip-rollback.yaml"));
    spec.injections.at(0).seed = seed;
    spec.expect.min_rollbacks.reset();
    spec.expect.replay_bitwise.reset();
    const retrace::ScenarioResult r = retrace::run_scenario(spec);
    const bool bites = seed == 5;
    EXPECT_EQ(r.passed, bites) << seed << ": " << r.verdict();
    EXPECT_EQ(r.outcome(), bites ? "held" : "not exercised") << seed << ": " << r.verdict();
    EXPECT_EQ(r.counterfactual.kind, retrace::CounterfactualKind::kUndefended) << seed;
    EXPECT_EQ(r.counterfactual.broke, bites) << seed;
  }
}

// The config's values are read whole and within bounds: "2.5" is not the integer 2, and a
// vocabulary of 1e11 rows is refused by name before anything allocates it.
TEST(Encoder, ConfigValuesAreReadWholeAndWithinBounds) {
  auto refusal = [](const std::string& text) -> std::string {
    try {
      example::EncoderConfig::parse(text);
    } catch (const retrace::Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(refusal("layers: 2.5\n"),
            "example.encoder config line 1: key 'layers': must be an integer from 1 to 1024, got '2.5'");
  EXPECT_EQ(refusal("d_model: 32\nvocab: 100000000000\n"),
            "example.encoder config line 2: key 'vocab': must be an integer from 1 to 16777216, got '100000000000'");
  EXPECT_NE(refusal("lr: 0.01x\n"), "");
  EXPECT_NE(refusal("seed: -1\n"), "");
  EXPECT_NE(refusal("precision: bf16 fp32\n"), "");
  // Control: the same keys with whole values in bounds, spaces around them included.
  const example::EncoderConfig c =
      example::EncoderConfig::parse("layers: 2 \nvocab: 64\nlr: 0.01\nseed: 7\nprecision: bf16\n");
  EXPECT_EQ(c.layers, 2);
  EXPECT_EQ(c.vocab, 64);
  EXPECT_EQ(c.seed, 7u);
  EXPECT_EQ(c.precision, "bf16");
}

// A registered program's checkpoints are its own: preserve_rng_state is no defense of its
// scenario (the key is refused there), so neither its label nor the counterfactual's run without
// the defenses names it. Control: on a built-in model the same fault makes it the defense.
TEST(Encoder, PreserveRngStateIsNoDefenseOfAProgramsScenario) {
  const retrace::ScenarioSpec program = retrace::parse_scenario_text(
      "program: example.encoder\ntraining: {steps: 4}\ndefenses: {verify_recompute: true}\n"
      "injections: [{type: rng_desync, step: 3, segment: block0}]\nexpect: {params_finite: true}\n",
      "p.yaml");
  EXPECT_EQ(retrace::defense_label(program), "verify_recompute");
  const retrace::ScenarioSpec builtin = retrace::parse_scenario_text(
      "model: {type: tiny_gpt, layers: 2, d_model: 16, heads: 2}\ntraining: {steps: 4, segments: 2}\n"
      "defenses: {verify_recompute: true}\ninjections: [{type: rng_desync, step: 3, segment: block0}]\n",
      "b.yaml");
  EXPECT_EQ(retrace::defense_label(builtin), "preserve_rng_state+verify_recompute");
}
