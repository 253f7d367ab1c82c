// The formats in tiles of 16 rows (formats.h declares them): walking a tile block for the float32 products
// (block: 16 rows' values in the lanes, multiplied by one broadcast input value) and, where AVX-512 VNNI runs, its
// groups of values as unsigned bytes for the integer dot products (dot_groups), and how a group's exact integer
// sums become float32 (add_group: the same for vpdpbusd and the tile unit).
#pragma once

#include "dot.h"
#include "formats.h"

namespace kvgen {

// 16 bytes -> 16 lanes (DC native vectors): table[low nibble], table[high nibble]
inline void nibbles16(const uint8_t* p, float base, vn* lo, vn* hi) {
#if defined(__AVX512F__)
  const __m512 table = _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_ps(base));  // small integers: exact
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 l = _mm512_permutexvar_ps(v, table), h = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);  // index: low 4 bits
  std::memcpy(lo, &l, 64);
  std::memcpy(hi, &h, 64);
#elif defined(__AVX2__)
  for (int c = 0; c < 2; ++c) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * c)));
    const __m256 l = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))), _mm256_set1_ps(base));
    const __m256 h = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), _mm256_set1_ps(base));
    std::memcpy(lo + c, &l, 32);
    std::memcpy(hi + c, &h, 32);
  }
#else
  float l[16], h[16];
  for (int i = 0; i < 16; ++i) {
    l[i] = (float)(p[i] & 15) + base;
    h[i] = (float)(p[i] >> 4) + base;
  }
  std::memcpy(lo, l, 64);
  std::memcpy(hi, h, 64);
#endif
}

template <class G, int H, int BASE>
template <class E>
void Nibbles16<G, H, BASE>::columns(typename Tiled<G, H>::None, const uint8_t* run, int j, E&& emit) {
  vn lo[DC], hi[DC];
  nibbles16(run, (float)BASE, lo, hi);
  emit(j, lo);
  emit(j + 16, hi);
}

inline Q5_0x16::High Q5_0x16::state(const uint8_t* blk) {
  uint32_t low[16], high[16];
  for (int i = 0; i < 16; ++i) {
    uint16_t lo, hi;
    std::memcpy(&lo, blk + 32 + 2 * i, 2);
    std::memcpy(&hi, blk + 64 + 2 * i, 2);
    high[i] = (uint32_t)lo | (uint32_t)hi << 16;
    low[i] = high[i] << 4;
  }
  High h;
  std::memcpy(h.low, low, 64);
  std::memcpy(h.high, high, 64);
  return h;
}

// columns j and j + 16: 5-bit values (nibble | 5th bit << 4) - 16
template <class E> void Q5_0x16::columns(const High& h, const uint8_t* run, int j, E&& emit) {
  vn lo[DC], hi[DC];
#if defined(__AVX512F__)
  const __m512 low = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m512 high = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run)));
  __m512i bl, bh;
  std::memcpy(&bl, h.low, 64);
  std::memcpy(&bh, h.high, 64);
  const __m512i nib = _mm512_set1_epi32(15);
  // index bits 0-3 from the nibble, bit 4 from the mask (bit j or j + 16, shifted to 4); bits above 4 are ignored
  const __m512i il = _mm512_ternarylogic_epi32(nib, v, _mm512_srli_epi32(bl, j), 0xCA);
  const __m512i ih = _mm512_ternarylogic_epi32(nib, _mm512_srli_epi32(v, 4), _mm512_srli_epi32(bh, j + 12), 0xCA);
  const __m512 l = _mm512_permutex2var_ps(low, il, high), u = _mm512_permutex2var_ps(low, ih, high);
  std::memcpy(lo, &l, 64);
  std::memcpy(hi, &u, 64);
