// The scenario schema: a full spec round-trips through canonical YAML, and bad input is one
// retrace::Error naming file, line and key.
#include "../support/scenario_text.h"

#include <retrace/error.h>
#include <retrace/scenario.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>

namespace retrace {
namespace {

using test::kGpt;
using test::with;

TEST(Schema, FullSpecRoundTripsThroughCanonicalYaml) {
  // A built-in suite file, read from the source tree (the embedded suite is retrace::suite's).
  const char* suite = std::getenv("RETRACE_SUITE_SCENARIOS");
  ASSERT_NE(suite, nullptr) << "RETRACE_SUITE_SCENARIOS is not set (ctest sets it)";
  const ScenarioSpec a = parse_scenario_file(std::string(suite) + "/fp16-overflow-hysteresis.yaml");
  const ScenarioSpec b = parse_scenario_text(to_yaml(a), "again");
  EXPECT_EQ(to_yaml(a), to_yaml(b));
  ASSERT_EQ(b.injections.size(), 1u);
  EXPECT_TRUE(a.injections[0] == b.injections[0]);
  EXPECT_EQ(b.defenses.loss_scaling.hysteresis, 2);
  EXPECT_TRUE(b.expect.replay_bitwise.value_or(false));
}

void expect_error(const std::string& extra, const std::string& needle) {
  try {
    with(extra);
    ADD_FAILURE() << "no error for: " << extra;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Schema, BadDefensesInjectionsAndExpectationsNameFileLineAndKey) {
  // kGpt is 5 lines (the first empty), so the extra text starts on line 6.
  expect_error("defenses: {clipping: 1}\n",
               "test.yaml:6: key 'defenses.clipping': unknown key; known keys here: loss_scaling");
  expect_error("defenses:\n  skip_nonfinite: maybe\n",
               "test.yaml:7: key 'defenses.skip_nonfinite': must be true or false, got 'maybe'");
  expect_error("defenses: {clip: {mode: hard}}\n",
               "key 'defenses.clip.mode': must be one of off, global, per_tensor, adaptive, got 'hard'");
  expect_error("injections: {type: loss_spike}\n", "test.yaml:6: key 'injections': must be a list");
  expect_error("injections:\n  - step: 2\n", "test.yaml:7: key 'injections[0].type': is required");
  expect_error("injections:\n  - {type: loss_spike, probability: 2}\n",
               "key 'injections[0].probability': must be between 0 and 1, got 2");
  expect_error("injections:\n  - {type: corrupt_batch, mode: nan_features}\n",
               "nan_features does not fit model type tiny_gpt (token ids); use token_out_of_range");
  expect_error("injections:\n  - {type: loss_spike, mode: nan}\n",
               "key 'injections[0].mode': is not used by injection type loss_spike");
  expect_error("expect: {max_skipped_steps: -1}\n", "key 'expect.max_skipped_steps': must be between 0 and");
  expect_error("expect: {replay: true}\n", "key 'expect.replay': unknown key");
  EXPECT_THROW(
      parse_scenario_text(
          "model: {type: mlp, layers: 2}\ntraining: {segments: 0}\ninjections: [{type: activation_overflow}]\n",
          "x.yaml"),
      Error);
  try {
    parse_scenario_text(
        "model: {type: mlp, layers: 2}\ntraining: {segments: 0}\ninjections: [{type: activation_overflow}]\n",
        "x.yaml");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x.yaml:3: key 'injections[0].type': activation_overflow hits a checkpointed "
                                         "segment, but training.segments is 0"),
              std::string::npos)
        << e.what();
  }
}

// YAML's core schema, not yaml-cpp's looser reading: a boolean is true or false (yes, on and y
// are not), a quoted scalar is a string (not the number or boolean it spells), and an expectation
// that the run breaks is a negative control's. Controls: the same keys written plainly parse.
// A name is one line of text: it lands in the console, file names, JUnit XML (which has no room
// for most control characters) and HTML. A control character is refused with its byte and offset.
// Control: a name with spaces and non-ASCII letters is fine.
TEST(Schema, ANameWithAControlCharacterIsRefused) {
  const std::string rest = "model: {type: mlp, layers: 2}\n";
  try {
    parse_scenario_text("name: \"bell\\a here\"\n" + rest, "n.yaml");
    ADD_FAILURE() << "a control character in the name was accepted";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "n.yaml:1: key 'name': holds a control character (byte 0x07 at offset 4): a name is one line of text"),
        std::string::npos)
        << e.what();
  }
  EXPECT_EQ(parse_scenario_text("name: grad nan — skip\n" + rest, "n.yaml").name, "grad nan — skip");
}

