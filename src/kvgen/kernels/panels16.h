// Opt-in (KVGEN_PREFILL_INPUTS=int16): AVX2's Q4_K products of PANEL_ROWS input rows or more on 16-bit inputs
// (KVGEN_DOT2). vpmaddwd multiplies 16 int16 pairs an instruction where an FMA does 8 float32 products, and Zen 3
// issues two of either a cycle. The inputs (dot.h's X16) are rounded a window of 64 values at a time to int16 on
// the scale of the window's largest value outside one column, the window's column of the largest magnitude over all
// the product's rows, which stays exact; each tile block's codes times their 6-bit group scales (at most 15 x 63 =
// 945) go into an int16 panel, and a window's int32 sums (at most 2 x 945 x 32767 a step, 32 steps: < 2^31) are
// weighed into float32 once: d times the window's scale, plus the exact column's products and the groups' mins
// times their inputs' sums (of the rounded values, whose rounding the mins' products then cancel). Each value moves
// by at most 2^-16 of its window's largest other value; a row's products depend on the product's other rows
// (through the exact columns). Logits of 512-token prefills moved by up to 7.1e-3 (Gemma 3 270M) and 7.2e-4
// (Qwen2.5-Coder-0.5B) from the dequantized float32 run; whole prefills ran 1.10-1.16x faster (AMD EPYC Zen 3,
// Llama 3.2 1B and Qwen2.5-1.5B Q4_K_M). Included by dot.cpp.
#pragma once

#include <algorithm>
#include <cmath>

#include "dot.h"
#include "parallel.h"
#include "tiles2.h"

namespace kvgen {

#if defined(KVGEN_DOT2)
constexpr int64_t WINDOW16 = 64;

// x's R rows (K values each, a multiple of 256) as dot.h's X16
inline X16 round_x16(const float* x, int64_t ldx, int64_t R, int64_t K) {
  X16 q;
  q.R = R, q.RP = (R + 5) / 6 * 6, q.K = K;
  const int64_t nw = K / WINDOW16, nb = K / 256;
  q.v = Written<int16_t>(q.RP * K), q.scale = Written<float>(q.RP * nw), q.outlier = Written<float>(q.RP * nw);
  q.sums = Written<float>(q.RP * K / 32), q.at = Written<int32_t>(nw);
  parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {  // each window's column of the largest magnitude
    for (int64_t b = b0; b < b1; ++b) {
      float top[256] = {};
      for (int64_t r = 0; r < R; ++r)
        for (int j = 0; j < 256; ++j) top[j] = std::max(top[j], std::fabs(x[r * ldx + 256 * b + j]));
      for (int w = 0; w < 4; ++w)
        q.at[4 * b + w] = int32_t(std::max_element(top + 64 * w, top + 64 * w + 64) - (top + 64 * w));
    }
  });
  parallel_for(0, q.RP, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t w = 0; w < nw; ++w) {
        int16_t* v = q.v.data() + (w / 4 * q.RP + r) * 256 + w % 4 * WINDOW16;  // (K / 256, RP, 256)
        const int64_t i = r * nw + w, at = q.at[w];
        if (r >= R) {  // a row of zeros, so that every block of rows has 6
          std::fill_n(v, WINDOW16, 0);
          q.scale[i] = q.sums[2 * i] = q.sums[2 * i + 1] = q.outlier[i] = 0.0f;
          continue;
        }
        const float* xw = x + r * ldx + w * WINDOW16;
        bool finite = true;
        float top = 0.0f;
        for (int j = 0; j < WINDOW16; ++j) {
          finite = finite && std::isfinite(xw[j]);
          if (j != at) top = std::max(top, std::fabs(xw[j]));
        }
        const float inv = top > 0.0f && finite ? 32767.0f / top : 0.0f;
        const float scale = finite ? top / 32767.0f : NAN;  // inf or NaN inputs give NaN products, as float32's
        for (int j = 0; j < WINDOW16; j += 16) {
          const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xw + j), _mm256_set1_ps(inv)));
          const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xw + j + 8), _mm256_set1_ps(inv)));
          const __m256i ab = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // (packs: per 128 bits)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + j), ab);
        }
        v[at] = 0;
        q.scale[i] = scale, q.outlier[i] = xw[at];
        for (int g = 0; g < 2; ++g) {  // the rounded values' sums: the mins' products then cancel their rounding
          int32_t s = 0;
          for (int j = 32 * g; j < 32 * g + 32; ++j) s += v[j];
          q.sums[2 * i + g] = float(s) * scale + (at / 32 == g ? xw[at] : 0.0f);
        }
      }
  });
  return q;
}

