// A decode step's Q4_K and Q6_K products where AVX2 runs without AVX-512 VNNI (KVGEN_DOT2): one input row (rounded to
// three int8 levels, dot.h's RoundedX) times tiles of 16 rows (a Q4_K_M file's weights), each group of values in
// hand-written assembly: the intrinsics they replaced kept most of their values on the stack (GCC). The same bits as
// the products of more rows (dot2.h's matmul_tiles_dot, whose add_group these repeat). Measured on one Zen 3 core
// against those intrinsics, each tensor of Qwen2.5-1.5B in turn in one process (kernels_ab.py): from cache Q6_K
// 1.09-1.11x, Q4_K 1.03-1.06x; from memory 1.0-1.1x at 1 thread, within the noise (±5%) at 2, where the memory's rate
// sets the pace. Included by dot2.h.
#pragma once

#include <utility>

#include "dot.h"
#include "tiles2.h"

namespace kvgen {

#if defined(KVGEN_DOT2)
// One group of 16 Q6_K values of 16 rows (4 quads: 4 runs of 16 bytes each, Quads' order) times one input row's
// three levels at q, q + K, q + 2 K, added to acc (each half of the rows) as dot2.h's add_group adds it: acc += (d s)
// sum(u X) + m xs, with s (the input's scale) at sx, xs (its rounded sum) at xs, d (the rows' d times the group's
// scale) and m = -32 d at dm: the bits of the products of more rows. In assembly, each quad's 3 broadcasts serve
// both halves; level 0 (-127..127) is summed in int16 over 2 quads (2 * 2 * 63 * 127 fit), levels 1 and 2 (-64..63)
// over all 4, then weighed by 2^14, 2^7 and 1 (vpmaddwd): ~110 instructions, where GCC compiled the intrinsics to 240.
// The group's values are 128 h + 32 s + 16 k + l (l = 0..15): their low 4 bits in the runs at low (the low nibbles
// for s < 2, the high ones for s >= 2), their top 2 bits at bit 2 s of the runs at top. S: s, known when compiled
#define KVGEN_Q6_LOW01(OFF, U) "vpand " OFF "(%[lo]), %[n15], " U "\n"
#define KVGEN_Q6_LOW23(OFF, U) "vmovdqu " OFF "(%[lo]), " U "\n vpsrlw $4, " U ", " U "\n vpand %[n15], " U ", " U "\n"
#define KVGEN_Q6_TOP0(OFF, T) "vpand " OFF "(%[tp]), %[top], " T "\n vpsllw $4, " T ", " T "\n"
#define KVGEN_Q6_TOP1(OFF, T) "vmovdqu " OFF "(%[tp]), " T "\n vpsllw $2, " T ", " T "\n vpand %[top], " T ", " T "\n"
#define KVGEN_Q6_TOP2(OFF, T) "vpand " OFF "(%[tp]), %[top], " T "\n"
#define KVGEN_Q6_TOP3(OFF, T) "vmovdqu " OFF "(%[tp]), " T "\n vpsrlw $2, " T ", " T "\n vpand %[top], " T ", " T "\n"
// group i's prefetches, from pf (its block + 3360 + 210 i): the i-th sixteenth of the next block, and of the block 4
// on into L2, so that the next blocks are fetched in the order of their addresses, which the hardware's prefetchers
// follow. The groups read their own block out of that order (low runs 0, 512, 0, 512, 256, ...); prefetching each
// run's line of the next blocks as a group read it ran 0.72-0.94x this from memory (output heads, ffn_down and attn_v
// of Llama 3.2 1B and Qwen2.5-1.5B at 1 and 2 threads, benchmarks/results/q6k_sequential_prefetch_zen3.json; without
// prefetches 0.58-0.72x that; AMD EPYC Zen 3, kernels_ab.py). Into L2 2 blocks on ran 0.93-1.03x this, 8 alike.
// (In C, next to the assembly, GCC hoisted prefetches to the block's start, and products from memory ran at half the
// speed.)
#define KVGEN_Q6_NEXT                                                                                         \
  "prefetcht0 (%[pf])\n prefetcht0 64(%[pf])\n prefetcht0 128(%[pf])\n prefetcht0 192(%[pf])\n"                \
  "prefetcht1 10080(%[pf])\n prefetcht1 10144(%[pf])\n prefetcht1 10208(%[pf])\n prefetcht1 10272(%[pf])\n"
// quad J (offsets O0, O1 of its halves' runs, X of its input values): u of each half in ymm0, ymm1; level l's int16
// sums of half 0 in ymm4 + l, of half 1 in ymm7 + l (ymm3: products to add); level 0's int32 sums in ymm10, ymm11
#define KVGEN_ROW_SET(a, b) a
#define KVGEN_ROW_ADD(a, b) b
#define KVGEN_ROW_LEVEL(SRC, A, B, FIRST)                                                                    \
  "vpbroadcastd " SRC ", %%ymm2\n"                                                                        \
  FIRST("vpmaddubsw %%ymm2, %%ymm0, %%ymm" A "\n vpmaddubsw %%ymm2, %%ymm1, %%ymm" B "\n",                  \
        "vpmaddubsw %%ymm2, %%ymm0, %%ymm3\n vpaddw %%ymm3, %%ymm" A ", %%ymm" A "\n"                       \
        "vpmaddubsw %%ymm2, %%ymm1, %%ymm3\n vpaddw %%ymm3, %%ymm" B ", %%ymm" B "\n")
// level 0's int16 sums into int32 (ymm10, ymm11), weighed 2^14
#define KVGEN_ROW_HIGH_SET "vpmaddwd %[w14], %%ymm4, %%ymm10\n vpmaddwd %[w14], %%ymm7, %%ymm11\n"
// the group's close: levels 1 and 2 weighed (2^7, 1) and added to level 0's, then acc += (d s) sum + m xs, d and m at
// dm, s at sx, xs broadcast into ymm2 by XS
#define KVGEN_ROW_CLOSE(XS)                                                                                   \
  "vpmaddwd %[w7], %%ymm5, %%ymm5\n vpmaddwd %[w1], %%ymm6, %%ymm6\n"                                         \
  "vpmaddwd %[w7], %%ymm8, %%ymm8\n vpmaddwd %[w1], %%ymm9, %%ymm9\n"                                         \
  "vpaddd %%ymm5, %%ymm10, %%ymm10\n vpaddd %%ymm8, %%ymm11, %%ymm11\n"                                       \
  "vpaddd %%ymm6, %%ymm10, %%ymm10\n vpaddd %%ymm9, %%ymm11, %%ymm11\n"                                       \
  "vcvtdq2ps %%ymm10, %%ymm10\n vcvtdq2ps %%ymm11, %%ymm11\n vbroadcastss %[sx], %%ymm2\n"                    \
  "vmulps (%[dm]), %%ymm2, %%ymm3\n vfmadd231ps %%ymm3, %%ymm10, %[acc0]\n"                                    \
  "vmulps 32(%[dm]), %%ymm2, %%ymm3\n vfmadd231ps %%ymm3, %%ymm11, %[acc1]\n" XS                              \
  "vfmadd231ps 64(%[dm]), %%ymm2, %[acc0]\n vfmadd231ps 96(%[dm]), %%ymm2, %[acc1]\n"
#define KVGEN_Q6_QUAD(LOW, TOP, O0, O1, X, F0, F12, HIGH)                                                   \
  LOW(O0, "%%ymm0") TOP(O0, "%%ymm3") "vpor %%ymm3, %%ymm0, %%ymm0\n"                                     \
  LOW(O1, "%%ymm1") TOP(O1, "%%ymm3") "vpor %%ymm3, %%ymm1, %%ymm1\n"                                     \
  KVGEN_ROW_LEVEL(X "(%[q])", "4", "7", F0) KVGEN_ROW_LEVEL(X "(%[q],%[K])", "5", "8", F12)                   \
  KVGEN_ROW_LEVEL(X "(%[q],%[K],2)", "6", "9", F12) HIGH
#define KVGEN_Q6_HIGH_ADD                                                                                     \
  "vpmaddwd %[w14], %%ymm4, %%ymm3\n vpaddd %%ymm3, %%ymm10, %%ymm10\n"                                      \
  "vpmaddwd %[w14], %%ymm7, %%ymm3\n vpaddd %%ymm3, %%ymm11, %%ymm11\n"
#define KVGEN_Q6_GROUP(LOW, TOP)                                                                              \
  KVGEN_Q6_NEXT                                                                                               \
  KVGEN_Q6_QUAD(LOW, TOP, "0", "32", "0", KVGEN_ROW_SET, KVGEN_ROW_SET, "")                                           \
  KVGEN_Q6_QUAD(LOW, TOP, "64", "96", "4", KVGEN_ROW_ADD, KVGEN_ROW_ADD, KVGEN_ROW_HIGH_SET)                           \
  KVGEN_Q6_QUAD(LOW, TOP, "128", "160", "8", KVGEN_ROW_SET, KVGEN_ROW_ADD, "")                                        \
  KVGEN_Q6_QUAD(LOW, TOP, "192", "224", "12", KVGEN_ROW_ADD, KVGEN_ROW_ADD, KVGEN_Q6_HIGH_ADD)                        \
  KVGEN_ROW_CLOSE("vbroadcastss %[xs], %%ymm2\n")

alignas(32) inline constexpr int16_t LEVEL_WEIGHTS[3][16] = {
    {16384, 16384, 16384, 16384, 16384, 16384, 16384, 16384, 16384, 16384, 16384, 16384, 16384, 16384, 16384, 16384},
    {128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128},
    {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}};

template <int S>
__attribute__((always_inline)) inline void q6k_group(const uint8_t* pf, const uint8_t* low, const uint8_t* top,
                                                     const int8_t* q, int64_t K, const float* sx, const float* xs,
                                                     const __m256* dm, __m256& acc0, __m256& acc1) {
  const __m256i n15 = _mm256_set1_epi8(15), topm = _mm256_set1_epi8(S == 0 ? 3 : 0x30);
  const auto& w = LEVEL_WEIGHTS;
#define KVGEN_Q6_ASM(LOW, TOP)                                                                                 \
  __asm__(KVGEN_Q6_GROUP(LOW, TOP)                                                                             \
          : [acc0] "+x"(acc0), [acc1] "+x"(acc1)                                                               \
          : [pf] "r"(pf), [lo] "r"(low), [tp] "r"(top), [q] "r"(q), [K] "r"(K), [dm] "r"(dm), [n15] "x"(n15),      \
            [top] "x"(topm),                                                                                   \
            [sx] "m"(*sx), [xs] "m"(*xs), [w14] "m"(*(const __m256i*)w[0]), [w7] "m"(*(const __m256i*)w[1]),  \
            [w1] "m"(*(const __m256i*)w[2]), "m"(*(const uint8_t(*)[256])low), "m"(*(const uint8_t(*)[256])top), \
            "m"(*(const __m256(*)[4])dm)                                                                       \
          : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11")
  if constexpr (S == 0) KVGEN_Q6_ASM(KVGEN_Q6_LOW01, KVGEN_Q6_TOP0);
  if constexpr (S == 1) KVGEN_Q6_ASM(KVGEN_Q6_LOW01, KVGEN_Q6_TOP1);
  if constexpr (S == 2) KVGEN_Q6_ASM(KVGEN_Q6_LOW23, KVGEN_Q6_TOP2);
  if constexpr (S == 3) KVGEN_Q6_ASM(KVGEN_Q6_LOW23, KVGEN_Q6_TOP3);
#undef KVGEN_Q6_ASM
}

// y[16 t + i] for tiles t0..t1 of format G and one row r0 of the rounded input: per tile block, the first HEAD bytes
// of the next block fetched (its other lines: the block's groups fetch them), then block(blk, xb, sb, xs, acc0, acc1)
// adds the block's products to acc0, acc1 (each half of the rows), with xb, sb, xs its inputs' levels, scales and sums
template <class G, int64_t HEAD, class B>
__attribute__((always_inline)) inline void row_blocks(const RoundedX& x, int64_t r0, const uint8_t* w, int64_t t0,
                                                      int64_t t1, float* y, B&& block) {
  constexpr int64_t TB = 16 * G::BYTES;
  const int64_t K = x.K, nb = K / G::QK;
  const int8_t* levels = x.levels.data() + r0 * 3 * K;
  const float *scales = x.scales.data() + r0 * (K / 32), *sums = x.sums.data() + r0 * (K / 16);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * nb * TB;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = tile + b * TB;
      for (int64_t l = 0; l < HEAD; l += 64) __builtin_prefetch(blk + TB + l);
      block(blk, levels + b * G::QK, scales + b * (G::QK / 32), sums + b * (G::QK / 16), acc0, acc1);
    }
    store_rows(y + 16 * t, Lanes{{acc0, acc1}});
  }
}

