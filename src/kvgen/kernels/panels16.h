// AVX2's Q4_K products of a prompt's rows on 16-bit inputs (KVGEN_DOT2; dot.h's product_input, unless
// KVGEN_PREFILL_INPUTS=float32). vpmaddwd multiplies 16 int16 pairs an instruction where an FMA does 8 float32
// products, and Zen 3 issues two of either a cycle. The inputs (dot.h's X16) are rounded a row's window of 64 values at
// a time to int16 on the scale of the window's largest value but one, the largest, which stays exact; each tile block's
// codes times their 6-bit group scales (at most 15 x 63 = 945) go into an int16 panel, and a window's int32 sums (at
// most 2 x 945 x 32767 a step, 32 steps: < 2^31) are weighed into float32 once: the window's scale times them plus the
// exact value times its column (the block's panel as float32), the block's sum of those times d, plus the groups' mins
// times their inputs' sums (of the rounded values, whose rounding the mins' products then cancel). Each value moves by
// at most 2^-16 of its window's largest other value; each row is rounded and weighed on its own, so its products do not
// depend on the product's other rows. Logits of 512-token prefills moved by up to 5.3e-3 (Gemma 3 270M) and 5.1e-4
// (Qwen2.5-Coder-0.5B) from the dequantized float32 run; whole prefills ran 1.09-1.16x faster (AMD EPYC Zen 3, Llama
// 3.2 1B and Qwen2.5-1.5B Q4_K_M). Included by dot.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "dot.h"
#include "parallel.h"
#include "tiles2.h"

namespace kvgen {

#if defined(KVGEN_DOT2)
constexpr int64_t WINDOW16 = 64;

inline float max_lanes(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// x's R rows (K values each, a multiple of 256) as dot.h's X16: each row's windows on their own, so that a row's
// products do not depend on the other rows of its product
inline X16 round_x16(const float* x, int64_t ldx, int64_t R, int64_t K) {
  X16 q;
  q.R = R, q.RP = (R + 5) / 6 * 6, q.K = K;
  const int64_t nw = K / WINDOW16;
  q.v = Written<int16_t>(q.RP * K), q.scale = Written<float>(q.RP * nw), q.outlier = Written<float>(q.RP * nw);
  q.sums = Written<float>(q.RP * K / 32), q.at = Written<int32_t>(q.RP * nw);
  parallel_for(0, q.RP, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t w = 0; w < nw; ++w) {
        int16_t* v = q.v.data() + (w / 4 * q.RP + r) * 256 + w % 4 * WINDOW16;  // (K / 256, RP, 256)
        const int64_t i = r * nw + w;
        if (r >= R) {  // a row of zeros, so that every block of rows has 6
          std::fill_n(v, WINDOW16, 0);
          q.scale[i] = q.sums[2 * i] = q.sums[2 * i + 1] = q.outlier[i] = 0.0f;
          q.at[i] = 0;
          continue;
        }
        const float* xw = x + r * ldx + w * WINDOW16;
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 mag[8], top8 = _mm256_setzero_ps();
        for (int j = 0; j < 8; ++j) {
          mag[j] = _mm256_andnot_ps(sign, _mm256_loadu_ps(xw + 8 * j));
          top8 = _mm256_max_ps(top8, mag[j]);
        }
        const float most = max_lanes(top8);  // (max_ps drops NaNs: the check below finds them)
        int at = 0;  // the first value of the largest magnitude
        for (int j = 0; j < 8; ++j) {
          const int hit = _mm256_movemask_ps(_mm256_cmp_ps(mag[j], _mm256_set1_ps(most), _CMP_EQ_OQ));
          if (hit != 0) {
            at = 8 * j + __builtin_ctz(hit);
            break;
          }
        }
        // NaN or inf anywhere: NaN products, as float32's
        bool finite = most <= std::numeric_limits<float>::max();
        for (int j = 0; j < 8; ++j)
          finite = finite && _mm256_movemask_ps(_mm256_cmp_ps(mag[j], mag[j], _CMP_UNORD_Q)) == 0;
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        mag[at / 8] = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_set1_epi32(at % 8), lane)),
                                       mag[at / 8]);
        top8 = _mm256_setzero_ps();
        for (int j = 0; j < 8; ++j) top8 = _mm256_max_ps(top8, mag[j]);
        const float top = max_lanes(top8);
        const float inv = top > 0.0f && finite ? 32767.0f / top : 0.0f;
        const float scale = finite ? top / 32767.0f : NAN;
        for (int j = 0; j < WINDOW16; j += 16) {
          const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xw + j), _mm256_set1_ps(inv)));
          const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xw + j + 8), _mm256_set1_ps(inv)));
          const __m256i ab = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // (packs: per 128 bits)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + j), ab);
        }
        v[at] = 0;
        q.scale[i] = scale, q.outlier[i] = xw[at], q.at[i] = at;
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
  d = f16_quads(blk);
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

// a block's 256 columns of weights as float32 (k, 16 lanes in Quads' order), from its int16 panel: code times group
// scale, without d
inline void panel_columns(const int16_t* panel, float* columns) {
  for (int s = 0; s < 128; ++s)
    for (int h = 0; h < 2; ++h) {
      const __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + 32 * s + 16 * h));
      _mm256_store_ps(columns + 32 * s + 8 * h, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(p, 16), 16)));
      _mm256_store_ps(columns + 32 * s + 16 + 8 * h, _mm256_cvtepi32_ps(_mm256_srai_epi32(p, 16)));
    }
}

