// The example program's own binary with retrace's subcommands:
//   retrace_example_encoder run examples/encoder/scenarios/      # its fault x defense scenarios
//   retrace_example_encoder record -o run.trace --config my.cfg  # record it, replay it
//   retrace_example_encoder diagnose examples/encoder/scenarios/fp16-overflow-no-defense.yaml
#include "encoder_classifier.h"

#include <retrace/cli.h>

int main(int argc, char** argv) {
  return retrace::main(argc, argv, example::EncoderClassifier::kName,
                       [](const std::string& config) { return std::make_unique<example::EncoderClassifier>(config); });
}
