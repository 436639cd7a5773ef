#pragma once
// What an injection is asked to do: its type, schedule (step, duration, probability, seed) and
// the fault's parameters. Plain data, read from a scenario file's `injections:` (scenario.h) and
// carried out by the Injector (injectors.h), which this header does not need.

#include <cstdint>
#include <string>
#include <vector>

namespace retrace {

enum class InjectionType {
  kActivationOverflow,  // multiply a segment's outputs by `factor` (fp16 overflows past 65504)
  kLrSpike,             // learning rate x factor for `duration` steps
  kLayerNormInput,      // rows of a segment's outputs (the next LayerNorm's input): constant,
                        // huge (|x| = factor) or NaN
  kGradNonFinite,       // one gradient element set to NaN or Inf after backward
  kLossSpike,           // loss x factor before backward
  kBitFlip,             // flip `bits` bits of one element of a weight, an activation or an
                        // optimizer state tensor (sign, exponent, mantissa or any bit)
  kRngDesync,           // consume the CPU generator between a segment's forward and its
                        // recompute (as a data loader or a stray dropout would)
  kCorruptBatch,        // NaN features, or token ids outside the vocabulary
};
const char* to_string(InjectionType type);
// Throws retrace::Error listing the known names.
InjectionType parse_injection_type(const std::string& name);
std::vector<std::string> injection_type_names();

struct InjectionSpec {
  InjectionType type = InjectionType::kActivationOverflow;
  std::int64_t step = 1;      // first step it may fire on (1-based)
  std::int64_t duration = 1;  // consecutive steps it may fire on
  double probability = 1.0;   // chance to fire on each of those steps (seeded)
  std::uint64_t seed = 0;
  // Segment for segment faults ("" = the first segment). A name as checkpoint_sequential makes
  // it ("block0..block1"), or a stage name inside one ("block1").
  std::string segment;
  // Segment faults: where the fault lands. both (default): the forward and, identically, its
  // recompute -- the gradients are the faulted forward's. forward: the forward only; the
  // recompute runs clean, so the gradients disagree with the forward that made the loss (a fault
  // that struck once). recompute: the recompute only; the loss is clean, the gradients are not.
  std::string phase = "both";
  double factor = 0;  // spike / overflow factor, or the huge magnitude; 0 = the default
  // kLayerNormInput: constant | huge | nan. kGradNonFinite: nan | inf.
  // kCorruptBatch: nan_features | token_out_of_range.
  std::string mode;
  // kBitFlip: weights | activations | optimizer | gradients (after backward, before the all-reduce
  // of a data-parallel run).
  std::string target;
  std::string bit_class = "exponent";  // kBitFlip: sign | exponent | mantissa | any
  int bits = 1;                        // kBitFlip: how many distinct bits of the element
  int bit = -1;                        // kBitFlip: this bit (0 = least significant), not a random
                                       // one of bit_class
  double rows = 0.25;                  // kLayerNormInput: fraction of rows hit (at least one)
  int rank = -1;                       // a data-parallel run: fires on this rank only (-1: on every rank)

  double effective_factor() const;  // factor, or the type's default when 0
  // A fault that acts inside a checkpointed segment (through the observer): activation
  // overflow, LayerNorm rows, RNG desync, and bit flips of activations.
  bool in_segment() const;
  bool operator==(const InjectionSpec& o) const;
};

}  // namespace retrace
