// Float32 products of AVX2's integer tiles (KVGEN_DOT2) for many input rows: each tile's blocks dequantized once into
// a float32 panel in L1 (d * u + m, 16 rows a column), then multiplied by every input row in register blocks of 6 rows
// by the 16 weight rows (12 accumulators, one broadcast input value and two panel loads per 12 FMAs). On Zen 3 the
// FMA, vpmaddubsw and vpmaddwd share two pipes, so the three int8 levels of the exact integer sums (dot2.h) cost more
// per input row than float32 multiply-adds once a tile's decoding is shared by enough rows. The values are
// dequantize + float32 matmul's (the prefill's) up to rounding order. Included by dot.cpp.
#pragma once

#include <algorithm>
#include <type_traits>

#include "dot.h"
#include "tiles2.h"

namespace kvgen {

#if defined(KVGEN_DOT2)
// input rows from which every tile format's products take float32 panels instead of the integer sums (AMD EPYC
// Zen 3, every layer's copy, 1 / 2 threads, at 10 rows: SmolLM2's Q4_1 1.08-1.19x, its Q8_0 1.35x, Qwen2.5's Q5_0
// 1.16-1.20x, Q6_K 1.40x, Q4_K 1.23-1.29x; at 8 rows SmolLM2's Q4_1 0.78-0.89x)
constexpr int64_t PANEL_ROWS = 10;
// ... and where a format's take them from fewer: Q6_K and Q8_0 from 5 rows (their integer sums cost the most
// instructions a value), Q4_K from 8. At 5-9 rows, panels over integer sums (`kernels_ab`-style, in turn in one
// process, Zen 3, 1 / 2 threads): Q8_0 (SmolLM2's output head) 1.21-1.48x, Q6_K and Q4_K layers (Qwen2.5's
// ffn_down, attn_v) 1.09-1.51x; Q4_K alone 0.80-1.22x at 5-7 rows, 1.01-1.22x at 8-9; Q4_1 and Q5_0 0.84-1.25x
template <class T>
constexpr int64_t panel_rows_of() {
  if constexpr (std::is_same_v<T, Q6_Kx16> || std::is_same_v<T, Q8_0x16>) return 5;
  if constexpr (std::is_same_v<T, Q4_Kx16>) return 8;
  return PANEL_ROWS;
}
// columns of a panel: 256 x 16 float32 (16 kB) stay in L1 beside the input rows' share
constexpr int64_t PANEL_COLUMNS = 256;

// the 16 rows' values of Quads u (each row's bytes values 0, 2, 1, 3 of 4), worth d * u + m, into columns k0 + 4 j +
// (0, 2, 1, 3) of the panel (16 floats a column, rows in Quads' order); SIGNED: u's bytes are int8 (Q8_0)
template <bool SIGNED>
inline void panel_quads(const Quads* u, int quads, const Lanes& d, const Lanes& m, float* panel) {
  constexpr int COLUMN[4] = {0, 2, 1, 3};
  const __m256i low = _mm256_set1_epi32(0xFF);
  for (int j = 0; j < quads; ++j)
    for (int i = 0; i < 2; ++i)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const __m256i v = u[j].h[i];
        const __m256i q = SIGNED ? _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * b), 24)
                          : b == 3 ? _mm256_srli_epi32(v, 24)
                                   : _mm256_and_si256(b ? _mm256_srli_epi32(v, 8 * b) : v, low);
        const __m256 w = _mm256_fmadd_ps(d.h[i], _mm256_cvtepi32_ps(q), m.h[i]);
        _mm256_store_ps(panel + 16 * (4 * j + COLUMN[b]) + 8 * i, w);
      }
}

// a tile block's QK columns, dequantized, at panel
template <class T>
inline void panel_block(const uint8_t* blk, float* panel) {
  if constexpr (std::is_same_v<T, Q8_0x16>) {  // head: the 16 rows' d; runs 2..33: value j - 2, signed
    const Lanes d = f16_quads(blk), zero{{_mm256_setzero_ps(), _mm256_setzero_ps()}};
    Quads u[8];
    for (int j = 0; j < 8; ++j) u[j] = load_quads(blk + 32 + 64 * j);
    panel_quads<true>(u, 8, d, zero, panel);
  } else {
    T::template dot_groups<1>(blk, [&](auto, auto, int k0, const Quads* u, const Lanes& d, const Lanes& m) {
      panel_quads<false>(u, 4, d, m, panel + 16 * k0);
    });
  }
}

