// Op-level non-finite provenance: the first op that made a NaN or Inf, with its inputs.
#include "../support/recording.h"

#include <retrace/recorder.h>
#include <retrace/replayer.h>
#include <retrace/trace.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

namespace retrace {
namespace {

namespace fs = std::filesystem;

// A program of single ops, to pin down what provenance reports about them. config: "copy" (a
// NaN from the batch copied into zeros: the first non-finite op is in-place), "sqrt" (the square
// root of a negative parameter), "all-nan" (an op on an all-NaN batch, whose loss is -nan).
class OpProgram : public Program {
 public:
  explicit OpProgram(std::string config) : config_(std::move(config)) {}
  std::string name() const override { return "test.ops"; }
  std::string config() const override { return config_; }
  std::vector<NamedTensor> state() override { return {{"param.w", w_}}; }
  void load_state(const std::vector<NamedTensor>& state) override {
    for (const NamedTensor& n : state) {
      if (n.name == "param.w") w_.copy_(n.tensor);
    }
  }
  std::vector<NamedTensor> batch(std::int64_t) override {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    if (config_ == "all-nan") return {{"input", torch::full({3}, -nan)}};  // -nan: sign bit set
    return {{"input", torch::tensor({1.0f, nan, 2.0f, 3.0f})}};
  }
  StepOutcome step(std::int64_t, const std::vector<NamedTensor>& batch, StepMonitor*) override {
    torch::NoGradGuard no_grad;
    at::Tensor y;
    if (config_ == "copy") {
      y = torch::zeros({4});
      y.copy_(batch[0].tensor);
    } else if (config_ == "sqrt") {
      y = w_.sqrt();
    } else if (config_ == "mse") {
      y = torch::mse_loss(w_ * 1e20f, torch::zeros({3}));  // squares past float's range inside mse_loss
    } else if (config_.rfind("masked", 0) == 0) {
      // Attention-like scores masked with -inf and scaled: "masked-scale" overflows after the
      // softmax, "masked-overflow" scales the scores past float's range, "masked-row" masks a
      // whole row (its softmax is NaN).
      const at::Tensor scores = w_.unsqueeze(0).repeat({2, 1});
      const at::Tensor mask = config_ == "masked-row"
                                  ? torch::tensor({false, true, true, true, true, true}).view({2, 3})
                                  : torch::tensor({false, true, true, false, false, true}).view({2, 3});
      const at::Tensor masked = scores.masked_fill(mask, -std::numeric_limits<double>::infinity());
      const at::Tensor p = at::softmax(masked.mul(config_ == "masked-overflow" ? 1e38 : 0.5), -1);
      y = config_ == "masked-scale" ? p.mul(1e30).mul(1e30) : p;
    } else if (config_ == "bias-overflow") {
      // Finite scores plus a broadcast bias masked with -inf: their sum overflows (4 x 3e37 +
      // 2.5e38) beside the mask, and the softmax of that row is NaN.
      const at::Tensor scores = w_.unsqueeze(0).repeat({2, 1}) * 3e37;
      const at::Tensor bias =
          torch::tensor({2.5e38f, 0.0f, 0.0f})
              .masked_fill(torch::tensor({false, false, true}), -std::numeric_limits<double>::infinity());
      y = at::softmax(scores + bias, -1);
    } else if (config_ == "sort-row") {
      // A masked element moved by an ascending sort ({4, -inf, 9} to {-inf, 4, 9}), then times 0:
      // the mask's infinity, moved, turns into NaN.
      const at::Tensor masked =
          w_.masked_fill(torch::tensor({false, true, false}), -std::numeric_limits<double>::infinity());
      y = std::get<0>(masked.sort(-1)).mul(0.0);
    } else if (config_ == "sort-then-sqrt") {
      // The masked -inf moved by an ascending sort, absorbed by the softmax; then a real NaN.
      const at::Tensor masked = w_.unsqueeze(0).repeat({2, 1}).masked_fill(
          torch::tensor({false, true, false, false, false, true}).view({2, 3}),
          -std::numeric_limits<double>::infinity());
      const at::Tensor p = at::softmax(std::get<0>(masked.sort(-1)), -1);
      y = (p.sum() - 1e6).sqrt();
    } else if (config_ == "raise-after-mask") {
      // Masked, absorbed, then the step raises: nothing non-finite is left.
      const at::Tensor masked =
          w_.masked_fill(torch::tensor({false, true, false}), -std::numeric_limits<double>::infinity());
      y = at::softmax(masked.mul(0.5), -1);  // the scale carries the -inf on, the softmax absorbs it
      throw std::runtime_error("a loader hiccup");
    } else if (config_ == "half-constant") {
      // A constant past Half's range multiplies a Half tensor small enough for the product to fit:
      // type promotion casts the constant to a Half infinity the kernel never uses (it computes in
      // float). Then a real NaN: the square root of the -1 element.
      const at::Tensor h = (w_.to(at::kHalf) * 1e-5) * 1e5;
      y = h.to(at::kFloat).sqrt();
    } else if (config_ == "half-cast") {
      y = w_.mul(1e5).to(at::kHalf);  // the user's own cast past Half's range (9e5 > 65504)
    } else if (config_ == "fill-inf") {
      y = w_.clone();
      y.fill_(std::numeric_limits<double>::infinity());  // an infinity by design the loss carries on
    } else {
      y = batch[0].tensor.mul(2);
    }
    StepOutcome out;
    out.loss = y.sum().item<double>();
    out.grad_norm = 0;
    return out;
  }