#elif defined(__AVX2__)
  const __m128i sl = _mm_cvtsi32_si128(j), sh = _mm_cvtsi32_si128(j + 12);
  const __m256i nib = _mm256_set1_epi32(15), fifth = _mm256_set1_epi32(16);
  for (int c = 0; c < 2; ++c) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(run + 8 * c)));
    __m256i bl, bh;
    std::memcpy(&bl, h.low + c, 32);
    std::memcpy(&bh, h.high + c, 32);
    const __m256i il = _mm256_or_si256(_mm256_and_si256(v, nib), _mm256_and_si256(_mm256_srl_epi32(bl, sl), fifth));
    const __m256i ih = _mm256_or_si256(_mm256_srli_epi32(v, 4), _mm256_and_si256(_mm256_srl_epi32(bh, sh), fifth));
    const __m256 l = _mm256_sub_ps(_mm256_cvtepi32_ps(il), _mm256_set1_ps(16.0f));
    const __m256 u = _mm256_sub_ps(_mm256_cvtepi32_ps(ih), _mm256_set1_ps(16.0f));
    std::memcpy(lo + c, &l, 32);
    std::memcpy(hi + c, &u, 32);
  }
#else
  uint32_t bl[16], bh[16];
  std::memcpy(bl, h.low, 64);
  std::memcpy(bh, h.high, 64);
  float l[16], u[16];
  for (int i = 0; i < 16; ++i) {
    l[i] = (float)((run[i] & 15) | (bl[i] >> j & 16)) - 16.0f;
    u[i] = (float)((run[i] >> 4) | (bh[i] >> (j + 12) & 16)) - 16.0f;
  }
  std::memcpy(lo, l, 64);
  std::memcpy(hi, u, 64);
#endif
  emit(j, lo);
  emit(j + 16, hi);
}


// 32-value blocks with one float16 d (and m) per row: every run's columns into CH chains
template <class T, int CH, class E, class C>
void block32(const uint8_t* blk, E&& emit, C&& close) {
  const auto state = T::state(blk);
  static_assert(T::RUNS % CH == 0);
  for (int j0 = 0; j0 < T::RUNS; j0 += CH)
#pragma GCC unroll 4
    for (int u = 0; u < CH; ++u)  // slots known at compile time: the partial sums stay in registers
      T::columns(state, blk + 16 * T::HEAD + 16 * (j0 + u), j0 + u, [&](int col, const vn* v) { emit(u, col, v); });
  vn d[DC], m[DC] = {};
  to_lanes(f16_fields(blk), d);
  if constexpr (T::HAS_MIN) to_lanes(f16_fields(blk + 32), m);
  close(0, CH, d, m, 0);
}

template <class G, int H, int BASE>
template <int CH, class E, class C>
void Nibbles16<G, H, BASE>::block(const uint8_t* blk, E&& emit, C&& close) {
  block32<Nibbles16, CH>(blk, emit, close);
}

template <int CH, class E, class C>
void Q5_0x16::block(const uint8_t* blk, E&& emit, C&& close) {
  block32<Q5_0x16, CH>(blk, emit, close);
}

template <class E>
void Q8_0x16::columns(None, const uint8_t* run, int j, E&& emit) {
  vn v[DC];
  to_lanes(tof((vsb)load16(run)), v);
  emit(j, v);
}

template <int CH, class E, class C>
void Q8_0x16::block(const uint8_t* blk, E&& emit, C&& close) {
  block32<Q8_0x16, CH>(blk, emit, close);
}

// the 8 groups' scales d and negated mins m of a Q4_K tile block, as k_scales, 16 rows at a time
inline void k_scales16(const uint8_t* blk, vf* d, vf* m) {
  const uint8_t* run = blk + 64;  // 16 rows' d, then dmin, before the runs
  const vf dd = f16_fields(blk), dmin = f16_fields(blk + 32);
  vi sc[12];  // k_scales' 12 bytes of the 16 rows
  for (int j = 0; j < 12; ++j) sc[j] = toi(load16(run + 16 * j));
  for (int j = 0; j < 4; ++j) {
    d[j] = dd * __builtin_convertvector(sc[j] & 0x3F, vf);
    m[j] = -(dmin * __builtin_convertvector(sc[j + 4] & 0x3F, vf));
    d[j + 4] = dd * __builtin_convertvector((sc[j + 8] & 0x0F) | ((sc[j] >> 2) & 0x30), vf);
    m[j + 4] = -(dmin * __builtin_convertvector((sc[j + 8] >> 4) | ((sc[j + 4] >> 2) & 0x30), vf));
  }
}

