// diagnose on a scenario: the fix it names for fp16 overflow, an LR spike and RNG desync, and
// nothing to diagnose in a healthy run.
#include "../support/scenario_text.h"
#include "../support/state_compare.h"

#include <retrace/diagnose.h>
#include <retrace/runner.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <limits>

namespace retrace {
namespace {

std::vector<std::string> fixing(const Diagnosis& d) {
  std::vector<std::string> out;
  for (const VariantResult& v : d.variants) {
    if (v.fixes) out.push_back(v.name);
  }
  return out;
}

DiagnoseOptions untimed() {
  DiagnoseOptions o;
  o.repeats = 1;  // which variants fix it, not what they cost
  return o;
}

TEST(Diagnose, NamesTheFixForFp16OverflowLrSpikeAndRngDesync) {
  const Diagnosis overflow = diagnose_scenario(load_scenario("builtin:fp16-overflow-loss-scaling-off"), untimed());
  EXPECT_EQ(overflow.failing_step, 4);
  EXPECT_EQ(overflow.classification.kind, "persistent");
  EXPECT_FALSE(overflow.baseline.fixes);  // the failure comes back from the snapshot
  const auto f1 = fixing(overflow);
  EXPECT_TRUE(has(f1, "loss scaling")) << overflow.report();
  EXPECT_TRUE(has(f1, "fp32")) << overflow.report();
  EXPECT_FALSE(has(f1, "clip 1.0")) << overflow.report();  // clipping cannot fix an Inf forward
  EXPECT_TRUE(overflow.variants.front().fixes);            // ranked: fixing variants first

  const Diagnosis spike = diagnose_scenario(load_scenario("builtin:lr-spike-clipping-off"), untimed());
  EXPECT_EQ(spike.failing_step, -1);  // no step goes non-finite; the final loss is the failure
  EXPECT_EQ(spike.classification.kind, "none");
  const auto f2 = fixing(spike);
  EXPECT_TRUE(has(f2, "clip 1.0")) << spike.report();
  EXPECT_TRUE(has(f2, "lr / 10 + warmup")) << spike.report();
  EXPECT_FALSE(has(f2, "loss scaling")) << spike.report();

  const Diagnosis desync = diagnose_scenario(load_scenario("builtin:rng-desync-not-preserved"), untimed());
  EXPECT_NE(desync.failure.find("non-bitwise recompute"), std::string::npos) << desync.failure;
  EXPECT_EQ(fixing(desync), std::vector<std::string>{"checkpointing off"}) << desync.report();
}

TEST(Diagnose, NothingToDiagnoseInAHealthyRun) {
  const Diagnosis d = diagnose_scenario(load_scenario("builtin:bf16-clean"));
  EXPECT_TRUE(d.variants.empty());
  EXPECT_NE(d.failure.find("none"), std::string::npos);
}

}  // namespace
}  // namespace retrace
