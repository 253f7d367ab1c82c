// The integer dot products where AVX2 runs without AVX-512 VNNI (KVGEN_DOT2): the input rows rounded to three int8
// levels as for vpdpbusd (dot.h), the tiles' groups in Quads 16 values at a time (tiles2.h), and vpmaddubsw in place
// of vpdpbusd: 2 products of a stored value (at most 6 bits, unsigned) with a level a 16-bit lane, summed in int16
// while they fit, then in int32 by vpmaddwd, which also weighs the levels (2^14, 2^7, 1). The same exact sums as
// vpdpbusd's. Against the float32 products of the same tiles (dot.cpp's matmul_tiles; AMD EPYC Zen 3, Qwen2.5's
// layers, one process alternating): Q4_K 1.0-1.3x, Q6_K 1.2-1.6x and Q5_0 1.3-1.4x at 1 row, 1.1-1.6x at 4; at 2 rows
// Q4_K 0.82-0.95x (its registers spill), Q5_0 1.3-1.5x. (Parts of 16 values of 8 rows at a time, 4 registers of u,
// ran 0.7-1.0x these.) One input row (a decode step) of Q4_K takes a loop of its own, a group at a time (rows2.h's
// matmul_q4k_row), and so does each input row of Q6_K (matmul_q6k_row); Q8_0's signed bytes one of their own for any
// rows (matmul_q8_0).
// Included by dot.cpp.
#pragma once

#include <algorithm>
#include <type_traits>

#include "dot.h"
#include "parallel.h"
#include "rows2.h"
#include "tiles2.h"

namespace kvgen {

#if defined(KVGEN_DOT2)
inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// 16 int32 lanes (each in -128..127) as 16 bytes, each 4 in the order 0, 2, 1, 3 (Quads' order)
inline __m128i quad_bytes(__m256i a, __m256i b) {
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // a's 8, then b's 8
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  return _mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15));
}

// dot.h's RoundedX of R rows (the AVX-512 round_x's numbers; no level sums or tiles: nothing biased, no tile unit)
inline RoundedX round_x(const float* x, int64_t ldx, int64_t R, int64_t K, bool, int64_t) {
  RoundedX out{K, Written<int8_t>(R * 3 * K), Written<float>(R * (K / 32)), Written<float>(R * (K / 16)), {},
               Written<int8_t>(0)};
  const __m256i c64 = _mm256_set1_epi32(64), c127 = _mm256_set1_epi32(127);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < K / 32; ++b) {
        const float* xb = x + r * ldx + 32 * b;
        __m256 v[4], top = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i] = _mm256_loadu_ps(xb + 8 * i)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        const float s = amax / XQ_MAX, inv = amax > 0.0f ? XQ_MAX / amax : 0.0f;
        out.scales[r * (K / 32) + b] = s;
        for (int h = 0; h < 2; ++h) {  // 16 values
          __m256i level[3][2], X[2];
          for (int i = 0; i < 2; ++i) {
            X[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h + i], _mm256_set1_ps(inv)));  // |X| <= XQ_MAX
            const __m256i x3 = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(X[i], c64), c127), c64);  // -64..63
            const __m256i y = _mm256_srai_epi32(_mm256_sub_epi32(X[i], x3), 7);
            const __m256i x2 = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(y, c64), c127), c64);
            level[0][i] = _mm256_srai_epi32(_mm256_sub_epi32(y, x2), 7);  // -127..127
            level[1][i] = x2;
            level[2][i] = x3;
          }
          const int64_t k = 32 * b + 16 * h;
          for (int l = 0; l < 3; ++l)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out.levels.data() + (r * 3 + l) * K + k),
                             quad_bytes(level[l][0], level[l][1]));
          out.sums[r * (K / 16) + k / 16] = s * (float)hsum(_mm256_add_epi32(X[0], X[1]));
        }
      }
  });
  return out;
}