template <int CH, class E, class C>
void Q4_Kx16::block(const uint8_t* blk, E&& emit, C&& close) {
  constexpr int S = SLOTS<CH> / 2;
  const uint8_t* run = blk + 64;
  vf scales[8], mins[8];
  k_scales16(blk, scales, mins);
  vn d[8][DC], m[8][DC];
  for (int g = 0; g < 8; ++g) {
    to_lanes(scales[g], d[g]);
    to_lanes(mins[g], m[g]);
  }
  for (int c = 0; c < 4; ++c) {  // byte i of chunk c: value 64 c + i (low nibble), 64 c + 32 + i (high)
    for (int i0 = 0; i0 < 32; i0 += S)
#pragma GCC unroll 4
      for (int u = 0; u < S; ++u) {  // slots known at compile time: the partial sums stay in registers
        const int i = i0 + u;
        vn lo[DC], hi[DC];
        nibbles16(run + 16 * (12 + 32 * c + i), 0.0f, lo, hi);
        emit(u, 64 * c + i, lo);
        emit(S + u, 64 * c + 32 + i, hi);
      }
    close(0, S, d[2 * c], m[2 * c], 2 * c);
    close(S, S, d[2 * c + 1], m[2 * c + 1], 2 * c + 1);
  }
}

// a Q6_K tile block's 16 rows' float16 d, one a row (their low and high bytes are stored apart)
inline vh q6k_d_fields(const uint8_t* blk) {
  return __builtin_convertvector(toi(load16(blk + 16 * 208)) | (toi(load16(blk + 16 * 209)) << 8), vh);
}

template <int CH, class E, class C>
void Q6_Kx16::block(const uint8_t* blk, E&& emit, C&& close) {
  constexpr int S = SLOTS<CH> / 4;
  const vh bits = q6k_d_fields(blk);
  const vf dd = f16_fields(&bits);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 2; ++k) {  // values 128 h + 32 s + l for l in 16 k .. 16 k + 15: group 8 h + 2 s + k
      for (int l0 = 16 * k; l0 < 16 * k + 16; l0 += S)
#pragma GCC unroll 4
      for (int l = l0; l < l0 + S; ++l) {
        const uint8_t *a = blk + 16 * (64 * h + l), *b = blk + 16 * (64 * h + 32 + l);
        const uint8_t* hb = blk + 16 * (128 + 32 * h + l);
#if defined(__AVX512F__)  // two table lookups (low 4 bits - 32, 16 x the high 2 bits), not assembly + conversion
        const __m512 low = _mm512_setr_ps(-32, -31, -30, -29, -28, -27, -26, -25,
                                          -24, -23, -22, -21, -20, -19, -18, -17);
        const __m512 high = _mm512_setr_ps(0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48);  // index & 3
        const __m512i va = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
        const __m512i vb = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
        const __m512i vh = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hb)));
        // the permutes read index bits 0-3 only
        const __m512i nib[4] = {va, vb, _mm512_srli_epi32(va, 4), _mm512_srli_epi32(vb, 4)};
        const __m512i top[4] = {vh, _mm512_srli_epi32(vh, 2), _mm512_srli_epi32(vh, 4), _mm512_srli_epi32(vh, 6)};
        for (int s = 0; s < 4; ++s) {
          const __m512 q = _mm512_add_ps(_mm512_permutexvar_ps(nib[s], low), _mm512_permutexvar_ps(top[s], high));
          vn v[DC];
          std::memcpy(v, &q, 64);
          emit(s * S + l - l0, 128 * h + 32 * s + l, v);
        }