// y[16 t + i] for Q6_K tiles t0..t1 and one row r0 of the rounded input (the output head and half the down products
// of a Q4_K_M file): a group of 16 values at a time (q6k_group), its place in the block known when compiled; per
// block, first the rows' d and m of its 16 groups, in Quads' order; group i fetches the i-th sixteenth of the next
// blocks (KVGEN_Q6_NEXT)
__attribute__((noinline)) inline void matmul_q6k_row(const RoundedX& x, int64_t r0, const uint8_t* w, int64_t t0,
                                                     int64_t t1, float* y) {
  static_assert(16 * Q6_K::BYTES == 3360, "q6k_group's prefetches name the tile block's size");
  const int64_t K = x.K;
  row_blocks<Q6_K, 0>(x, r0, w, t0, t1, y, [&](const uint8_t* blk, const int8_t* xb, const float* sb, const float* xs,
                                              __m256& acc0, __m256& acc1) __attribute__((always_inline)) {
    __m256 dm[16][4];  // each group's d (each half of the rows), then its m = -32 d
    const Lanes dd = q6k_d(blk);
    for (int g = 0; g < 16; ++g) {
      const Lanes d = times_bytes(dd, bytes_quads(blk + 16 * (192 + g))), m = times(d, -32.0f);
      dm[g][0] = d.h[0], dm[g][1] = d.h[1], dm[g][2] = m.h[0], dm[g][3] = m.h[1];
    }
    // values 128 h + 32 s + 16 k + l (l = 0..15): group 8 h + 2 s + k; low 4 bits in runs 64 h + 32 (s % 2) + 16 k +
    // l (the high nibbles for s >= 2), top 2 bits in runs 128 + 32 h + 16 k + l; i = 8 h + 4 k + s
    [&]<int... I>(std::integer_sequence<int, I...>) {
      (
          [&] {
            constexpr int h = I / 8, k = I / 4 % 2, S = I % 4, k0 = 128 * h + 32 * S + 16 * k;
            const uint8_t* low = blk + 16 * (64 * h + 32 * (S % 2) + 16 * k);
            const uint8_t* top = blk + 16 * (128 + 32 * h + 16 * k);
            q6k_group<S>(blk + 3360 + 210 * I, low, top, xb + k0, K, sb + k0 / 32, xs + k0 / 16, dm[8 * h + 2 * S + k],
                         acc0, acc1);
          }(),
          ...);
    }(std::make_integer_sequence<int, 16>{});
  });
}

