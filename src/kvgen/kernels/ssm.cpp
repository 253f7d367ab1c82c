// The selective scan of ssm.h: each task takes a run of channels of one batch row (a native register's: 8 with AVX2,
// 16 with AVX-512; 16 lanes through GCC's vector extension ran 2.5x slower on AVX2) and walks the tokens once, the
// run's states as N registers' worth (in L1), so that each token's step is vertical arithmetic over the run's
// channels: a = exp(dt A[:, n]), h[n] = h[n] * a + (dt x) B_t[n], y += h[n] C_t[n], with B_t[n] and C_t[n] broadcast
// and no sum across lanes. The order of kvgen.models.selective_scan.selective_step's operations (its C . h summed in
// another order); exp as simd.h's vexp (2 ulp). A run of fewer channels (D not a multiple of the run) pads its lanes
// with dt = 0: a = 1, nothing added, their y dropped.
#include "ssm.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace kvgen {
namespace {

// the first `count` of a native register's floats from p, the other lanes 0
inline vn load_part(const float* p, int64_t count) {
  vn v{};
  std::memcpy(&v, p, count * sizeof(float));
  return v;
}

}  // namespace

void selective_scan(float* h, const float* dt, const float* x, const float* A, const float* B, const float* C,
                    int64_t batch, int64_t T, int64_t D, int64_t N, float* y) {
  const int64_t runs = (D + LN - 1) / LN;
  parallel_for(0, batch * runs, 1, [&](int64_t first, int64_t last) {
    std::vector<vn> At(N), H(N);  // A[d0 + i, n] and h[b, d0 + i, n] in lane i of At[n], H[n]
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / runs, d0 = task % runs * LN, width = std::min<int64_t>(LN, D - d0);
      float* const hb = h + (b * D + d0) * N;
      for (int64_t n = 0; n < N; ++n) {
        At[n] = H[n] = vn{};
        for (int64_t i = 0; i < width; ++i) {
          At[n][i] = A[(d0 + i) * N + n];
          H[n][i] = hb[i * N + n];
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = b * T + t;
        const float *Bt = B + row * N, *Ct = C + row * N;
        const vn step = load_part(dt + row * D + d0, width), u = step * load_part(x + row * D + d0, width);
        vn acc{};
        for (int64_t n = 0; n < N; ++n) {
          H[n] = H[n] * vexp(step * At[n]) + u * Bt[n];
          acc += H[n] * Ct[n];
        }
        std::memcpy(y + row * D + d0, &acc, width * sizeof(float));
      }
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < width; ++i) hb[i * N + n] = H[n][i];
    }
  });
}

}  // namespace kvgen