#else
        const vi va = toi(load16(a)), vb = toi(load16(b)), vh = toi(load16(hb));
        const vi q[4] = {(va & 0x0F) | ((vh & 3) << 4), (vb & 0x0F) | (((vh >> 2) & 3) << 4),
                         (va >> 4) | (((vh >> 4) & 3) << 4), (vb >> 4) | ((vh >> 6) << 4)};
        for (int s = 0; s < 4; ++s) {
          vn v[DC];
          to_lanes(__builtin_convertvector(q[s], vf) - 32.0f, v);
          emit(s * S + l - l0, 128 * h + 32 * s + l, v);
        }
#endif
      }
      for (int s = 0; s < 4; ++s) {
        const int g = 8 * h + 2 * s + k;
        vn d[DC];
        to_lanes(dd * tof((vsb)load16(blk + 16 * (192 + g))), d);
        close(s * S, S, d, d, g);
      }
    }
}

#if defined(KVGEN_DOT8)
using Vectors8 = std::integral_constant<int, 8>;
using Vectors4 = std::integral_constant<int, 4>;

// dot_groups<R>(blk, f): f(n, k0, u, d, m) for each group of 4 n values of a tile block from value k0
// on: u[j] lane i holds values k0 + 4 j .. k0 + 4 j + 3 of row i as unsigned bytes, worth d * u + m
// (R: the input rows f takes, for formats whose unpacking depends on the registers f leaves free)
template <class G, int H, int BASE>
template <int R, class F>
void Nibbles16<G, H, BASE>::dot_groups(const uint8_t* blk, F&& f) {
  __m512i u[8];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {  // runs 4 j .. 4 j + 3: values 4 j + a (low nibbles), 16 + 4 j + a (high)
    const __m512i v = by_row(blk + 16 * H + 64 * j);
    u[j] = low4(v);
    u[4 + j] = high4(v);
  }
  const __m512 d = m512(f16_fields(blk));
  f(Vectors8{}, 0, u, d, G::HAS_MIN ? m512(f16_fields(blk + 32)) : _mm512_mul_ps(d, _mm512_set1_ps((float)BASE)));
}

template <int R, class F>
void Q5_0x16::dot_groups(const uint8_t* blk, F&& f) {
  // row i's 32-bit mask of 5th bits in lane i; byte 4 i + a of u[j] takes bit 4 j + a of it (u[4 + j]:
  // bit 16 + 4 j + a), picked from the row's 64-bit half of the vector by vpshufbitqmb
  const __m512i high = _mm512_or_si512(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32))),
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64))), 16));
  // table t: byte 4 i + a <- bit 4 t + a of row i's half (32 (i % 2)): u[j] takes table j, u[4 + j] table 4 + j
  static constexpr struct alignas(64) Fifth {
    uint8_t bytes[8][64];
    constexpr Fifth() : bytes{} {
      for (int t = 0; t < 8; ++t)
        for (int b = 0; b < 64; ++b) bytes[t][b] = (uint8_t)(32 * (b / 4 % 2) + b % 4 + 4 * t);
    }
  } FIFTH;
  const __m512i fifth = _mm512_set1_epi8(16);
  __m512i u[8];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512i v = by_row(blk + 96 + 64 * j), lo = low4(v), hi = high4(v);
    const __mmask64 bl = _mm512_bitshuffle_epi64_mask(high, _mm512_load_si512(FIFTH.bytes[j]));
    const __mmask64 bh = _mm512_bitshuffle_epi64_mask(high, _mm512_load_si512(FIFTH.bytes[4 + j]));
    u[j] = _mm512_mask_add_epi8(lo, bl, lo, fifth);
    u[4 + j] = _mm512_mask_add_epi8(hi, bh, hi, fifth);
  }
  const __m512 d = m512(f16_fields(blk));
  f(Vectors8{}, 0, u, d, _mm512_mul_ps(d, _mm512_set1_ps(-16.0f)));
}