// One group of 32 Q4_K values of 16 rows (8 quads at run, run + 64, ...: their low nibbles for G = 0, the high ones
// for G = 1) times one input row's three levels at q, q + K, q + 2 K, added to acc as add_group<32> adds it: acc +=
// (d s) sum(u X) + m xs, with s at sx, xs the sum of the two values at xs, d and m at dm. Every level's products
// summed in int16 over all 8 quads (2 * 8 * 15 * 127 fit), then weighed by 2^14, 2^7 and 1. G = 0 fetches the next
// block's line of each quad (2304 bytes on)
#define KVGEN_Q4_LOW(OFF, U) "vpand " OFF "(%[lo]), %[n15], " U "\n"
#define KVGEN_Q4_HIGH(OFF, U) "vmovdqu " OFF "(%[lo]), " U "\n vpsrlw $4, " U ", " U "\n vpand %[n15], " U ", " U "\n"
#define KVGEN_Q4_LOW_NEXT(OFF) "prefetcht0 2304+" OFF "(%[lo])\n"
#define KVGEN_Q4_HIGH_NEXT(OFF)
#define KVGEN_Q4_QUAD(NIB, O0, O1, X, F)                                                                      \
  NIB##_NEXT(O0) NIB(O0, "%%ymm0") NIB(O1, "%%ymm1") KVGEN_ROW_LEVEL(X "(%[q])", "4", "7", F)                \
  KVGEN_ROW_LEVEL(X "(%[q],%[K])", "5", "8", F) KVGEN_ROW_LEVEL(X "(%[q],%[K],2)", "6", "9", F)
