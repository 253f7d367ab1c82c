// The integer groups of the tiled formats where AVX2 runs without AVX-512 VNNI (KVGEN_DOT2): tiles.h's dot_groups
// with each group's u in Quads (simd.h: two registers of 8 rows) and its d and m in the Quads' order of rows (Lanes),
// for dot2.h's vpmaddubsw products.
#pragma once

#include "tiles.h"

namespace kvgen {

#if defined(KVGEN_DOT2)
template <int I> using Int = std::integral_constant<int, I>;

// 16 float16 fields at p (one a row) as float32 in Quads' order of rows: to_quads(f16_fields(p)), without the
// exchange of 16 float32 lanes between halves (the 64-bit runs of fields exchanged before they are widened)
inline Lanes f16_quads(const void* p) {
#if defined(__F16C__)
  const __m256i h = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 0xD8);
  return {{_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))}};
#else
  return to_quads(f16_fields(p));
#endif
}

// v's 16 lanes times s
inline Lanes times(const Lanes& v, float s) {
  const __m256 f = _mm256_set1_ps(s);
  return {{_mm256_mul_ps(v.h[0], f), _mm256_mul_ps(v.h[1], f)}};
}

// dot_groups<R>(blk, f): f(slot, part, k0, u, d, m) for each 16 values of a tile block from value k0 on, the part-th
// 16 of a group of T::GROUP values (slot: which of the groups open at once): u[j] holds values k0 + 4 j .. k0 + 4 j +
// 3 of the 16 rows as unsigned bytes (at most T::CODE_MAX), worth d * u + m. Parts of 16 values (8 registers of u)
// leave the products' sums registers enough: a group's 8 at once spilled to the stack
template <class G, int H, int BASE>
template <int R, class F>
void Nibbles16<G, H, BASE>::dot_groups(const uint8_t* blk, F&& f) {
  const Lanes dq = f16_quads(blk);
  const Lanes mq = G::HAS_MIN ? f16_quads(blk + 32) : times(dq, (float)BASE);
  Quads v[4], u[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)  // runs 4 j ..: values 4 j + a (low nibbles), 16 + 4 j + a (high)
    v[j] = load_quads(blk + 16 * H + 64 * j);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) u[j] = low4(v[j]);
  f(Int<0>{}, Int<0>{}, 0, u, dq, mq);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) u[j] = high4(v[j]);
  f(Int<0>{}, Int<1>{}, 16, u, dq, mq);
}

// 16 bytes at p (one a row) in Quads' order of rows: the first 8 bytes rows 0-3 and 8-11, the last 8 rows 4-7, 12-15
inline __m128i bytes_quads(const uint8_t* p) {
  const __m128i quad_rows = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), quad_rows);
}

// d times 16 signed bytes in Quads' order of rows (bytes_quads'), lane by lane
inline Lanes times_bytes(const Lanes& d, __m128i bytes) {
  return {{_mm256_mul_ps(d.h[0], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))),
           _mm256_mul_ps(d.h[1], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))))}};
}

// a Q6_K tile block's 16 rows' d in Quads' order
inline Lanes q6k_d(const uint8_t* blk) {
  const vh bits = q6k_d_fields(blk);
  return f16_quads(&bits);
}

// a Q4_K tile block's 8 groups' d and m at dm[g] (d of each half of the rows in Quads' order, then m): the bits of
// k_scales16 and to_quads, but its 16 rows' scale bytes shuffled into Quads' order and decoded as bytes, so that no
// vector of 16 lanes is exchanged between halves (one-row Q4_K products 1.00-1.21x faster from memory, AMD EPYC
// Zen 3, kernels_ab.py: benchmarks/results/q4k_scales_quads_zen3.json)
inline void k_scales_quads(const uint8_t* blk, __m256 (*dm)[4]) {
  const Lanes dd = f16_quads(blk), neg_dmin = times(f16_quads(blk + 32), -1.0f);  // m = -(dmin min)
  __m128i sc[12];  // k_scales' 12 bytes of the 16 rows, each in Quads' order
  for (int j = 0; j < 12; ++j) sc[j] = bytes_quads(blk + 64 + 16 * j);
  const __m128i six = _mm_set1_epi8(0x3F), four = _mm_set1_epi8(0x0F), top = _mm_set1_epi8(0x30);
  const auto put = [](const Lanes& v, __m256* out) { out[0] = v.h[0], out[1] = v.h[1]; };
  // 6-bit codes (times_bytes takes signed bytes: these are below 64); the bits the 16-bit shifts bring in from the
  // next byte are masked off
  for (int j = 0; j < 4; ++j) {
    put(times_bytes(dd, _mm_and_si128(sc[j], six)), dm[j]);
    put(times_bytes(neg_dmin, _mm_and_si128(sc[j + 4], six)), dm[j] + 2);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(sc[j], 2), top);
    put(times_bytes(dd, _mm_or_si128(_mm_and_si128(sc[j + 8], four), high)), dm[j + 4]);
    const __m128i low_min = _mm_and_si128(_mm_srli_epi16(sc[j + 8], 4), four);
    put(times_bytes(neg_dmin, _mm_or_si128(low_min, _mm_and_si128(_mm_srli_epi16(sc[j + 4], 2), top))), dm[j + 4] + 2);
  }
}