// X16's arrays as plain pointers: the weighing's loads then need no reload of X16's fields after each store
struct X16View {
  const float *scale, *outlier, *sums;
  const int32_t* at;
  int64_t nw;  // windows a row
};

// parts (6 rows' 16 sums over their block's windows so far, Quads' order, not yet times d) plus window w's: the
// window's scale times its int32 sums (each row's 16 lanes at sums) + the row's exact value times its column (at
// columns, the window's)
inline void add_window(const X16View& x, int64_t row, int64_t w, const int32_t* __restrict sums,
                       const float* __restrict columns, bool first, float* __restrict parts) {
  for (int r = 0; r < 6; ++r) {
    const int64_t i = (row + r) * x.nw + w;
    const float* column = columns + 16 * x.at[i];
    const __m256 scale = _mm256_set1_ps(x.scale[i]), outlier = _mm256_set1_ps(x.outlier[i]);
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sums + 16 * r + 8 * h)));
      const __m256 c = _mm256_load_ps(column + 8 * h);
      float* part = parts + 16 * r + 8 * h;
      const __m256 t = first ? _mm256_mul_ps(c, outlier) : _mm256_fmadd_ps(c, outlier, _mm256_load_ps(part));
      _mm256_store_ps(part, _mm256_fmadd_ps(v, scale, t));
    }
  }
}

// acc (6 rows' 16 sums each, Quads' order) plus block b's: d times its windows' parts + the 8 groups' mins times
// their inputs' sums
inline void close_block(const X16View& x, int64_t row, int64_t b, const float* __restrict parts, const Lanes& d,
                        const Lanes* m, float* __restrict acc) {
  for (int r = 0; r < 6; ++r) {
    const float* g = x.sums + (row + r) * 2 * x.nw + 8 * b;
    for (int h = 0; h < 2; ++h) {
      __m256 o = _mm256_fmadd_ps(d.h[h], _mm256_load_ps(parts + 16 * r + 8 * h), _mm256_load_ps(acc + 16 * r + 8 * h));
      for (int k = 0; k < 8; ++k) o = _mm256_fmadd_ps(m[k].h[h], _mm256_set1_ps(g[k]), o);
      _mm256_store_ps(acc + 16 * r + 8 * h, o);
    }
  }
}

constexpr int64_t PASS16_ROWS = 240;  // at most a pass's rows (6 a block): their float32 sums (15 kB) stay in L1

// y[r, 16 t + i] for tiles t0..t1 of a Q4_K weight and every row of xq. Per pass of rows (as even as blocks of 6
// allow), per tile, per block of 256 values: the block's int16 panel (8 kB) and its columns in float32 (16 kB), then
// each 6 rows' 4 windows and the block's close. (Sweeps of 2 blocks for every tile, so that the pass's 16-bit values of
// those blocks stay in L2 instead of coming from L3 once a tile, each tile's sums carried over in y, ran 0.92-0.95x
// this: Llama 3.2 1B's ffn_gate and ffn_down at 512 rows, AMD EPYC Zen 3, kernels_ab.py --prompt)
inline void matmul_q4k_i16(const X16& xq, const uint8_t* w, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  constexpr int64_t TB = 16 * Q4_Kx16::Gguf::BYTES;
  const int64_t nb = xq.K / 256, passes = (xq.RP + PASS16_ROWS - 1) / PASS16_ROWS;
  const int64_t per_pass = (xq.RP / 6 + passes - 1) / passes * 6;
  alignas(32) int16_t panel[16 * 256];
  alignas(32) float columns[256 * 16], acc[16 * PASS16_ROWS], part[6 * 16];
  alignas(32) int32_t sums[6 * 16];
  Lanes d, m[8];
  const X16View x{xq.scale.data(), xq.outlier.data(), xq.sums.data(), xq.at.data(), xq.K / WINDOW16};
  for (int64_t r0 = 0; r0 < xq.RP; r0 += per_pass) {
    const int64_t rows = std::min(per_pass, xq.RP - r0);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc, acc + 16 * rows, 0.0f);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + (t * nb + b) * TB;
        __builtin_prefetch(blk + TB);
        panel16_q4k(blk, panel, d, m);
        panel_columns(panel, columns);
        const int16_t* xb = xq.v.data() + (b * xq.RP + r0) * 256;  // the pass's rows' values of block b
        for (int64_t r = 0; r < rows; r += 6) {
          for (int64_t win = 0; win < 4; ++win) {
            window_sums(panel + 32 * 32 * win, xb + 256 * r + WINDOW16 * win, 256, sums);
            add_window(x, r0 + r, 4 * b + win, sums, columns + 16 * WINDOW16 * win, win == 0, part);
          }
          close_block(x, r0 + r, b, part, d, m, acc + 16 * r);
        }
      }
      for (int64_t r = 0; r < rows && r0 + r < xq.R; ++r)
        store_rows(y + (r0 + r) * ldy + 16 * t, {{_mm256_load_ps(acc + 16 * r), _mm256_load_ps(acc + 16 * r + 8)}});
    }
  }
}
#endif

}  // namespace kvgen