#define KVGEN_Q4_GROUP(NIB)                                                                                   \
  KVGEN_Q4_QUAD(NIB, "0", "32", "0", KVGEN_ROW_SET) KVGEN_Q4_QUAD(NIB, "64", "96", "4", KVGEN_ROW_ADD)          \
  KVGEN_Q4_QUAD(NIB, "128", "160", "8", KVGEN_ROW_ADD) KVGEN_Q4_QUAD(NIB, "192", "224", "12", KVGEN_ROW_ADD)    \
  KVGEN_Q4_QUAD(NIB, "256", "288", "16", KVGEN_ROW_ADD) KVGEN_Q4_QUAD(NIB, "320", "352", "20", KVGEN_ROW_ADD)   \
  KVGEN_Q4_QUAD(NIB, "384", "416", "24", KVGEN_ROW_ADD) KVGEN_Q4_QUAD(NIB, "448", "480", "28", KVGEN_ROW_ADD)   \
  KVGEN_ROW_HIGH_SET                                                                                          \
  KVGEN_ROW_CLOSE("vmovss %[xs0], %%xmm2\n vaddss %[xs1], %%xmm2, %%xmm2\n vbroadcastss %%xmm2, %%ymm2\n")

template <int G>
__attribute__((always_inline)) inline void q4k_group(const uint8_t* run, const int8_t* q, int64_t K, const float* sx,
                                                     const float* xs, const __m256* dm, __m256& acc0, __m256& acc1) {
  const __m256i n15 = _mm256_set1_epi8(15);
  const auto& w = LEVEL_WEIGHTS;
#define KVGEN_Q4_ASM(NIB)                                                                                      \
  __asm__(KVGEN_Q4_GROUP(NIB)                                                                                  \
          : [acc0] "+x"(acc0), [acc1] "+x"(acc1)                                                               \
          : [lo] "r"(run), [q] "r"(q), [K] "r"(K), [dm] "r"(dm), [n15] "x"(n15), [sx] "m"(*sx), [xs0] "m"(xs[0]), \
            [xs1] "m"(xs[1]), [w14] "m"(*(const __m256i*)w[0]), [w7] "m"(*(const __m256i*)w[1]),                 \
            [w1] "m"(*(const __m256i*)w[2]), "m"(*(const uint8_t(*)[512])run), "m"(*(const __m256(*)[4])dm)      \
          : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11")
  if constexpr (G == 0) KVGEN_Q4_ASM(KVGEN_Q4_LOW);
  if constexpr (G == 1) KVGEN_Q4_ASM(KVGEN_Q4_HIGH);
#undef KVGEN_Q4_ASM
}

// y[16 t + i] for Q4_K tiles t0..t1 and one row r0 of the rounded input: a group of 32 values at a time (q4k_group);
// per block, first the rows' d and m of its 8 groups, in Quads' order. The next block's head and scales are fetched
// a line at a time as this one's are read: all of a block's lines at its start, 4 kB ahead, ran 0.85-0.99x that
// (Qwen2.5-1.5B's ffn_gate / ffn_up / attn_output, AMD EPYC Zen 3)
__attribute__((noinline)) inline void matmul_q4k_row(const RoundedX& x, int64_t r0, const uint8_t* w, int64_t t0,
                                                     int64_t t1, float* y) {
  static_assert(16 * Q4_K::BYTES == 2304, "q4k_group's prefetches name the tile block's size");
  const int64_t K = x.K;
  row_blocks<Q4_K, 256>(x, r0, w, t0, t1, y, [&](const uint8_t* blk, const int8_t* xb, const float* sb,
                                                const float* xs, __m256& acc0, __m256& acc1)
                                                __attribute__((always_inline)) {
    __m256 dm[8][4];  // each group's d (each half of the rows), then its m
    k_scales_quads(blk, dm);
    // byte i of chunk c (its runs from blk + 256 + 512 c): value 64 c + i (low nibble, group 2 c), 64 c + 32 + i
    // (high nibble, group 2 c + 1)
    for (int c = 0; c < 4; ++c) {
      const uint8_t* run = blk + 256 + 512 * c;
      q4k_group<0>(run, xb + 64 * c, K, sb + 2 * c, xs + 4 * c, dm[2 * c], acc0, acc1);
      q4k_group<1>(run, xb + 64 * c + 32, K, sb + 2 * c + 1, xs + 4 * c + 2, dm[2 * c + 1], acc0, acc1);
    }
  });
}

#undef KVGEN_Q6_LOW01
#undef KVGEN_Q6_LOW23
#undef KVGEN_Q6_TOP0
#undef KVGEN_Q6_TOP1
#undef KVGEN_Q6_TOP2
#undef KVGEN_Q6_TOP3
#undef KVGEN_Q6_NEXT
#undef KVGEN_Q6_QUAD
#undef KVGEN_Q6_HIGH_ADD
#undef KVGEN_Q6_GROUP
#undef KVGEN_Q4_LOW
#undef KVGEN_Q4_HIGH
#undef KVGEN_Q4_LOW_NEXT
#undef KVGEN_Q4_HIGH_NEXT
#undef KVGEN_Q4_QUAD
#undef KVGEN_Q4_GROUP
#undef KVGEN_ROW_SET
#undef KVGEN_ROW_ADD
#undef KVGEN_ROW_LEVEL
#undef KVGEN_ROW_HIGH_SET
#undef KVGEN_ROW_CLOSE
#endif

}  // namespace kvgen