template <int R, class F>
void Q4_Kx16::dot_groups(const uint8_t* blk, F&& f) {
  const uint8_t* run = blk + 64;
  vf d[8], m[8];  // read back one group at a time: 32 registers are few
  k_scales16(blk, d, m);
  // byte i of chunk c = g / 2: value 64 c + i (low nibble, group 2 c), 64 c + 32 + i (high, group 2 c + 1).
  // One or two input rows keep a chunk's permuted bytes in registers for both its groups (a decode
  // product 1.3-1.4x faster, Zen 4); more rows need those registers (kept: 1.7x slower) and permute again
  if constexpr (R > 2) {
    for (int g = 0; g < 8; ++g) {
      __m512i u[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i v = by_row(run + 16 * (12 + 32 * (g / 2) + 4 * j));
        u[j] = g % 2 ? high4(v) : low4(v);
      }
      f(Vectors8{}, 32 * g, u, m512(d[g]), m512(m[g]));
    }
    return;
  }
  for (int c = 0; c < 4; ++c) {
    __m512i v[8], u[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) v[j] = by_row(run + 16 * (12 + 32 * c + 4 * j));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) u[j] = low4(v[j]);
    f(Vectors8{}, 64 * c, u, m512(d[2 * c]), m512(m[2 * c]));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) u[j] = high4(v[j]);
    f(Vectors8{}, 64 * c + 32, u, m512(d[2 * c + 1]), m512(m[2 * c + 1]));
  }
}

template <int R, class F>
void Q6_Kx16::dot_groups(const uint8_t* blk, F&& f) {
  const vh bits = q6k_d_fields(blk);
  const vf dd = f16_fields(&bits);
  float d[16][16];  // each group's scale, 16 rows at a time
  for (int g = 0; g < 16; ++g) {
    const vf v = dd * tof((vsb)load16(blk + 16 * (192 + g)));
    std::memcpy(d[g], &v, 64);
  }
  const __m512i n15 = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3), top = _mm512_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h)
    // low 4 bits: runs 64 h + l (s = 0, 2) or 64 h + 32 + l (s = 1, 3); top 2 bits: runs 128 + 32 h + l
    for (int k = 0; k < 2; ++k) {  // values 128 h + 32 s + 16 k + l for l in 0..15: group 8 h + 2 s + k
      __m512i q[2][4], hb[4];  // each run permuted once for the groups that read it (a decode product 1.4x faster)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int l = 16 * k + 4 * j;
        q[0][j] = by_row(blk + 16 * (64 * h + l));
        q[1][j] = by_row(blk + 16 * (64 * h + 32 + l));
        hb[j] = by_row(blk + 16 * (128 + 32 * h + l));
      }
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        __m512i u[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m512i low = s < 2 ? _mm512_and_si512(q[s % 2][j], n15) : high4(q[s % 2][j]);
          const __m512i high = s == 0 ? _mm512_slli_epi16(_mm512_and_si512(hb[j], two), 4)
                               : s == 1 ? _mm512_and_si512(_mm512_slli_epi16(hb[j], 2), top)
                               : s == 2 ? _mm512_and_si512(hb[j], top)
                                        : _mm512_and_si512(_mm512_srli_epi16(hb[j], 2), top);
          u[j] = _mm512_or_si512(low, high);
        }
        const __m512 dg = _mm512_loadu_ps(d[8 * h + 2 * s + k]);
        f(Vectors4{}, 128 * h + 32 * s + 16 * k, u, dg, _mm512_mul_ps(dg, _mm512_set1_ps(-32.0f)));
      }
    }
}

template <int R, class F>
void Q8_0x16::dot_groups(const uint8_t* blk, F&& f) {
  __m512i u[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) u[j] = _mm512_xor_si512(by_row(blk + 32 + 64 * j), _mm512_set1_epi8((char)0x80));
  f(Vectors8{}, 0, u, m512(f16_fields(blk)), _mm512_setzero_ps());
}

