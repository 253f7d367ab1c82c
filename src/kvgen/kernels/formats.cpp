// What a format's weight holds, and its rows back as float32 (dot.h declares these): dequantization exactly as
// gguf's, for prefills that multiply float32 rows and for embedding lookups.
#include <cstring>
#include <type_traits>
#include <vector>

#include "dot.h"
#include "formats.h"
#include "parallel.h"

namespace kvgen {

bool format_shape(int64_t format, FormatShape* shape) {
  return dispatch(format, [&](auto t) {
    using T = decltype(t);
    *shape = {T::QK, T::BYTES, tile_rows<T>(), has_row_scale<T>(), std::is_same_v<T, F32>};
  });
}

void dequantize(int64_t format, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, float* out, int64_t ld) {
  dispatch(format, [&](auto t) {
    using T = decltype(t);
    parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { dequantize_rows<T>(w, row_bytes, n0, n1, K, out, ld); });
  });
}

// (a decode step's index_select + dequantize + pick of a row in its tile were five ATen calls, ~40 us; after a
// step's weights streamed through the caches, ~200 us)
void embedding(int64_t format, const uint8_t* w, int64_t row_bytes, const int64_t* ids, int64_t n, int64_t K,
               float* out) {
  dispatch(format, [&](auto t) {
    using T = decltype(t);
    parallel_for(0, n, 8, [&](int64_t i0, int64_t i1) {
      std::vector<float> tile(tiled<T>() ? 16 * K : 0);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t id = ids[i];
        if constexpr (tiled<T>()) {
          const int64_t first = id / 16 * 16;  // the tile holds rows first .. first + 15
          dequantize_rows<T>(w + first * row_bytes, row_bytes, 0, 16, K, tile.data(), K);
          std::memcpy(out + i * K, tile.data() + (id - first) * K, K * sizeof(float));
        } else {
          dequantize_rows<T>(w + id * row_bytes, row_bytes, 0, 1, K, out + i * K, K);
        }
      }
    });
  });
}

}  // namespace kvgen