 private:
  std::string config_;
  at::Tensor w_ = torch::tensor({4.0f, -1.0f, 9.0f});
};

ReplayResult record_and_replay_ops(const std::string& config, bool drop_step_end = false,
                                   StepOutcome* recorded = nullptr) {
  register_program("test.ops", [](const std::string& c) { return std::make_unique<OpProgram>(c); });
  OpProgram program(config);
  const std::string path = temp_path("ops_" + config);
  {
    Recorder recorder(path, program);
    std::vector<StepOutcome> outcomes;
    try {
      outcomes = record_run(program, recorder, 1);
    } catch (const std::exception&) {  // "raise-after-mask": the trace notes it
    }
    if (recorded && !outcomes.empty()) *recorded = outcomes.front();
    recorder.close();
  }
  std::string replayed = path;
  if (drop_step_end) {  // as if the run had died in the step
    replayed = temp_path("ops_died_" + config);
    const TraceReader in(path);
    TraceWriter out(replayed, [&] {
      nlohmann::json h = in.header();
      h.erase("format_version");
      h.erase("writer");
      return h;
    }());
    for (std::size_t i = 0; i < in.records().size(); ++i) {
      Record rec = in.read(i);
      if (rec.type == RecordType::kStepEnd) continue;
      std::vector<TensorToWrite> tensors;
      for (const TensorEntry& e : rec.tensors) {
        EXPECT_TRUE(e.has_data()) << "a one-step trace stores every tensor of its step_begin";
        if (e.has_data()) tensors.push_back({e.name, in.decode(rec, e), true, std::nullopt});
      }
      rec.meta.erase("tensors");
      out.append(rec.type, rec.meta, tensors);
    }
    out.close();
  }
  ReplayResult r = replay(replayed);
  fs::remove(path);
  if (replayed != path) fs::remove(replayed);
  return r;
}

// An in-place op's inputs are reported as they were before it: the destination of copy_ held
// zeros (its output holds the NaN), the source the NaN. Control: the output, read after the op,
// does hold it -- the report of input 0 would too if it were taken after the op.
TEST(Provenance, InPlaceOpShowsItsInputsBeforeTheOp) {
  const ReplayResult r = record_and_replay_ops("copy");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.op, "aten::copy_");
  ASSERT_EQ(o.inputs.size(), 2u);
  EXPECT_EQ(o.inputs[0].nonfinite.nan, 0) << o.message();
  EXPECT_EQ(o.inputs[0].min, 0);
  EXPECT_EQ(o.inputs[0].max, 0);
  EXPECT_EQ(o.inputs[1].nonfinite.nan, 1);
  ASSERT_EQ(o.outputs.size(), 1u);
  EXPECT_EQ(o.outputs[0].nonfinite.nan, 1);  // the control: the same tensor after the op
}

// The text line names the min and max of each input: the -1 that sqrt turned into NaN. Control:
// an input with no such value (all finite and positive) would show min > 0.
TEST(Provenance, TextLineNamesTheInputsMinAndMax) {
  const ReplayResult r = record_and_replay_ops("sqrt");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.op, "aten::sqrt");
  ASSERT_EQ(o.inputs.size(), 1u);
  EXPECT_EQ(o.inputs[0].min, -1);
  EXPECT_EQ(o.inputs[0].max, 9);
  const std::string text = o.message();
  EXPECT_NE(text.find("input 0 Float[3] min -1 max 9 |max| 9 nan=0 inf=0"), std::string::npos) << text;
  EXPECT_EQ(o.to_json()["inputs"][0]["min"], -1.0);
}

