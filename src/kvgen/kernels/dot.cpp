// The products of dot.h. Every format decodes each block once, in registers: for up to 8 input rows, rows of blocks
// accumulate d * sum(q * x) + m * sum(x) per group in 16-lane float32 accumulators (matmul_rows: fused
// multiply-adds, one pass over the stored bytes, the float32 dot product up to rounding order). Q4_0, Q4_1, Q5_0,
// Q4_K and Q6_K weights (and Q8_0 and kvgen's int8 and int4 where integer dot products run) in tiles of 16 rows
// (formats 2000 + the format) put 16 rows' values in the lanes instead (matmul_tiles); with AVX-512 VNNI they take
// integer dot products of their stored values with x rounded to 21 bits per block of 32 (matmul_tiles_dot); with
// AMX, products of 16 rows or more take the same sums 16 x 16 at a time, and BF16 weights AMX's bfloat16 products
// (amx.h). With AVX2 alone, those of PANEL_ROWS rows or more (Q6_K, Q8_0 and Q4_K from fewer: panel_rows_of)
// dequantize each tile once into float32 panels (panels2.h).
#include "dot.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "dot2.h"
#include "formats.h"
#include "panels16.h"
#include "panels2.h"
#include "parallel.h"
#include "tiles.h"

namespace kvgen {
namespace {

// bytes ahead of a weight stream that the products prefetch: one thread streamed a cold weight at
// 6 GB/s on its own, 8.5 GB/s with 4 kB of prefetch (Xeon, AVX-512; 2 threads: 14.4 GB/s)
constexpr int64_t PREFETCH = 4096;
// Tiled products stream their blocks in order. On Intel the hardware's prefetchers leave them short of the
// memory's rate and a software prefetch 8 kB ahead into L2 fills the gap: the decode step 1.3-1.7x faster
// (a Xeon with AMX and 480 MB of L3, 1 and 2 threads; 4-16 kB alike, 2 kB less), Gemma 3's 178 MB Q8_0 lm_head at 17.8 GB/s
// on 1 thread against 11.3 without (torch's sum: 12.3). On Zen 4 the same prefetch slowed it (21 -> 16-19 GB/s).
// The same for rows of blocks without a float16 head (F32, BF16, F16; int8 and int4 where they are not tiled):
// SmolLM2's bfloat16 decode step 1.1x faster on that Xeon (2 threads 15.5 -> 13.7 ms, 1 thread 30.5 -> 27.8; 4 kB:
// 1.0x)
const bool PREFETCH_TILES = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
}();
constexpr int64_t TILE_PREFETCH = 8192;

// y[r, n] = sum_k x[r, k] * w[n, k] for R rows of x (R <= 8), rows n0..n1 of w. Per group:
// d * sum(q * x) + m * sum(x), with sum(x) over each group precomputed in xsum (R rows of xld,
// zero past K / GROUP). F16_HEAD formats gather and convert the scales of 16 blocks at once
// before their values (one at a time they cost half the loop's vector instructions), and add
// the m * sum(x) terms as vectors.
template <class T, int R>
void matmul_rows(const float* x, int64_t ldx, const float* xsum, int64_t xld, const uint8_t* w, int64_t row_bytes,
                 int64_t n0, int64_t n1, int64_t K, float* y, int64_t ldy) {
  constexpr int QK = T::QK;
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    vn acc[R][DC] = {};  // native registers: GCC spills a 16-lane accumulator through memory on AVX2
    auto add = [&](int r, const vf& t, float d) {
      vn th[DC];
      std::memcpy(th, &t, 64);
      for (int c = 0; c < DC; ++c) {
        if constexpr (T::SCALED) acc[r][c] += d * th[c];
        else acc[r][c] += th[c];
      }
    };
    auto dot = [&](const float* xb, int run, const vf* q, int count, auto&& then) {
      for (int r = 0; r < R; ++r) {
        const float* xr = xb + r * ldx + 16 * run;
        vf t = q[0] * loadf(xr);
        for (int i = 1; i < count; ++i) t += q[i] * loadf(xr + 16 * i);  // fused multiply-add
        then(r, t);
      }
    };
    float s[R] = {};
    if constexpr (f16_head<T>()) {
      vn macc[R][DC] = {};
      for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int count = (int)std::min<int64_t>(16, nb - b0);
        for (int64_t l = 0; l < count * T::BYTES; l += 64) __builtin_prefetch(wr + b0 * T::BYTES + PREFETCH + l);
        float d[16], m[16];
        f16_heads(wr + b0 * T::BYTES, count, T::BYTES, d, m);
        for (int j = 0; j < count; ++j)
          T::decode(wr + (b0 + j) * T::BYTES, [&](int run, const vf* q, int runs, float, float) {
            dot(x + (b0 + j) * QK, run, q, runs, [&](int r, const vf& t) { add(r, t, d[j]); });
          });
        if constexpr (T::HAS_MIN) {
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < DC; ++c) {
              vn mv, xv;
              std::memcpy(&mv, m + c * LN, sizeof(vn));
              std::memcpy(&xv, xsum + r * xld + b0 + c * LN, sizeof(vn));
              macc[r][c] += mv * xv;
            }
        }
      }
      if constexpr (T::HAS_MIN)
        for (int r = 0; r < R; ++r) s[r] = hsum(macc[r]);
    } else {
      for (int64_t b = 0; b < nb; ++b) {
        if (PREFETCH_TILES) _mm_prefetch(reinterpret_cast<const char*>(wr + b * T::BYTES + TILE_PREFETCH), _MM_HINT_T1);
        else __builtin_prefetch(wr + b * T::BYTES + PREFETCH);
        T::decode(wr + b * T::BYTES, [&](int run, const vf* q, int count, float d, float m) {
          dot(x + b * QK, run, q, count, [&](int r, const vf& t) {
            add(r, t, d);
            if constexpr (T::HAS_MIN) s[r] += m * xsum[r * xld + (b * QK + 16 * run) / T::GROUP];
          });
        });
      }
    }
    for (int r = 0; r < R; ++r) {
      float v = s[r] + hsum(acc[r]);
      if constexpr (has_row_scale<T>()) v = v * f32(wr + K);
      y[r * ldy + n] = v;
    }
  }
}

