// The threads the kernels run on: torch's own pool (ATen's OpenMP threads), so that torch.set_num_threads sets
// theirs too. The one torch header the compute files include.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace kvgen {

// f(begin, end) over parts of [begin, end) of at least `grain` items, on the pool's threads
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}

inline int64_t num_threads() { return at::get_num_threads(); }

}  // namespace kvgen