// An op that makes the value inside its own kernel and hands it to nested ops (mse_loss squares,
// then sums and divides) is named, not the nested op that first returned it. Control: the nested
// op was handed the infinity (its input is non-finite), so naming it would blame the wrong op.
TEST(Provenance, AnOpThatMakesTheValueInsideItIsNamedNotItsInnerOp) {
  const ReplayResult r = record_and_replay_ops("mse");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.op, "aten::mse_loss") << o.message();
  EXPECT_FALSE(o.inner_op.empty()) << o.message();
  ASSERT_EQ(o.inputs.size(), 2u);  // mse_loss's own inputs: finite
  EXPECT_EQ(o.inputs[0].nonfinite.pos_inf + o.inputs[0].nonfinite.nan, 0) << o.message();
  EXPECT_NE(o.message().find("(made inside it, first returned by its inner aten::"), std::string::npos) << o.message();
  EXPECT_EQ(o.to_json()["inner_op"], o.inner_op);
}

// A Half infinity that type promotion makes of a constant (the 1e5 of `h * 1e5`, cast for a kernel
// that computes in float and never reads it) is no value of the run: the op named is the square
// root that made the NaN. Control: a cast the program makes itself, of a tensor past Half's range,
// is named.
TEST(Provenance, AConstantsCastForTypePromotionIsNotNamed) {
  ReplayResult r = record_and_replay_ops("half-constant");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  EXPECT_EQ(r.first_nonfinite->op, "aten::sqrt") << r.first_nonfinite->message();

  r = record_and_replay_ops("half-cast");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_TRUE(o.op == "aten::to" || o.op == "aten::_to_copy" || o.op == "aten::copy_") << o.message();
  ASSERT_FALSE(o.outputs.empty());
  EXPECT_EQ(o.outputs[0].nonfinite.pos_inf, 2) << o.message();  // 4e5 and 9e5
}

// An infinity an op was given as an argument (masked_fill(mask, -inf)) is no fault while ops carry
// it on (the scale after the masking) and a softmax absorbs it: the op named is the one that
// overflowed later, with finite inputs. Control: the scale was handed the infinity and returned
// one, so a rule that names any op returning an infinity it did not make names it.
TEST(Provenance, AnInfinityByDesignCarriedOnAndAbsorbedIsNoFault) {
  const ReplayResult r = record_and_replay_ops("masked-scale");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.op, "aten::mul") << o.message();
  EXPECT_FALSE(o.given_infinity) << o.message();
  ASSERT_FALSE(o.inputs.empty());
  EXPECT_EQ(o.inputs[0].nonfinite.neg_inf + o.inputs[0].nonfinite.pos_inf, 0) << o.message();  // not the scale
  EXPECT_GT(o.inputs[0].abs_max, 1e29) << o.message();  // the second multiply by 1e30
  EXPECT_EQ(o.to_json().count("given_infinity"), 0u);
}