// the int32 sums of 6 rows by the 16 weight rows (Quads' order) over a window's 32 steps, at acc (12 registers: a
// row's rows 0-3, 8-11 then 4-7, 12-15): step s multiplies the int16 pairs at panel + 32 s (two registers, the same
// halves) by each row's pair at x + r * ld + 2 s. Assembly: with intrinsics GCC kept accumulators on the stack
// (12 accumulators, two panel registers, a broadcast and a product fill the 16), at half the speed
inline void window_sums(const int16_t* panel, const int16_t* x, int64_t ld, int32_t* acc) {
  const int64_t ldb = 2 * ld;
  const int16_t* x3 = x + 3 * ld;
  int64_t n = 32;
#define KVGEN_ROW(xa, a0, a1)                                                                                  \
  "vpbroadcastd " xa ", %%ymm12\n vpmaddwd %%ymm14, %%ymm12, %%ymm13\n vpmaddwd %%ymm15, %%ymm12, %%ymm12\n" \
  " vpaddd %%ymm13, %%ymm" #a0 ", %%ymm" #a0 "\n vpaddd %%ymm12, %%ymm" #a1 ", %%ymm" #a1 "\n"
  __asm__ volatile(
      "vpxor %%xmm0, %%xmm0, %%xmm0\n vpxor %%xmm1, %%xmm1, %%xmm1\n vpxor %%xmm2, %%xmm2, %%xmm2\n"
      "vpxor %%xmm3, %%xmm3, %%xmm3\n vpxor %%xmm4, %%xmm4, %%xmm4\n vpxor %%xmm5, %%xmm5, %%xmm5\n"
      "vpxor %%xmm6, %%xmm6, %%xmm6\n vpxor %%xmm7, %%xmm7, %%xmm7\n vpxor %%xmm8, %%xmm8, %%xmm8\n"
      "vpxor %%xmm9, %%xmm9, %%xmm9\n vpxor %%xmm10, %%xmm10, %%xmm10\n vpxor %%xmm11, %%xmm11, %%xmm11\n"
      "1:\n vmovdqa (%[p]), %%ymm14\n vmovdqa 32(%[p]), %%ymm15\n"
      KVGEN_ROW("(%[x])", 0, 1) KVGEN_ROW("(%[x],%[ld])", 2, 3) KVGEN_ROW("(%[x],%[ld],2)", 4, 5)
      KVGEN_ROW("(%[x3])", 6, 7) KVGEN_ROW("(%[x3],%[ld])", 8, 9) KVGEN_ROW("(%[x3],%[ld],2)", 10, 11)
      "add $64, %[p]\n add $4, %[x]\n add $4, %[x3]\n dec %[n]\n jnz 1b\n"
      "vmovdqu %%ymm0, (%[acc])\n vmovdqu %%ymm1, 32(%[acc])\n vmovdqu %%ymm2, 64(%[acc])\n"
      "vmovdqu %%ymm3, 96(%[acc])\n vmovdqu %%ymm4, 128(%[acc])\n vmovdqu %%ymm5, 160(%[acc])\n"
      "vmovdqu %%ymm6, 192(%[acc])\n vmovdqu %%ymm7, 224(%[acc])\n vmovdqu %%ymm8, 256(%[acc])\n"
      "vmovdqu %%ymm9, 288(%[acc])\n vmovdqu %%ymm10, 320(%[acc])\n vmovdqu %%ymm11, 352(%[acc])\n"
      : [p] "+r"(panel), [x] "+r"(x), [x3] "+r"(x3), [n] "+r"(n)
      : [ld] "r"(ldb), [acc] "r"(acc)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#undef KVGEN_ROW
}

// a Q4_K tile block's 256 values as int16 (code times group scale) at panel, in 128 steps of two int16 pairs'
// registers (rows in Quads' order), its rows' d and the 8 groups' negated mins (dmin times min)
inline void panel16_q4k(const uint8_t* blk, int16_t* panel, Lanes& d, Lanes* m) {
  d = to_quads(f16_fields(blk));
  const __m256i low = _mm256_set1_epi16(0xFF);
  Q4_Kx16::dot_groups<1>(blk, [&](auto, auto, int k0, const Quads* u, const Lanes& dg, const Lanes& mg) {
    m[k0 / 32] = mg;
    __m256i sc[2];
    for (int i = 0; i < 2; ++i) {  // the group's scale in both words of a lane: d * sc / d (any where d = 0)
      const __m256i s = _mm256_cvtps_epi32(_mm256_div_ps(dg.h[i], d.h[i]));
      sc[i] = _mm256_or_si256(s, _mm256_slli_epi32(s, 16));
    }
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 2; ++i) {  // a lane's bytes: values 0, 2, 1, 3 -> the pairs (0, 1) and (2, 3)
        const __m256i v = u[j].h[i];
        int16_t* step = panel + 16 * (k0 + 4 * j);
        const __m256i first = _mm256_mullo_epi16(_mm256_and_si256(v, low), sc[i]);
        const __m256i second = _mm256_mullo_epi16(_mm256_srli_epi16(v, 8), sc[i]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(step + 16 * i), first);
        _mm256_store_si256(reinterpret_cast<__m256i*>(step + 32 + 16 * i), second);
      }
  });
}

