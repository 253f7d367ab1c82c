// What the sampler does to a row of logits before the choice: a grammar's refused tokens set to -inf.
#pragma once

#include <cstdint>

namespace kvgen {

// logits[t] = -inf for every token t < n whose bit (bit t % 32 of word t / 32, llguidance's and xgrammar's layout)
// is 0 in `allowed`; words of all ones (the common case in free text) are skipped, words of zeros filled at once
void mask_refused(float* logits, int64_t n, const uint32_t* allowed);

}  // namespace kvgen