// An op handed an infinity by design that makes infinities where its input held none (scores
// scaled past float's range) is named itself. Control: the masked_fill's output holds -inf too,
// and naming the infinity's maker would blame the mask.
TEST(Provenance, AnOpThatAddsInfinitiesToOnesByDesignIsNamed) {
  const ReplayResult r = record_and_replay_ops("masked-overflow");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.op, "aten::mul") << o.message();
  EXPECT_FALSE(o.given_infinity);
  ASSERT_FALSE(o.inputs.empty());
  EXPECT_EQ(o.inputs[0].nonfinite.neg_inf, 3) << o.message();  // handed the mask's three -inf
  ASSERT_FALSE(o.outputs.empty());
  EXPECT_EQ(o.outputs[0].nonfinite.pos_inf, 2) << o.message();  // and made +inf of the two unmasked 4s
}

// An infinity by design that turns into a NaN (a softmax of a row masked whole) is named at the op
// that was given it, with the op that made the NaN. Control: the softmax's output is where the
// NaN first appears, and a rule that names the first NaN names it.
TEST(Provenance, AnInfinityByDesignThatTurnsIntoANanNamesItsOpAndTheNansOp) {
  const ReplayResult r = record_and_replay_ops("masked-row");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.op, "aten::masked_fill") << o.message();
  EXPECT_TRUE(o.given_infinity);
  EXPECT_NE(o.nan_op.find("softmax"), std::string::npos) << o.message();
  EXPECT_EQ(o.nan_phase, "forward");
  ASSERT_FALSE(o.outputs.empty());
  EXPECT_EQ(o.outputs[0].nonfinite.neg_inf, 5) << o.message();
  EXPECT_EQ(o.outputs[0].nonfinite.nan, 0);
  const std::string text = o.message();
  EXPECT_NE(text.find("op aten::masked_fill in (outside segments), phase forward (an infinity it was given as an "
                      "argument, which aten::"),
            std::string::npos)
      << text;
  const nlohmann::json j = o.to_json();
  EXPECT_EQ(j["given_infinity"], true);
  EXPECT_EQ(j["nan_op"], o.nan_op);
  EXPECT_TRUE(j["carried_to"].is_null());
}

// An infinity by design that the step ends with (the loss sums it) is named at the op given it,
// with the last op that carried it on. Control: that sum returned the first infinity not made by
// an op given one, and a search that stops at such ops names it.
TEST(Provenance, AnInfinityByDesignTheStepEndsWithNamesItsOp) {
  const ReplayResult r = record_and_replay_ops("fill-inf");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.op, "aten::fill_") << o.message();
  EXPECT_TRUE(o.given_infinity);
  EXPECT_TRUE(o.nan_op.empty());
  EXPECT_EQ(o.carried_to, "aten::sum") << o.message();
  EXPECT_NE(o.message().find("which no later op absorbed: aten::sum was the last op to carry it on"), std::string::npos)
      << o.message();
  EXPECT_EQ(o.to_json()["carried_to"], "aten::sum");
}

// An op handed an infinity by design that overflows beside it -- a broadcast bias masked with
// -inf plus finite scores -- made an infinity of its own: named, with the softmax that made it NaN.
// Control: the bias (shape [3]) is handed to the add broadcast over [2, 3], so a rule that only
// compares inputs of the output's own shape takes the add for a carrier and names the mask.
TEST(Provenance, AnOverflowBesideABroadcastMaskIsNamedNotTheMask) {
  const ReplayResult r = record_and_replay_ops("bias-overflow");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.op, "aten::add") << o.message();
  EXPECT_FALSE(o.given_infinity);
  EXPECT_NE(o.nan_op.find("softmax"), std::string::npos) << o.message();
  ASSERT_FALSE(o.outputs.empty());
  EXPECT_EQ(o.outputs[0].nonfinite.pos_inf, 2) << o.message();  // row 0 and row 1, first column
  EXPECT_NE(o.message().find("(an infinity it made, handed infinities by design, which aten::"), std::string::npos)
      << o.message();
  EXPECT_EQ(o.to_json()["given_infinity"], false);
}