// y[r, 16 t + i] for tiles t0..t1 of a tiled weight and R rows of x (R <= 8): per group, the 16
// rows' sum(q * x) in lanes (in CH independent chains where there are few rows: one chain of 32
// dependent multiply-adds would wait on their latency), then d * that (+ m * sum(x)) per row
template <class T, int R>  // not inlined: inside the dispatching loop GCC ran Q5_0 tiles 1.6x slower (Zen 4)
__attribute__((noinline)) void matmul_tiles(const float* x, int64_t ldx, const float* xsum, int64_t xld,
                                            const uint8_t* w, int64_t t0, int64_t t1, int64_t K, float* y,
                                            int64_t ldy) {
  constexpr int CH = R >= 4 ? 1 : 4 / R, SLOTS = T::template SLOTS<CH>;
  constexpr int QK = T::Gguf::QK, GROUPS = QK / T::GROUP;
  constexpr int64_t TB = 16 * T::Gguf::BYTES;
  const int64_t nb = K / QK;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * nb * TB;
    vn acc[R][DC] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = tile + b * TB;
      for (int64_t l = 0; l < TB; l += 64) __builtin_prefetch(blk + PREFETCH + l);
      vn part[SLOTS][R][DC] = {};
      const float* xb = x + b * QK;
      auto emit = [&](int slot, int col, const vn* v) {
        for (int r = 0; r < R; ++r) {
          const float xv = xb[r * ldx + col];
          for (int c = 0; c < DC; ++c) part[slot][r][c] += v[c] * xv;
        }
      };
      auto close = [&](int slot, int count, const vn* d, const vn* m, int g) {
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < DC; ++c) {
            vn sum = part[slot][r][c];
            for (int k = 1; k < count; ++k) sum += part[slot + k][r][c];
            for (int k = 0; k < count; ++k) part[slot + k][r][c] = vn{};
            acc[r][c] += d[c] * sum;
            if constexpr (T::HAS_MIN) acc[r][c] += m[c] * xsum[r * xld + b * GROUPS + g];
          }
      };
      T::template block<CH>(blk, emit, close);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < DC; ++c) std::memcpy(y + r * ldy + 16 * t + c * LN, &acc[r][c], sizeof(vn));
  }
}