TEST(Schema, BooleansAndNumbersAreTheCoreSchemasAndExpectingBreakageNeedsDiverges) {
  expect_error("expect: {diverges: yes}\n", "test.yaml:6: key 'expect.diverges': must be true or false, got 'yes'");
  expect_error("expect: {diverges: On}\n", "must be true or false, got 'On'");
  expect_error("expect: {diverges: \"true\"}\n",
               "key 'expect.diverges': must be true or false, got the string 'true' (quoted)");
  expect_error("defenses: {warmup_steps: \"4\"}\n",
               "key 'defenses.warmup_steps': must be an integer, got the string '4' (quoted); write it plainly");
  expect_error("expect: {final_loss_below: '3.5'}\n",
               "key 'expect.final_loss_below': must be a number, got the string '3.5' (quoted); write it plainly");
  expect_error("expect: {params_finite: false, loss_finite: false}\n",
               "test.yaml:6: key 'expect.params_finite': false expects the run to break, which is a negative "
               "control's claim: write params_finite: true with diverges: true");
  expect_error("expect: {loss_finite: false}\n", "key 'expect.loss_finite': false expects the run to break");
  // More applied steps than steps from the fault on (the test scenario has 4): never passes.
  expect_error("injections: [{type: grad_nonfinite, step: 2}]\nexpect: {min_applied_steps: 4}\n",
               "key 'expect.min_applied_steps': is 4, but steps 2..4 are 3, so it could never pass; lower it or "
               "raise training.steps");
  EXPECT_EQ(
      with("injections: [{type: grad_nonfinite, step: 2}]\nexpect: {min_applied_steps: 3}\n").expect.min_applied_steps,
      3);
  // A held scenario expecting a recompute that is not bitwise: a bitwise one had "broke" it.
  expect_error("expect: {recompute_bitwise: false}\n",
               "key 'expect.recompute_bitwise': false expects the run to break, which is a negative control's "
               "claim: write recompute_bitwise: true with diverges: true");
  const ScenarioSpec ok = with("defenses: {warmup_steps: 4}\nexpect: {diverges: True, params_finite: false, "
                               "final_loss_below: 3.5, replay_bitwise: FALSE}\n");
  EXPECT_TRUE(ok.expect.diverges);
  EXPECT_EQ(ok.defenses.warmup_steps, 4);
  EXPECT_EQ(ok.expect.params_finite, false);
  EXPECT_EQ(ok.expect.final_loss_below, 3.5);
  EXPECT_EQ(ok.expect.replay_bitwise, false);
}