// acc (a row's 16 sums, Quads' order) plus window w's int32 sums (its 16 lanes at sums) weighed: d * scale * sums
// + the exact column (d times its weights) times its value + the groups' mins times their inputs' sums
inline void weigh_window(const X16& xq, int64_t row, int64_t w, const int32_t* sums, const Lanes& d, const Lanes* m,
                         const Lanes& column, float* acc) {
  const int64_t i = row * (xq.K / WINDOW16) + w;
  const __m256 scale = _mm256_set1_ps(xq.scale[i]), outlier = _mm256_set1_ps(xq.outlier[i]);
  const __m256 g0 = _mm256_set1_ps(xq.sums[2 * i]), g1 = _mm256_set1_ps(xq.sums[2 * i + 1]);
  for (int h = 0; h < 2; ++h) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + 8 * h)));
    __m256 o = _mm256_fmadd_ps(v, _mm256_mul_ps(d.h[h], scale), _mm256_load_ps(acc + 8 * h));
    o = _mm256_fmadd_ps(column.h[h], outlier, o);
    o = _mm256_fmadd_ps(m[2 * (w % 4)].h[h], g0, o);
    _mm256_store_ps(acc + 8 * h, _mm256_fmadd_ps(m[2 * (w % 4) + 1].h[h], g1, o));
  }
}

// a window's exact column: d times its int16 weights, at place at of a block's panel
inline Lanes outlier_column(const int16_t* panel, int at, const Lanes& d) {
  const int16_t* pair = panel + 32 * (at / 2);  // the step of the column's pair
  const __m128i up = _mm_cvtsi32_si128(16 - 16 * (at % 2));  // its word to the top
  Lanes c;
  for (int h = 0; h < 2; ++h) {
    const __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(pair + 16 * h));
    c.h[h] = _mm256_mul_ps(d.h[h], _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sll_epi32(p, up), 16)));
  }
  return c;
}

constexpr int64_t PASS16_ROWS = 240;  // at most a pass's rows (6 a block): their float32 sums (15 kB) stay in L1

// y[r, 16 t + i] for tiles t0..t1 of a Q4_K weight and every row of xq. Per pass of rows (as even as blocks of 6
// allow), per tile, per block of 256 values: the block's int16 panel (8 kB) and its windows' exact columns, then
// each 6 rows' 4 windows
inline void matmul_q4k_i16(const X16& xq, const uint8_t* w, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  constexpr int64_t TB = 16 * Q4_Kx16::Gguf::BYTES;
  const int64_t nb = xq.K / 256, passes = (xq.RP + PASS16_ROWS - 1) / PASS16_ROWS;
  const int64_t per_pass = (xq.RP / 6 + passes - 1) / passes * 6;
  alignas(32) int16_t panel[16 * 256];
  alignas(32) float acc[16 * PASS16_ROWS];
  alignas(32) int32_t sums[6 * 16];
  Lanes d, m[8];
  for (int64_t r0 = 0; r0 < xq.RP; r0 += per_pass) {
    const int64_t rows = std::min(per_pass, xq.RP - r0);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc, acc + 16 * rows, 0.0f);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + (t * nb + b) * TB;
        __builtin_prefetch(blk + TB);
        panel16_q4k(blk, panel, d, m);
        const int16_t* xb = xq.v.data() + (b * xq.RP + r0) * 256;  // the pass's rows' values of block b
        Lanes columns[4];
        for (int win = 0; win < 4; ++win) columns[win] = outlier_column(panel, 64 * win + xq.at[4 * b + win], d);
        for (int64_t r = 0; r < rows; r += 6)
          for (int64_t win = 0; win < 4; ++win) {
            window_sums(panel + 32 * 32 * win, xb + 256 * r + WINDOW16 * win, 256, sums);
            for (int64_t i = 0; i < 6; ++i)
              weigh_window(xq, r0 + r + i, 4 * b + win, sums + 16 * i, d, m, columns[win], acc + 16 * (r + i));
          }
      }
      for (int64_t r = 0; r < rows && r0 + r < xq.R; ++r)
        store_rows(y + (r0 + r) * ldy + 16 * t, {{_mm256_load_ps(acc + 16 * r), _mm256_load_ps(acc + 16 * r + 8)}});
    }
  }
}
#endif

}  // namespace kvgen
