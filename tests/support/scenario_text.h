#pragma once
// Test support: the small two-block tiny GPT the scenario tests start from, and a scenario made
// of it plus extra sections (injections, defenses, expect), parsed as "test.yaml".

#include <retrace/scenario.h>

#include <string>

namespace retrace::test {

inline constexpr const char* kGpt = R"(
name: t
model: {type: tiny_gpt, layers: 2, d_model: 16, heads: 2, vocab: 32, seq_len: 8, dropout: 0.1}
data: {batch: 4}
training: {steps: 4, optimizer: adamw, lr: 0.003, segments: 2}
)";

inline ScenarioSpec with(const std::string& extra) {
  return parse_scenario_text(std::string(kGpt) + extra, "test.yaml");
}

}  // namespace retrace::test