#if defined(KVGEN_DOT8)
// the input rows rounded for the integer dot products: dot.h's RoundedX
RoundedX round_x(const float* x, int64_t ldx, int64_t R, int64_t K, bool with_level_sums, int64_t tile_rows) {
  RoundedX out{K, Written<int8_t>(R * 3 * K), Written<float>(R * (K / 32)), Written<float>(R * (K / 16)),
               std::vector<int32_t>(with_level_sums ? R * 3 * (K / 32) : 0), Written<int8_t>(tile_rows * 3 * K)};
  const __m512i c64 = _mm512_set1_epi32(64), c127 = _mm512_set1_epi32(127);
  // rows in parallel (a prefill's 512 rows of 2048 values took ~0.5 ms: ~3% of a two-thread prefill, serial)
  parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < K / 32; ++b) {
        const float* xb = x + r * ldx + 32 * b;
        const __m512 v[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float s = amax / XQ_MAX, inv = amax > 0.0f ? XQ_MAX / amax : 0.0f;
        out.scales[r * (K / 32) + b] = s;
        // (not for rows the tile products take: they multiply Q8_0's and int8's signed values, with no bias)
        int32_t* level_sums =
            with_level_sums && r >= tile_rows ? out.level_sums.data() + r * 3 * (K / 32) + b : nullptr;
        for (int h = 0; h < 2; ++h) {
          const __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)));  // |X| <= XQ_MAX
          const __m512i x3 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X, c64), c127), c64);  // -64..63
          const __m512i y = _mm512_srai_epi32(_mm512_sub_epi32(X, x3), 7);
          const __m512i x2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(y, c64), c127), c64);
          const __m512i x1 = _mm512_srai_epi32(_mm512_sub_epi32(y, x2), 7);  // -127..127
          const int64_t k = 32 * b + 16 * h;
          int8_t* q = out.levels.data() + r * 3 * K + k;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(x1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + K), _mm512_cvtepi32_epi8(x2));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 2 * K), _mm512_cvtepi32_epi8(x3));
          if (r < tile_rows) {
            int8_t* o = out.tiles.data() + ((r / 16 * (K / 32) + b) * 3 * 16 + r % 16) * 32 + 16 * h;
            for (int l = 0; l < 3; ++l) std::memcpy(o + l * 512, q + l * K, 16);
          }
          out.sums[r * (K / 16) + k / 16] = s * (float)_mm512_reduce_add_epi32(X);
          const __m512i x[3] = {x1, x2, x3};
          for (int l = 0; level_sums && l < 3; ++l) level_sums[l * (K / 32)] += _mm512_reduce_add_epi32(x[l]);
        }
      }
  });
  return out;
}