// Moving masked infinities (an ascending sort) makes none: the real NaN later (sqrt of a negative)
// is named. Control: the sort's output holds -inf where its input held finite values, so a rule
// that compares positions alone names the sort.
TEST(Provenance, AnOpThatMovesInfinitiesByDesignMakesNone) {
  const ReplayResult r = record_and_replay_ops("sort-then-sqrt");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  EXPECT_EQ(r.first_nonfinite->op, "aten::sqrt") << r.first_nonfinite->message();
  EXPECT_FALSE(r.first_nonfinite->given_infinity);
  // And when the moved infinity turns into a NaN, the mask is named, not the sort (whose output
  // holds as many infinities as its input: none of its own).
  const ReplayResult row = record_and_replay_ops("sort-row");
  ASSERT_TRUE(row.first_nonfinite.has_value());
  EXPECT_EQ(row.first_nonfinite->op, "aten::masked_fill") << row.first_nonfinite->message();
  EXPECT_EQ(row.first_nonfinite->nan_op, "aten::mul") << row.first_nonfinite->message();
}

// A step that raises with every infinity by design absorbed gets no first non-finite op: its raise
// was not about one. Control: the replay did re-run it (it reproduced the raise), and a scale
// carried the mask's infinity on, which a step known to be non-finite would name (fill-inf).
TEST(Provenance, ARaisedStepWithItsInfinitiesAbsorbedNamesNoOp) {
  const ReplayResult r = record_and_replay_ops("raise-after-mask");
  ASSERT_TRUE(r.raised.has_value()) << r.to_json().dump(1);
  EXPECT_EQ(r.raised->what, "a loader hiccup");
  EXPECT_FALSE(r.first_nonfinite.has_value()) << r.first_nonfinite->message();
}

// An all-NaN tensor has no min or max: NaN, not 0, in text and JSON; and a loss of -nan prints as
// nan. Control: the partly-NaN source of copy_ keeps its finite min and max (1 and 3), and the
// recorded loss really is negative (so printing it with << would say -nan).
TEST(Provenance, AllNanTensorHasNanStatsAndNegativeNanPrintsAsNan) {
  StepOutcome recorded;
  const ReplayResult r = record_and_replay_ops("all-nan", /*drop_step_end=*/true, &recorded);
  ASSERT_TRUE(std::isnan(recorded.loss));
  ASSERT_TRUE(std::signbit(recorded.loss));
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  ASSERT_FALSE(o.inputs.empty());
  EXPECT_TRUE(std::isnan(o.inputs[0].min));
  EXPECT_TRUE(std::isnan(o.inputs[0].max));
  EXPECT_TRUE(std::isnan(o.inputs[0].abs_max));
  const std::string text = o.message();
  EXPECT_NE(text.find("input 0 Float[3] (no finite element) nan=3"), std::string::npos) << text;
  const nlohmann::json j = r.to_json();
  EXPECT_EQ(j["first_nonfinite"]["inputs"][0]["min"], "nan");
  EXPECT_EQ(j["first_nonfinite"]["inputs"][0]["abs_max"], "nan");
  EXPECT_EQ(j.dump().find("-nan"), std::string::npos) << j.dump();
  bool noted = false;
  for (const std::string& n : r.notes) {
    EXPECT_EQ(n.find("-nan"), std::string::npos) << n;
    noted = noted || n.find("re-executed from its snapshot: loss nan, grad norm 0") != std::string::npos;
  }
  EXPECT_TRUE(noted);

  const ReplayResult control = record_and_replay_ops("copy");
  ASSERT_TRUE(control.first_nonfinite.has_value());
  ASSERT_EQ(control.first_nonfinite->inputs.size(), 2u);
  EXPECT_EQ(control.first_nonfinite->inputs[1].min, 1);
  EXPECT_EQ(control.first_nonfinite->inputs[1].max, 3);
}

}  // namespace
}  // namespace retrace