// A setting nothing reads is a mistake, refused by name, not a silent default: momentum under Adam,
// a clip setting its mode never uses, a LayerNorm guard on a model without LayerNorm. Controls:
// the same settings where they act parse, and the canonical YAML (every key at its default)
// round-trips.
TEST(Schema, SettingsNothingReadsAreRefused) {
  auto gpt = [](const std::string& training, const std::string& extra) {
    std::string t(kGpt);
    t.replace(t.find("optimizer: adamw"), 16, training);
    return parse_scenario_text(t + extra, "s.yaml");
  };
  auto refusal = [](const std::function<void()>& parse) -> std::string {
    try {
      parse();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(refusal([&] {
              gpt("optimizer: adamw, momentum: 0.9", "");
            }).find("key 'training.momentum': is SGD's, but training.optimizer is adamw"),
            std::string::npos);
  EXPECT_EQ(gpt("optimizer: sgd, momentum: 0.9", "").training.momentum, 0.9);
  expect_error("defenses: {clip: {mode: off, error_if_nonfinite: true}}\n",
               "key 'defenses.clip.error_if_nonfinite': does nothing with clip mode off");
  expect_error("defenses: {clip: {mode: off, max_norm: 5}}\n", "key 'defenses.clip.max_norm': does nothing with clip");
  expect_error("defenses: {clip: {mode: global, window: 5}}\n",
               "key 'defenses.clip.window': is adaptive clipping's, but clip mode is global");
  EXPECT_EQ(with("defenses: {clip: {mode: adaptive, window: 5, multiplier: 3}}\n").defenses.clip.window, 5);
  EXPECT_NE(refusal([] {
              parse_scenario_text("model: {type: lstm, layers: 2}\ndefenses: {layernorm_fp32: true}\n", "l.yaml");
            }).find("l.yaml:2: key 'defenses.layernorm_fp32': guards LayerNorm, but model type lstm has none"),
            std::string::npos);
  EXPECT_TRUE(with("defenses: {layernorm_fp32: true, layernorm_min_eps: 1.0e-5}\n").defenses.layernorm_fp32);
  const ScenarioSpec every = with("");
  EXPECT_EQ(to_yaml(parse_scenario_text(to_yaml(every), "again")), to_yaml(every));
}

TEST(Schema, KeysAndSegmentsThatCannotWorkAreErrors) {
  // (kGpt has model, data and training already: the extra text uses other sections.)
  expect_error("defenses: {[a]: 1}\n", "test.yaml:6: key 'defenses.?': a key must be a plain name");
  ScenarioSpec four =
      parse_scenario_text("model: {type: tiny_gpt, layers: 4, d_model: 16, heads: 2}\ntraining: {segments: 2}\n"
                          "injections: [{type: activation_overflow, segment: block0..block1}]\n",
                          "ok.yaml");
  EXPECT_EQ(four.injections[0].segment, "block0..block1");
  try {
    parse_scenario_text("model: {type: tiny_gpt, layers: 4, d_model: 16, heads: 2}\ntraining: {segments: 2}\n"
                        "injections: [{type: activation_overflow, segment: block1..block2}]\n",
                        "bad.yaml");
    ADD_FAILURE() << "a range that is not a segment parsed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.yaml:3: key 'injections[0].segment': 'block1..block2' is not one of this "
                                         "run's segments (block0..block1, block2..block3)"),
              std::string::npos)
        << e.what();
  }
  expect_error("injections: [{type: bit_flip, target: weights, bit: 40}]\n",
               "key 'injections[0].bit': must be between 0 and 31");
  expect_error("injections: [{type: bit_flip, target: weights, segment: block0}]\n", "is only for target activations");
  expect_error("expect:\n  max_skipped_steps: |\n    1\n    x\n", "must be an integer, got the string '1 x");
  // A scalar tagged !!str is a string, as a quoted one is (red-team finding: read as the integer 3).
  expect_error("expect: {max_skipped_steps: !!str 3}\n",
               "key 'expect.max_skipped_steps': must be an integer, got the string '3' (tagged !!str); write it "
               "plainly");
  expect_error("defenses: {skip_nonfinite: !!str true}\n", "got the string 'true' (tagged !!str)");
  EXPECT_EQ(with("expect: {max_skipped_steps: !!int 3}\n").expect.max_skipped_steps.value_or(-1), 3);  // control
  // A factor of 0 had been swapped for the type's default (x1000 for an LR the user meant to zero),
  // and a factor of 1 fired and changed nothing. Controls: 0.999, -1, and a huge LayerNorm
  // input's magnitude of 1 are faults, and parse.
  expect_error("injections: [{type: lr_spike, factor: 0}]\n",
               "test.yaml:6: key 'injections[0].factor': is 0, which retrace cannot take as written (0 stands for "
               "the type's default, 1000); omit the key for that default, or give a small number such as 1e-12");
  expect_error("injections: [{type: activation_overflow, segment: block0, factor: 0.0}]\n",
               "the type's default, 1e+06)");
  expect_error("injections: [{type: loss_spike, factor: 1}]\n",
               "key 'injections[0].factor': is 1, which leaves the loss unchanged: the injection would fire and do "
               "nothing; use another factor, or remove the injection");
  expect_error("injections: [{type: lr_spike, factor: 1.0}]\n", "leaves the learning rate unchanged");
  expect_error("injections: [{type: activation_overflow, segment: block0, factor: 1}]\n",
               "leaves the segment's outputs unchanged");
  EXPECT_EQ(with("injections: [{type: lr_spike, factor: 0.999}]\n").injections.at(0).factor, 0.999);
  EXPECT_EQ(with("injections: [{type: loss_spike, factor: -1}]\n").injections.at(0).effective_factor(), -1);
  EXPECT_EQ(with("injections: [{type: layernorm_input, segment: block0, mode: huge, factor: 1}]\n")
                .injections.at(0)
                .effective_factor(),
            1);
}