template <int R, class F>
void Q4_Kx16::dot_groups(const uint8_t* blk, F&& f) {
  const uint8_t* run = blk + 64;
  __m256 dm[8][4];
  k_scales_quads(blk, dm);
  for (int c = 0; c < 4; ++c) {  // byte i of chunk c: value 64 c + i (low nibble, group 2 c), 64 c + 32 + i (high)
    const __m256 *g0 = dm[2 * c], *g1 = dm[2 * c + 1];
    const Lanes d0{{g0[0], g0[1]}}, m0{{g0[2], g0[3]}}, d1{{g1[0], g1[1]}}, m1{{g1[2], g1[3]}};
    auto half = [&](auto part) {  // runs 4 j .. for j in 4 part .. 4 part + 3, loaded once for both groups
      Quads v[4], u[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) v[j] = load_quads(run + 16 * (12 + 32 * c + 16 * part + 4 * j));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) u[j] = low4(v[j]);
      f(Int<0>{}, part, 64 * c + 16 * part, u, d0, m0);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) u[j] = high4(v[j]);
      f(Int<1>{}, part, 64 * c + 32 + 16 * part, u, d1, m1);
    };
    half(Int<0>{});
    half(Int<1>{});
  }
}

// the runs of a Q6_K tile block's values 128 h + 32 s + 16 k + 4 j .. (j = 0..3) in Quads: their low 4 bits for s =
// 0, 2 (q[0][j]) and s = 1, 3 (q[1][j]), their top 2 bits for every s (hb[j]); each run loaded once for the 4
// groups that read it
inline void q6k_runs(const uint8_t* blk, int h, int k, Quads (&q)[2][4], Quads (&hb)[4]) {
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const int l = 16 * k + 4 * j;
    q[0][j] = load_quads(blk + 16 * (64 * h + l));
    q[1][j] = load_quads(blk + 16 * (64 * h + 32 + l));
    hb[j] = load_quads(blk + 16 * (128 + 32 * h + l));
  }
}

template <int R, class F>
void Q6_Kx16::dot_groups(const uint8_t* blk, F&& f) {
  const Lanes dd = q6k_d(blk);
  const __m256i n15 = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3), top = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h)
    // low 4 bits: runs 64 h + l (s = 0, 2) or 64 h + 32 + l (s = 1, 3); top 2 bits: runs 128 + 32 h + l
    for (int k = 0; k < 2; ++k) {  // values 128 h + 32 s + 16 k + l for l in 0..15: group 8 h + 2 s + k
      Quads q[2][4], hb[4];
      q6k_runs(blk, h, k, q, hb);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        Quads u[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 2; ++i) {
            const __m256i v = q[s % 2][j].h[i], b = hb[j].h[i];
            const __m256i low = s < 2 ? _mm256_and_si256(v, n15) : _mm256_and_si256(_mm256_srli_epi16(v, 4), n15);
            const __m256i high = s == 0 ? _mm256_slli_epi16(_mm256_and_si256(b, two), 4)
                                 : s == 1 ? _mm256_and_si256(_mm256_slli_epi16(b, 2), top)
                                 : s == 2 ? _mm256_and_si256(b, top)
                                          : _mm256_and_si256(_mm256_srli_epi16(b, 2), top);
            u[j].h[i] = _mm256_or_si256(low, high);
          }
        const Lanes dg = times_bytes(dd, bytes_quads(blk + 16 * (192 + 8 * h + 2 * s + k)));  // the group's scales
        f(Int<0>{}, Int<0>{}, 128 * h + 32 * s + 16 * k, u, dg, times(dg, -32.0f));
      }
    }
}
template <int R, class F>
void Q5_0x16::dot_groups(const uint8_t* blk, F&& f) {
  __m256i rows[2], mask[2];  // each row's 32-bit mask of 5th bits (bit v: value v's), rows 0-7 and 8-15, then Quads'
  for (int h = 0; h < 2; ++h)
    rows[h] = _mm256_or_si256(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h))),
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 64 + 16 * h))),
                          16));
  mask[0] = _mm256_permute2x128_si256(rows[0], rows[1], 0x20);
  mask[1] = _mm256_permute2x128_si256(rows[0], rows[1], 0x31);
  const Lanes dq = f16_quads(blk);
  const Lanes mq = times(dq, -16.0f);
  Quads v[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) v[j] = load_quads(blk + 96 + 64 * j);  // runs 4 j ..: values 4 j + a (low), 16 + 4 j + a
  auto part = [&](auto p) {  // values 16 p + 4 j + (0, 2, 1, 3) of a row: bits of its mask's nibble 4 p + j
    Quads u[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const int nibble = 4 * p + j;
      // each row's mask byte nibble / 2 in its 4 bytes; byte b tests bit (0, 2, 1, 3)[b] of the nibble
      const __m256i at = _mm256_add_epi8(_mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                                          0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12),
                                         _mm256_set1_epi8((char)(nibble / 2)));
      const __m256i bit = _mm256_set1_epi32(nibble % 2 ? (int)0x80204010u : 0x08020401);
      const Quads low = p ? high4(v[j]) : low4(v[j]);
      for (int i = 0; i < 2; ++i) {
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(mask[i], at), bit), bit);
        u[j].h[i] = _mm256_or_si256(low.h[i], _mm256_and_si256(set, _mm256_set1_epi8(16)));
      }
    }
    f(Int<0>{}, p, 16 * p, u, dq, mq);
  };
  part(Int<0>{});
  part(Int<1>{});
}
#endif

}  // namespace kvgen
