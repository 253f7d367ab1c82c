// What a format's weight holds, and its rows back as float32 (dot.h declares these): dequantization exactly as
// gguf's, for prefills that multiply float32 rows and for embedding lookups.
#include <array>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

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

namespace {

// one tile of tile_rows, with head fields of F bytes (2: GGUF's float16; 4: kvgen's int4 float32), runs q[0] ..
// q[1] - 1 of each block stored as Quads (formats.h's quad_runs)
template <int F>
void tile_one(const uint8_t* first, int64_t stride, int64_t blocks, int64_t size, int64_t head, int64_t extra,
              std::array<int, 2> q, uint8_t* tile) {
  const int64_t whole = head + (size - head) / 16 * 16;  // columns transposed 16 at a time
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* in = first + b * size;
    uint8_t* block = tile + b * 16 * size;
    for (int64_t lane = 0; lane < 16; ++lane)
      for (int64_t f = 0; f < head; f += F) std::memcpy(block + 16 * f + F * lane, in + lane * stride + f, F);
    for (int64_t j = head; j < whole; j += 16)  // byte j of row r: 16 j + r
      transpose16(in + j, stride, block + 16 * j, 16);
    for (int64_t j = whole; j < size; ++j)
      for (int64_t lane = 0; lane < 16; ++lane) block[16 * j + lane] = in[lane * stride + j];
#if defined(KVGEN_DOT2)
    for (int64_t j = q[0]; j < q[1]; j += 4) quads_from_rows(block + 16 * j, block + 16 * j);
#endif
  }
  for (int64_t lane = 0; lane < 16; ++lane)
    std::memcpy(tile + 16 * blocks * size + extra * lane, first + lane * stride + blocks * size, extra);
}

}  // namespace

bool tile_rows(int64_t format, const uint8_t* rows, int64_t stride, int64_t tiles, int64_t row_bytes, uint8_t* out) {
  bool done = false;
  dispatch(format, [&](auto t) {
    using T = decltype(t);
    if constexpr (tiled<T>()) {
      constexpr int64_t size = T::Gguf::BYTES, extra = has_row_scale<T>() ? 4 : 0;
      const int64_t blocks = (row_bytes - extra) / size;
      if (blocks <= 0 || blocks * size + extra != row_bytes) return;
      parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
        for (int64_t i = t0; i < t1; ++i)
          tile_one<field_bytes<T>()>(rows + 16 * i * stride, stride, blocks, size, T::HEAD, extra, quad_runs<T>(),
                                     out + i * 16 * row_bytes);
      });
      done = true;
    }
  });
  return done;
}

std::vector<int64_t> tile_quads(int64_t format) {
  std::vector<int64_t> runs;
  dispatch(format, [&](auto t) {
    constexpr std::array<int, 2> q = quad_runs<decltype(t)>();
    if (q[1] > q[0]) runs = {q[0], q[1]};
  });
  return runs;
}

}  // namespace kvgen