// Data-parallel keys: world_size, an injection's rank, skip_nonfinite_ranks; each bad value is
// one error naming the key, and a good scenario round-trips (control).
TEST(Schema, DataParallelKeysAreCheckedAndRoundTrip) {
  expect_error("world_size: 0\n", "key 'world_size'");
  expect_error("world_size: 2\ninjections: [{type: grad_nonfinite, step: 2, rank: 2}]\n",
               "key 'injections[0].rank': is 2, but the run has world_size 2 (ranks 0..1)");
  expect_error("defenses: {skip_nonfinite_ranks: true}\n",
               "key 'defenses.skip_nonfinite_ranks': needs a data-parallel run (world_size 2 or more)");
  const ScenarioSpec a = with("world_size: 3\ndefenses: {skip_nonfinite_ranks: true}\n"
                              "injections: [{type: bit_flip, target: gradients, bit: 30, step: 2, rank: 1}]\n");
  EXPECT_EQ(a.world_size, 3);
  EXPECT_EQ(a.injections[0].rank, 1);
  EXPECT_EQ(a.injections[0].target, "gradients");
  const ScenarioSpec b = parse_scenario_text(to_yaml(a), "again");
  EXPECT_EQ(to_yaml(a), to_yaml(b));
  EXPECT_EQ(b.world_size, 3);
  EXPECT_TRUE(b.defenses.skip_nonfinite_ranks);
  EXPECT_TRUE(a.injections[0] == b.injections[0]);
  // A single-process scenario's canonical form has no world_size (traces keep their configs).
  EXPECT_EQ(to_yaml(with("")).find("world_size"), std::string::npos);
}

// training.recompute: selective needs segments 0 and a tiny_gpt; a bad value names the key; a
// selective scenario round-trips, and a full one's canonical form does not mention it (control).
TEST(Schema, RecomputeSelectiveIsCheckedAndRoundTrips) {
  const auto error = [](const std::string& text) {
    try {
      parse_scenario_text(text, "r.yaml");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(parsed)");
  };
  const std::string gpt = "model: {type: tiny_gpt, layers: 2, d_model: 16, heads: 2}\n";
  EXPECT_NE(error(gpt + "training: {recompute: some}\n").find("r.yaml:2: key 'training.recompute'"), std::string::npos);
  EXPECT_NE(error(gpt + "training: {segments: 2, recompute: selective}\n")
                .find("key 'training.recompute': is selective, which recomputes parts of each block and keeps its "
                      "matmul outputs"),
            std::string::npos);
  EXPECT_NE(error("model: {type: mlp}\ntraining: {recompute: selective}\n").find("r.yaml:2: key 'training.recompute'"),
            std::string::npos);
  const ScenarioSpec a = parse_scenario_text(
      "model: {type: tiny_gpt, layers: 2, d_model: 16, heads: 2}\ntraining: {recompute: selective}\n", "a.yaml");
  EXPECT_EQ(a.training.recompute, "selective");
  const ScenarioSpec b = parse_scenario_text(to_yaml(a), "again");
  EXPECT_EQ(b.training.recompute, "selective");
  EXPECT_EQ(to_yaml(a), to_yaml(b));
  EXPECT_NE(to_yaml(a).find("\n  recompute: selective"), std::string::npos);
  EXPECT_EQ(to_yaml(with("")).find("\n  recompute:"), std::string::npos);
}

}  // namespace
}  // namespace retrace