// acc (RB rows of 16 lanes, Quads' order of rows, one after the other) plus RB input rows (ldx apart) times the
// panel's kc columns. Not inlined, and acc always loaded: inlined into the tile loop, or with its first columns' sums
// started at zero by a select, GCC kept two of the 12 accumulators on the stack in the Q4_1 and Q6_K loops (a store
// and reload each step: those formats ran at half the others' speed, AMD EPYC Zen 3)
template <int RB>
__attribute__((noinline)) void panel_product(const float* panel, int64_t kc, const float* x, int64_t ldx, float* acc) {
  __m256 a[RB][2];
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r) {
    a[r][0] = _mm256_load_ps(acc + 16 * r);
    a[r][1] = _mm256_load_ps(acc + 16 * r + 8);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + 16 * k), w1 = _mm256_load_ps(panel + 16 * k + 8);
#pragma GCC unroll 6
    for (int r = 0; r < RB; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      a[r][0] = _mm256_fmadd_ps(w0, xb, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w1, xb, a[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r) {
    _mm256_store_ps(acc + 16 * r, a[r][0]);
    _mm256_store_ps(acc + 16 * r + 8, a[r][1]);
  }
}

// input rows a pass: each tile's panels are decoded once a pass and its sums stay in L1 (16 kB)
constexpr int64_t PASS_ROWS = 256;

// y[r, 16 t + i] for tiles t0..t1 of a tiled weight and all R rows of x. Per pass of up to PASS_ROWS rows, per tile,
// per PANEL_COLUMNS columns: the tile's columns dequantized into the panel, then multiplied by the pass's rows in
// blocks of 6. (Tiles outer, the weights read in order: over Qwen2.5-1.5B's ffn layers at 64-256 rows this ran
// 1.15-1.3x faster than columns outer with a group of tiles' sums in L2, AMD EPYC Zen 3; and BLIS's order, each
// column block of the pass's rows copied once into L2 for groups of 8 tiles, ran 0.95-1.05x this over Llama 3.2 1B's
// layers at 512 rows: at 43-44 GMAC/s a thread this loop is at ~88% of the 50 that the FMAs alone reach.) Each row's
// sums take the same order whatever R: a row's products are the same bits alone or among others (of at least
// PANEL_ROWS)
template <class T>
__attribute__((noinline)) void matmul_tiles_panel(const float* x, int64_t ldx, int64_t R, const uint8_t* w,
                                                  int64_t t0, int64_t t1, int64_t K, float* y, int64_t ldy) {
  constexpr int64_t QK = T::Gguf::QK, TB = 16 * T::Gguf::BYTES, BLOCKS = std::max<int64_t>(1, PANEL_COLUMNS / QK);
  const int64_t nb = K / QK;
  alignas(32) float panel[16 * BLOCKS * QK], acc[16 * PASS_ROWS];  // acc (rows, 16): a tile's sums
  for (int64_t r0 = 0; r0 < R; r0 += PASS_ROWS) {
    const int64_t rows = std::min(PASS_ROWS, R - r0);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc, acc + 16 * rows, 0.0f);
      for (int64_t b0 = 0; b0 < nb; b0 += BLOCKS) {
        const int64_t blocks = std::min(BLOCKS, nb - b0), kc = blocks * QK;
        const uint8_t* tile = w + t * nb * TB + b0 * TB;
        for (int64_t l = 0; l < blocks * TB; l += 64) __builtin_prefetch(tile + nb * TB + l);  // the next tile's
        for (int64_t b = 0; b < blocks; ++b) panel_block<T>(tile + b * TB, panel + 16 * QK * b);
        for (int64_t r = 0, rb; r < rows; r += rb) {
          // blocks of 6 rows, then the rest (7 rows as 6 + 1 and 8 as 6 + 2 ran 1.0-1.15x 4 + 3 and 4 + 4)
          rb = std::min<int64_t>(6, rows - r);
          const float* xr = x + (r0 + r) * ldx + b0 * QK;
          switch (rb) {
            case 1: panel_product<1>(panel, kc, xr, ldx, acc + 16 * r); break;
            case 2: panel_product<2>(panel, kc, xr, ldx, acc + 16 * r); break;
            case 3: panel_product<3>(panel, kc, xr, ldx, acc + 16 * r); break;
            case 4: panel_product<4>(panel, kc, xr, ldx, acc + 16 * r); break;
            case 5: panel_product<5>(panel, kc, xr, ldx, acc + 16 * r); break;
            default: panel_product<6>(panel, kc, xr, ldx, acc + 16 * r); break;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        store_rows(y + (r0 + r) * ldy + 16 * t, {{_mm256_load_ps(acc + 16 * r), _mm256_load_ps(acc + 16 * r + 8)}});
    }
  }
}
#endif

}  // namespace kvgen