// y[r, 16 t + i] for tiles t0..t1 and rows r0 .. r0 + R - 1 of the rounded input (R <= 16)
template <class T, int R>
__attribute__((noinline)) void matmul_tiles_dot(const RoundedX& x, int64_t r0, const uint8_t* w, int64_t t0,
                                                int64_t t1, float* y, int64_t ldy) {
  constexpr int QK = T::Gguf::QK;
  constexpr int64_t TB = 16 * T::Gguf::BYTES;
  const int64_t K = x.K, nb = K / QK, tile_bytes = nb * TB + (has_row_scale<T>() ? 64 : 0);  // + the rows' scales
  const int8_t* levels = x.levels.data() + r0 * 3 * K;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * tile_bytes;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = tile + b * TB;
      // blocks read in order: prefetched on Intel only (PREFETCH_TILES); on Zen 4 the hardware's streams alone read
      // Gemma 3's 178 MB Q8_0 lm_head at 21 (1 thread) / 29-31 GB/s (2), prefetching 1-32 kB ahead at 16-19 / 21-27.
      // Q6_K's blocks two ahead into L2: Gemma 3's Q6_K down products in a decode step 1.8-2x faster (Zen 4;
      // 4-16 kB ahead alike), the step 1.05-1.09x; the same for Q4_K, Q4_1, Q5_0: no gain
      if constexpr (requires { T::PREFETCH; }) {
        for (int64_t l = 0; l < TB; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * TB + l), _MM_HINT_T1);
      } else if (PREFETCH_TILES) {
        for (int64_t l = 0; l < TB; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + TILE_PREFETCH + l), _MM_HINT_T1);
      }
      T::template dot_groups<R>(blk, [&](auto n, int k0, const __m512i* u, __m512 d, __m512 m) {
        constexpr int N = decltype(n)::value;
        const int64_t k = b * QK + k0;
        for (int r = 0; r < R; ++r) {
          const int8_t* q = levels + r * 3 * K + k;
          // two chains per level, each its own variable (an array of them kept dead copies on the stack)
          __m512i d00 = _mm512_setzero_si512(), d01 = d00, d10 = d00, d11 = d00, d20 = d00, d21 = d00;
#pragma GCC unroll 8
          for (int j = 0; j < N; ++j) {
            dpbusd_broadcast(j % 2 ? d01 : d00, u[j], q + 4 * j);
            dpbusd_broadcast(j % 2 ? d11 : d10, u[j], q + K + 4 * j);
            dpbusd_broadcast(j % 2 ? d21 : d20, u[j], q + 2 * K + 4 * j);
          }
          const __m512i dot[3] = {_mm512_add_epi32(d00, d01), _mm512_add_epi32(d10, d11), _mm512_add_epi32(d20, d21)};
          acc[r] = add_group<T, N, true>(acc[r], dot, d, m, x, r0 + r, k);
        }
      });
    }
    if constexpr (has_row_scale<T>())
      for (int r = 0; r < R; ++r) acc[r] = _mm512_mul_ps(acc[r], _mm512_loadu_ps(tile + nb * TB));
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy + 16 * t, acc[r]);
  }
}
#endif

// the row length of group_sums: K / GROUP rounded up to 16 (matmul_rows reads 16 groups at a time)
template <class T>
int64_t group_sums_ld(int64_t K) { return (K / T::GROUP + 15) / 16 * 16; }