// acc (Quads' order of rows) plus one input row's share of a group of G values from k on: tiles.h's add_group
// (d * s * sum(u * X) + m * sum(x~), from the exact sum(u * X) of each half of the rows, rounded once)
template <int G>
inline void add_group(Lanes& acc, const __m256i (&dot)[2], const Lanes& d, const Lanes& m, const RoundedX& x,
                      int64_t r, int64_t k) {
  const int64_t K = x.K;
  const __m256 s = _mm256_set1_ps(x.scales[r * (K / 32) + k / 32]);
  float xs = x.sums[r * (K / 16) + k / 16];
  if constexpr (G == 32) xs += x.sums[r * (K / 16) + k / 16 + 1];
  for (int i = 0; i < 2; ++i) {
    acc.h[i] = _mm256_fmadd_ps(_mm256_mul_ps(d.h[i], s), _mm256_cvtepi32_ps(dot[i]), acc.h[i]);
    acc.h[i] = _mm256_fmadd_ps(m.h[i], _mm256_set1_ps(xs), acc.h[i]);
  }
}

// y[r, 16 t + i] for Q8_0 tiles t0..t1 and rows r0 .. r0 + R - 1 of the rounded input. Its values are signed bytes
// and vpmaddubsw multiplies unsigned ones by signed: each quad takes |w| (vpabsb) by the level with w's sign (vpsignb:
// |w| * sign(w) x = w x, 0 where w = 0). 2 * 128 * 127 fills a 16-bit lane, so each quad's products go to int32
// (vpmaddwd) at once: level 0's in one sum, levels 1 and 2's weighed 2^7 and 1 in another (at most 32 * 128 * 64 *
// 129 over a block: no overflow), the block's sum(w * X) = 2^14 level 0 + the other, in float32 (2^14 * 32 * 128 *
// 127 leaves int32: as AVX-512's biased Q8_0 sums). The rows one after the other over each block (16 registers:
// the block's 8 quads re-read from L1 for each); the float32 row product it replaces ran at 5 Gw/s on one thread
// (Qwen2.5-0.5B's 145 MB Q8_0 output head, AMD EPYC Zen 3)
template <int R>
__attribute__((noinline)) void matmul_q8_0(const RoundedX& x, int64_t r0, const uint8_t* w, int64_t t0, int64_t t1,
                                           float* y, int64_t ldy) {
  constexpr int64_t TB = 16 * Q8_0::BYTES;
  const int64_t K = x.K, nb = K / Q8_0::QK;
  const int8_t* levels = x.levels.data() + r0 * 3 * K;
  const __m256i ones = _mm256_set1_epi16(1), l1 = _mm256_set1_epi16(1 << 7);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * nb * TB;
    Lanes acc[R];
    for (int r = 0; r < R; ++r) acc[r].h[0] = acc[r].h[1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = tile + b * TB;
      __builtin_prefetch(blk + TB);  // the next block's d, its quads as this block's are read
      const Lanes d = f16_quads(blk);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = levels + r * 3 * K + b * Q8_0::QK;
        __m256i high[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, low[2] = {high[0], high[1]};
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
          if (r == 0) __builtin_prefetch(blk + TB + 32 + 64 * q);
          const Quads v = load_quads(blk + 32 + 64 * q);
          const __m256i a[2] = {_mm256_abs_epi8(v.h[0]), _mm256_abs_epi8(v.h[1])};
#pragma GCC unroll 3
          for (int l = 0; l < 3; ++l) {
            int32_t quad;
            std::memcpy(&quad, xq + l * K + 4 * q, 4);
            const __m256i xb = _mm256_set1_epi32(quad);
            for (int i = 0; i < 2; ++i) {
              const __m256i p = _mm256_maddubs_epi16(a[i], _mm256_sign_epi8(xb, v.h[i]));
              if (l == 0) high[i] = _mm256_add_epi32(high[i], _mm256_madd_epi16(p, ones));
              else low[i] = _mm256_add_epi32(low[i], _mm256_madd_epi16(p, l == 1 ? l1 : ones));
            }
          }
        }
        const __m256 s = _mm256_set1_ps(x.scales[(r0 + r) * (K / 32) + b]);
        for (int i = 0; i < 2; ++i) {
          const __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high[i]), _mm256_set1_ps(16384.0f),
                                             _mm256_cvtepi32_ps(low[i]));
          acc[r].h[i] = _mm256_fmadd_ps(_mm256_mul_ps(d.h[i], s), sum, acc[r].h[i]);
        }
      }
    }
    for (int r = 0; r < R; ++r) store_rows(y + r * ldy + 16 * t, acc[r]);
  }
}

// y[r, 16 t + i] for tiles t0..t1 and rows r0 .. r0 + R - 1 of the rounded input
template <class T, int R>
  requires(!std::is_same_v<T, Q8_0x16> && !std::is_same_v<T, Q6_Kx16>)
