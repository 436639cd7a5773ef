#pragma once
// The model the CPU benchmarks share: an 8-block tiny GPT (d_model 64, 4 heads, 32 tokens a
// sequence, 8 sequences a step: 256 tokens), dropout on.

#include <retrace/models.h>

namespace retrace::bench {

inline models::GptConfig gpt8_config() {
  models::GptConfig c;
  c.layers = 8;
  c.d_model = 64;
  c.heads = 4;
  c.seq_len = 32;
  c.batch = 8;
  c.dropout = 0.1;
  return c;
}

}  // namespace retrace::bench