// rows n0..n1 of one weight, every row of x (in runs of at most 8)
template <class T>
// (parts: x's first split_rows rows in three bfloat16 parts, where BF16 weights take tdpbf16ps; else none)
void matmul_range(const float* x, int64_t ldx, int64_t R, const float* xsum, const RoundedX& rx,
                  const Written<uint16_t>& parts, int64_t split_rows, const uint8_t* w, int64_t row_bytes,
                  int64_t n0, int64_t n1, int64_t K, float* y, int64_t ldy) {
  const int64_t xld = group_sums_ld<T>(K);
#if defined(KVGEN_DOTS)
  if constexpr (has_dot<T>()) {  // the tiles whose first row lies in n0..n1, 16 rows of x at a time while there
    // are as many, else 1-8 (each unpacked block serves twice the rows of 8: 512-row products 3-14% faster on Zen
    // 4; 24 or 32 rows no faster); AVX2: 1-4 (16 registers)
    // over runs of tiles of ~256 kB, so that many rows (a prefill) read each run from L2, not memory
    // (with AMX: all but the last R % 16 rows in tiles of 16 by 16)
#if defined(KVGEN_DOT2)
    if constexpr (std::is_same_v<T, Q4_Kx16>)
      if (R > 0 && rx.x16.R == R) return matmul_q4k_i16(rx.x16, w, (n0 + 15) / 16, (n1 + 15) / 16, y, ldy);
    if (R >= panel_rows_of<T>())
      return matmul_tiles_panel<T>(x, ldx, R, w, (n0 + 15) / 16, (n1 + 15) / 16, K, y, ldy);
#endif
    int64_t tile_unit_rows = 0;
#if defined(KVGEN_AMX)
    if constexpr (takes_tile_unit<T>())
      if ((tile_unit_rows = amx_rows(R)) > 0)
        matmul_tiles_amx<T>(rx, 0, tile_unit_rows, w, (n0 + 15) / 16, (n1 + 15) / 16, y, ldy);
#endif
    const int64_t run = std::max<int64_t>(1, (256 << 10) / (K / T::Gguf::QK * 16 * T::Gguf::BYTES));
    for (int64_t t0 = (n0 + 15) / 16, t1 = (n1 + 15) / 16; t0 < t1; t0 += run)
      for (int64_t r = tile_unit_rows, t = std::min(t0 + run, t1), rows; r < R; r += rows) {
        float* yr = y + r * ldy;
#if defined(KVGEN_DOT8)
        rows = R - r >= 16 ? 16 : std::min<int64_t>(8, R - r);
#else
        rows = std::min<int64_t>(4, R - r);
#endif
        switch (rows) {
          case 1: matmul_tiles_dot<T, 1>(rx, r, w, t0, t, yr, ldy); break;
          case 2: matmul_tiles_dot<T, 2>(rx, r, w, t0, t, yr, ldy); break;
          case 3: matmul_tiles_dot<T, 3>(rx, r, w, t0, t, yr, ldy); break;
#if defined(KVGEN_DOT8)
          case 4: matmul_tiles_dot<T, 4>(rx, r, w, t0, t, yr, ldy); break;
          case 5: matmul_tiles_dot<T, 5>(rx, r, w, t0, t, yr, ldy); break;
          case 6: matmul_tiles_dot<T, 6>(rx, r, w, t0, t, yr, ldy); break;
          case 7: matmul_tiles_dot<T, 7>(rx, r, w, t0, t, yr, ldy); break;
          case 8: matmul_tiles_dot<T, 8>(rx, r, w, t0, t, yr, ldy); break;
          default: matmul_tiles_dot<T, 16>(rx, r, w, t0, t, yr, ldy); break;
#else
          default: matmul_tiles_dot<T, 4>(rx, r, w, t0, t, yr, ldy); break;
#endif
        }
      }
    return;
  } else  // (kvgen's int8 and int4 tiles have no float32 path: the tiled branch below is not compiled for them)
#endif
  if constexpr (tiled<T>()) {  // the tiles whose first row lies in n0..n1, in runs of RT rows of x
#if defined(__AVX512F__)
    constexpr int RT = 8;
#else
    constexpr int RT = 2;  // 16 registers: accumulators for more rows would spill
#endif
    const int64_t t0 = (n0 + 15) / 16, t1 = (n1 + 15) / 16;
    for (int64_t r = 0; r < R; r += RT) {
      const float *xr = x + r * ldx, *xs = xsum + r * xld;
      float* yr = y + r * ldy;
      switch (std::min<int64_t>(RT, R - r)) {
        case 1: matmul_tiles<T, 1>(xr, ldx, xs, xld, w, t0, t1, K, yr, ldy); break;
        case 2: matmul_tiles<T, 2>(xr, ldx, xs, xld, w, t0, t1, K, yr, ldy); break;
#if defined(__AVX512F__)
        case 3: matmul_tiles<T, 3>(xr, ldx, xs, xld, w, t0, t1, K, yr, ldy); break;
        case 4: matmul_tiles<T, 4>(xr, ldx, xs, xld, w, t0, t1, K, yr, ldy); break;
        case 5: matmul_tiles<T, 5>(xr, ldx, xs, xld, w, t0, t1, K, yr, ldy); break;
        case 6: matmul_tiles<T, 6>(xr, ldx, xs, xld, w, t0, t1, K, yr, ldy); break;
        case 7: matmul_tiles<T, 7>(xr, ldx, xs, xld, w, t0, t1, K, yr, ldy); break;
        default: matmul_tiles<T, 8>(xr, ldx, xs, xld, w, t0, t1, K, yr, ldy); break;
#endif
      }
    }
  } else {
    int64_t r = 0;
#if defined(KVGEN_AMX_BF16)
    if constexpr (std::is_same_v<T, BF16>)
      if (split_rows > 0)
        matmul_bf16_amx(parts.data(), r = split_rows, w, row_bytes, (n0 + 15) / 16, (n1 + 15) / 16, K, y, ldy);
#endif
    for (; r < R; r += 8) {
      const float* xr = x + r * ldx;
      const float* xs = xsum + r * xld;
      float* yr = y + r * ldy;
      switch (std::min<int64_t>(8, R - r)) {
        case 1: matmul_rows<T, 1>(xr, ldx, xs, xld, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 2: matmul_rows<T, 2>(xr, ldx, xs, xld, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 3: matmul_rows<T, 3>(xr, ldx, xs, xld, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 4: matmul_rows<T, 4>(xr, ldx, xs, xld, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 5: matmul_rows<T, 5>(xr, ldx, xs, xld, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 6: matmul_rows<T, 6>(xr, ldx, xs, xld, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 7: matmul_rows<T, 7>(xr, ldx, xs, xld, w, row_bytes, n0, n1, K, yr, ldy); break;
        default: matmul_rows<T, 8>(xr, ldx, xs, xld, w, row_bytes, n0, n1, K, yr, ldy); break;
      }
    }
  }
}

// x's sum over each group of values: (R, group_sums_ld) with zeros past K / GROUP, for formats with a min
template <class T>
std::vector<float> group_sums(const float* x, int64_t ldx, int64_t R, int64_t K) {
  const int64_t ngroups = K / T::GROUP, xld = group_sums_ld<T>(K);
  std::vector<float> xsum(T::HAS_MIN ? R * xld : 0, 0.0f);
  if constexpr (T::HAS_MIN)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < ngroups; ++g) {
        float s = 0.0f;
        for (int j = 0; j < T::GROUP; ++j) s += x[r * ldx + g * T::GROUP + j];
        xsum[r * xld + g] = s;
      }
  return xsum;
}

}  // namespace

Product make_product(std::vector<Product::Segment> segments, int64_t K) {
  Product p;
  p.K = K;
  for (Product::Segment& seg : segments) {
    dispatch(seg.format, [&](auto t) {
      using T = decltype(t);
      p.rounded |= has_dot<T>();
      p.biased |= requires { T::BIAS; };
    });
    seg.start = p.N;
    p.N += seg.rows;
  }
  p.segments = std::move(segments);
  const auto bf16 = [](const Product::Segment& seg) { return seg.format == 30; };
  p.split = std::any_of(p.segments.begin(), p.segments.end(), bf16) &&
             std::all_of(p.segments.begin(), p.segments.end(),
                         [&](const Product::Segment& seg) { return !bf16(seg) || seg.rows % 16 == 0; });
  return p;
}

// KVGEN_PREFILL_INPUTS, read at each product (kvgen.kernels checks its value when it loads the kernels)
bool prefill_inputs_16bit() {
#if defined(KVGEN_DOT2)
  const char* v = std::getenv("KVGEN_PREFILL_INPUTS");
  return v == nullptr || *v == 0 || std::strcmp(v, "int16") == 0;
#else
  return false;
#endif
}

ProductInput product_input(const Product& p, const float* xp, int64_t ldx, int64_t R, bool prompt) {
  ProductInput in{xp, ldx, R, std::vector<std::vector<float>>(p.segments.size()), {}};
  for (size_t i = 0; i < p.segments.size(); ++i)
    dispatch(p.segments[i].format, [&](auto t) {
      using T = decltype(t);
      if constexpr (!has_dot<T>()) in.xsums[i] = group_sums<T>(xp, ldx, R, p.K);
    });
#if defined(KVGEN_DOTS)
  bool sums = true;  // whether a segment takes the integer sums, on x's rows rounded
#if defined(KVGEN_DOT2)
  sums = false;  // (AVX2's float32 panels take x as it is)
  for (const auto& seg : p.segments)
    dispatch(seg.format, [&](auto t) {
      if constexpr (has_dot<decltype(t)>()) sums = sums || R < panel_rows_of<decltype(t)>();
    });
#endif
  if (p.rounded && sums) in.rx = round_x(xp, ldx, R, p.K, p.biased, amx_rows(R));
#endif
#if defined(KVGEN_DOT2)
  // (whatever their count: a prompt's rows take the same numerics however it is split into chunks)
  if (prompt && prefill_inputs_16bit() &&
      std::any_of(p.segments.begin(), p.segments.end(), [](const auto& seg) { return seg.format == 2012; }))
    in.rx.x16 = round_x16(xp, ldx, R, p.K);
#endif
#if defined(KVGEN_AMX_BF16)
  if (p.split && (in.split_rows = amx_rows(R)) > 0) in.parts = split_bf16(xp, ldx, in.split_rows, p.K);
#endif
  return in;
}

// output rows n0..n1 of y (R, N), each segment's rows read where they are stored
void product_rows(const Product& p, const ProductInput& in, int64_t n0, int64_t n1, float* yp) {
  for (size_t i = 0; i < p.segments.size(); ++i) {
    const Product::Segment& seg = p.segments[i];
    const int64_t lo = std::max(n0, seg.start), hi = std::min(n1, seg.start + seg.rows);
    if (lo >= hi) continue;
    dispatch(seg.format, [&](auto t) {
      using T = decltype(t);
      matmul_range<T>(in.x, in.ldx, in.R, in.xsums[i].data(), in.rx, in.parts, in.split_rows, seg.w, seg.row_bytes,
                      lo - seg.start, hi - seg.start, p.K, yp + seg.start, p.N);
    });
  }
}

// output rows per parallel task: enough that a task streams a few kB of weights
int64_t product_grain(const Product& p) { return std::max<int64_t>(1, 16384 / p.segments[0].row_bytes); }

int64_t product_piece(const Product& p, int64_t threads) {
  return std::max(product_grain(p), (p.N + 8 * threads - 1) / (8 * threads) + 15) / 16 * 16;
}

// y (R, N) = x (R, K, rows ldx apart) times the product's weight, output rows in parallel, split evenly in advance.
// Pieces claimed in turn, as the decode stack's products take them, measured and not taken: Qwen2.5-1.5B's Q6_K output
// head and ffn_down alone 1.13x / 1.10x at 2 threads on a busy 2-core Zen 3 VM (`kernels_ab.py`), but whole decode
// steps and prefills 0.98-1.01x in one process when it was quiet (SmolLM2, Coder-0.5B, Qwen2.5-1.5B)
void product_into(const Product& p, const float* xp, int64_t ldx, int64_t R, float* yp, bool prompt) {
  const ProductInput in = product_input(p, xp, ldx, R, prompt);
  parallel_for(0, p.N, product_grain(p), [&](int64_t n0, int64_t n1) { product_rows(p, in, n0, n1, yp); });
}

std::vector<int64_t> integer_dot_formats() {
#if defined(KVGEN_DOT8)
  return {2002, 2003, 2006, 2008, 2012, 2014, 3008, 3032, 3064, 3128};
#elif defined(KVGEN_DOT2)
  return {2002, 2003, 2006, 2008, 2012, 2014};
#else
  return {};
#endif
}

std::string integer_dot_instruction() {
#if defined(KVGEN_DOT8)
  return "vpdpbusd";
#elif defined(KVGEN_DOT2)
  return "vpmaddubsw";
#else
  return "";
#endif
}

int64_t panel_rows(int64_t format) {
#if defined(KVGEN_DOT2)
  int64_t rows = PANEL_ROWS;
  if (format != 0)
    dispatch(format, [&](auto t) {
      if constexpr (has_dot<decltype(t)>()) rows = panel_rows_of<decltype(t)>();
    });
  return rows;
#else
  return 0;
#endif
}

std::vector<int64_t> tile_formats() {
  std::vector<int64_t> formats;
#if defined(KVGEN_AMX)
  if (amx_permitted())
    for (int64_t format : integer_dot_formats())
      dispatch(format, [&](auto t) {
        if constexpr (takes_tile_unit<decltype(t)>()) formats.push_back(format);
      });
#endif
#if defined(KVGEN_AMX_BF16)
  if (amx_permitted()) formats.push_back(30);
#endif
  return formats;
}

}  // namespace kvgen
