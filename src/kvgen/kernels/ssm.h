// The selective scan of Mamba's mixers (kvgen.models.selective_scan): the state recurrence, token after token.
//
// Example (ops.cpp's kvgen::selective_scan): y (batch, T, D) and the state after the last token, in place
//     selective_scan(h, dt, x, A, B, C, batch, T, D, N, y);
#pragma once

#include <cstdint>

namespace kvgen {

// For each batch row b and channel d: h_t = exp(dt_t A[d]) * h_{t-1} + (dt_t x_t) B_t and y[b, t, d] = C_t . h_t,
// with h (batch, D, N) the state before the first token (the last one's after), dt (after softplus) and x (batch, T,
// D), A (D, N), B and C (batch, T, N), all contiguous float32. Channels in parallel.
void selective_scan(float* h, const float* dt, const float* x, const float* A, const float* B, const float* C,
                    int64_t batch, int64_t T, int64_t D, int64_t N, float* y);

}  // namespace kvgen