__attribute__((noinline)) void matmul_tiles_dot(const RoundedX& x, int64_t r0, const uint8_t* w, int64_t t0,
                                                int64_t t1, float* y, int64_t ldy) {
  constexpr int QK = T::Gguf::QK, PARTS = T::GROUP / 16;
  constexpr int64_t TB = 16 * T::Gguf::BYTES;
  // vpmaddubsw's 16-bit lanes: 2 u * X of at most CODE_MAX * 127 each; SUMS of them fit in int16 (Q4: 8)
  constexpr int SUMS = std::min(4, 32767 / (2 * T::CODE_MAX * 127));
  constexpr int16_t LEVEL[3] = {1 << 14, 1 << 7, 1};  // the levels' weights in X
  const int64_t K = x.K, nb = K / QK;
  if constexpr (R == 1 && std::is_same_v<T, Q4_Kx16>) return matmul_q4k_row(x, r0, w, t0, t1, y);
  const int8_t* levels = x.levels.data() + r0 * 3 * K;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * nb * TB;
    Lanes acc[R];
    for (int r = 0; r < R; ++r) acc[r].h[0] = acc[r].h[1] = _mm256_setzero_ps();
    __m256i open[2][R][2];  // sum(u * X) of the groups open (slots), each half of the rows: exact in int32 (dot.h)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = tile + b * TB;
      for (int64_t l = 0; l < TB; l += 64) __builtin_prefetch(blk + 4096 + l);
      T::template dot_groups<R>(blk, [&](auto slot, auto part, int k0, const Quads* u, const Lanes& d, const Lanes& m) {
        constexpr int S = decltype(slot)::value, P = decltype(part)::value;
        const int64_t k = b * QK + k0;
        for (int r = 0; r < R; ++r) {
          const int8_t* q = levels + r * 3 * K + k;
          __m256i sum[2];  // each half of the rows
          for (int i = 0; i < 2; ++i) sum[i] = P == 0 ? _mm256_setzero_si256() : open[S][r][i];
#pragma GCC unroll 3
          for (int l = 0; l < 3; ++l)
#pragma GCC unroll 4
            for (int j0 = 0; j0 < 4; j0 += SUMS) {
              __m256i part16[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 4
              for (int j = j0; j < j0 + SUMS; ++j) {  // each broadcast for both halves: none held for later
                int32_t quad;
                std::memcpy(&quad, q + l * K + 4 * j, 4);
                const __m256i xq = _mm256_set1_epi32(quad);
                for (int i = 0; i < 2; ++i)
                  part16[i] = _mm256_add_epi16(part16[i], _mm256_maddubs_epi16(u[j].h[i], xq));
              }
              for (int i = 0; i < 2; ++i)
                sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(part16[i], _mm256_set1_epi16(LEVEL[l])));
            }
          for (int i = 0; i < 2; ++i) open[S][r][i] = sum[i];
          if constexpr (P == PARTS - 1) add_group<T::GROUP>(acc[r], open[S][r], d, m, x, r0 + r, k - 16 * P);
        }
      });
    }
    for (int r = 0; r < R; ++r) store_rows(y + r * ldy + 16 * t, acc[r]);
  }
}

// the same for Q8_0's tiles
template <class T, int R>
  requires std::is_same_v<T, Q8_0x16>
void matmul_tiles_dot(const RoundedX& x, int64_t r0, const uint8_t* w, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  matmul_q8_0<R>(x, r0, w, t0, t1, y, ldy);
}

// the same for Q6_K's tiles: the one-row assembly for each row, over the caller's run of tiles (from L2 after the
// first row). At 2 rows it ran 1.12-1.37x the intrinsics above, at 3-4 rows 1.01-1.08x (Qwen2.5-1.5B's output head
// and ffn_down from memory, 1 / 2 threads, AMD EPYC Zen 3, kernels_ab.py); Q4_K's did not differ from them
// (0.87-1.11x, the noise), nor did Q4_1's and Q5_0's (0.66-0.95x, their intrinsics for one row)
template <class T, int R>
  requires std::is_same_v<T, Q6_Kx16>
void matmul_tiles_dot(const RoundedX& x, int64_t r0, const uint8_t* w, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) matmul_q6k_row(x, r0 + r, w, t0, t1, y + r * ldy);
}
#endif

}  // namespace kvgen
