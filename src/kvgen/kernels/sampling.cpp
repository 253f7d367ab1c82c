// A grammar's mask applied to a row of logits from its bits, without unpacking them into a byte per token.
#include "sampling.h"

#include <algorithm>
#include <limits>

namespace kvgen {

void mask_refused(float* logits, int64_t n, const uint32_t* allowed) {
  const float refused = -std::numeric_limits<float>::infinity();
  for (int64_t w = 0, start = 0; start < n; ++w, start += 32) {
    const uint32_t bits = allowed[w];
    if (bits == 0xFFFFFFFFu) continue;
    const int64_t end = std::min<int64_t>(start + 32, n);
    if (bits == 0) {
      std::fill(logits + start, logits + end, refused);
      continue;
    }
    for (int64_t t = start; t < end; ++t)
      if (!((bits >> (t - start)) & 1u)) logits[t] = refused;
  }
}

}  // namespace kvgen