template <int R, class F>
void I8x16::dot_groups(const uint8_t* blk, F&& f) {
  __m512i u[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) u[j] = _mm512_xor_si512(by_row(blk + 64 * j), _mm512_set1_epi8((char)0x80));
  f(Vectors8{}, 0, u, _mm512_set1_ps(1.0f), _mm512_setzero_ps());
}

template <int G>
template <int R, class F>
void I4x16<G>::dot_groups(const uint8_t* blk, F&& f) {
  const __m512 d = _mm512_loadu_ps(blk), m = _mm512_loadu_ps(blk + 64);
  const uint8_t* run = blk + 128;
  if constexpr (G == 32) {  // runs 4 j .. 4 j + 3: values 4 j + a (low nibbles), 16 + 4 j + a (high)
    __m512i u[8];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = by_row(run + 64 * j);
      u[j] = low4(v);
      u[4 + j] = high4(v);
    }
    f(Vectors8{}, 0, u, d, m);
  } else {  // runs 32 c .. 32 c + 31: values 32 c .. (low nibbles) and G / 2 + 32 c .. (high), as Q4_K's chunks
    for (int c = 0; c < G / 64; ++c) {
      __m512i v[8], u[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) v[j] = by_row(run + 16 * (32 * c + 4 * j));
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) u[j] = low4(v[j]);
      f(Vectors8{}, 32 * c, u, d, m);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) u[j] = high4(v[j]);
      f(Vectors8{}, G / 2 + 32 * c, u, d, m);
    }
  }
}

// acc (lane i: weight row i) plus one input row's share of a group of 4 N values from k on: d * s * sum(u * X)
// + m * sum(x~), from the exact sums of u with the row's three levels (dot), less BIAS * each level's sum where
// UNBIAS (matmul_tiles_amx takes signed values instead: the same sums), combined and rounded once
// (matmul_tiles_dot and matmul_tiles_amx: the same bits). The formats with a bias have no min (m = 0), kvgen's
// int8 no d either (1: its rows' scales multiply the finished sums)
template <class T, int N, bool UNBIAS>
inline __m512 add_group(__m512 acc, const __m512i (&dot)[3], __m512 d, __m512 m, const RoundedX& x, int64_t r,
                        int64_t k) {
  const int64_t K = x.K;
  __m512i level[3] = {dot[0], dot[1], dot[2]};
  if constexpr (UNBIAS && dot_bias<T>() != 0)
    for (int l = 0; l < 3; ++l)
      level[l] = _mm512_sub_epi32(
          level[l], _mm512_set1_epi32(dot_bias<T>() * x.level_sums[(r * 3 + l) * (K / 32) + k / 32]));
  __m512 sum;  // sum(u * X) = level 0 * 2^14 + level 1 * 2^7 + level 2, rounded once to float32
  if constexpr (dot_bias<T>() == 0) {  // in int32: |X| <= XQ_MAX and u < 32 (32 values) or 64 (16)
    // (conversions and multiply-adds share the multiply pipes with vpdpbusd: 512-row products 5-13% faster)
    sum = _mm512_cvtepi32_ps(
        _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(level[0], 14), _mm512_slli_epi32(level[1], 7)), level[2]));
  } else {  // Q8_0's values + 128 reach 32 * 255 * XQ_MAX: in float32 (the inner sum is exact)
    sum = _mm512_cvtepi32_ps(level[2]);
    sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(level[1]), _mm512_set1_ps(128.0f), sum);
    sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(level[0]), _mm512_set1_ps(16384.0f), sum);
  }
  const __m512 s = _mm512_set1_ps(x.scales[r * (K / 32) + k / 32]);
  if constexpr (has_row_scale<T>()) return _mm512_fmadd_ps(s, sum, acc);
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, s), sum, acc);
  if constexpr (dot_bias<T>() != 0) return acc;
  float xs = x.sums[r * (K / 16) + k / 16];
  if constexpr (N == 8) xs += x.sums[r * (K / 16) + k / 16 + 1];
  return _mm512_fmadd_ps(m, _mm512_set1_ps(xs), acc);
}
#endif

}  // namespace kvgen
