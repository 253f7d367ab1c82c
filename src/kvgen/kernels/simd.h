// Vector types and primitives for the kernels, per instruction set (AVX-512, AVX2, SSE), the integer
// dot-product primitives where AVX-512 VNNI runs (KVGEN_DOT8) or AVX2 only (KVGEN_DOT2) and the flags of the
// tile unit (AMX).
// Plain C++ and intrinsics: nothing here knows torch.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define KVGEN_DOT8 1  // integer dot products (vpdpbusd) for the tiled formats: dot.cpp
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVGEN_AMX 1  // the same sums on Intel's tile unit: amx.h
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVGEN_AMX_BF16 1  // BF16 weights on the tile unit: amx.h
#endif
#endif
#elif defined(__AVX2__)
#define KVGEN_DOT2 1  // the same integer sums by vpmaddubsw for the 4-6-bit tiled formats and Q8_0: dot2.h, tiles2.h
#endif
#if defined(KVGEN_DOT8) || defined(KVGEN_DOT2)
#define KVGEN_DOTS 1  // some integer dot products: the input rounded to three int8 levels (dot.h's RoundedX)
#endif

namespace kvgen {

typedef float vf __attribute__((vector_size(64)));      // 16 float32 lanes (2 registers on AVX2)
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(16)));
typedef int8_t vsb __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(32)));
// the native vector (one register): a vf is DC of them
#if defined(__AVX512F__)
typedef float vn __attribute__((vector_size(64)));
#else
typedef float vn __attribute__((vector_size(32)));
#endif
constexpr int64_t LN = sizeof(vn) / sizeof(float), DC = 16 / LN;
// a float16's bits as float32 (exact)
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, bits = h & 0x7FFF;
  uint32_t out;
  if (bits >= 0x7C00) {  // infinity, NaN
    out = sign | 0x7F800000 | (bits & 0x3FF) << 13;
  } else if (bits >= 0x0400) {  // normal: the exponent's bias 15 -> 127
    out = sign | (bits + (112 << 10)) << 13;
  } else {  // zero, subnormal: bits * 2^-24, exact in float32
    const float f = (float)bits * 0x1p-24f;
    std::memcpy(&out, &f, 4);
    out |= sign;
  }
  float f;
  std::memcpy(&f, &out, 4);
  return f;
#endif
}

// an empty asm the value must pass through: the compiler cannot fuse a product into a later sum
inline vf round(vf x) {
#if defined(__AVX512F__)
  asm("" : "+v"(x));
#elif defined(__AVX__)  // 16 lanes span two registers: pass each 32-byte half (no "v" register holds 64 bytes)
  typedef float half __attribute__((vector_size(32)));
  half h[2];
  std::memcpy(h, &x, 64);
  asm("" : "+x"(h[0]), "+x"(h[1]));
  std::memcpy(&x, h, 64);
#else  // SSE: four 16-byte quarters
  typedef float quarter __attribute__((vector_size(16)));
  quarter h[4];
  std::memcpy(h, &x, 64);
  asm("" : "+x"(h[0]), "+x"(h[1]), "+x"(h[2]), "+x"(h[3]));
  std::memcpy(&x, h, 64);
#endif
  return x;
}
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline vb load16(const uint8_t* p) {
  vb v;
  std::memcpy(&v, p, 16);
  return v;
}
inline vf loadf(const float* p) {
  vf v;
  std::memcpy(&v, p, 64);
  return v;
}
#if defined(__AVX512F__)  // GCC may scalarise __builtin_convertvector from bytes: widen with one instruction
inline vi toi(vb v) {
  __m128i b;
  std::memcpy(&b, &v, 16);
  const __m512i w = _mm512_cvtepu8_epi32(b);
  vi r;
  std::memcpy(&r, &w, 64);
  return r;
}
inline vf tof(vb v) { return __builtin_convertvector(toi(v), vf); }
inline vf tof(vsb v) {
  __m128i b;
  std::memcpy(&b, &v, 16);
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  vf r;
  std::memcpy(&r, &f, 64);
  return r;
}
#elif !defined(__AVX2__)
inline vi toi(vb v) { return __builtin_convertvector(v, vi); }
inline vf tof(vb v) { return __builtin_convertvector(toi(v), vf); }  // via int32: direct is scalarised
inline vf tof(vsb v) { return __builtin_convertvector(toi((vb)v ^ 0x80) - 128, vf); }  // int8 via uint8: direct is scalarised
#else  // AVX2: GCC scalarises 16-lane conversions; widen each 8-byte half with one instruction
inline vi toi(vb v) {
  __m128i b;
  std::memcpy(&b, &v, 16);
  const __m256i h[2] = {_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(b, b))};
  vi r;
  std::memcpy(&r, h, 64);
  return r;
}
template <class Widen>  // Widen: 8 bytes -> 8 int32 lanes
inline vf tof_halves(const void* v, Widen widen) {
  __m128i b;
  std::memcpy(&b, v, 16);
  const __m256 h[2] = {_mm256_cvtepi32_ps(widen(b)), _mm256_cvtepi32_ps(widen(_mm_unpackhi_epi64(b, b)))};
  vf r;
  std::memcpy(&r, h, 64);
  return r;
}
inline vf tof(vb v) { return tof_halves(&v, [](__m128i b) { return _mm256_cvtepu8_epi32(b); }); }
inline vf tof(vsb v) { return tof_halves(&v, [](__m128i b) { return _mm256_cvtepi8_epi32(b); }); }
#endif
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}
inline float f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
const vi LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline float hsum(const vn* a) {  // the sum of DC native vectors' lanes
  vn s = a[0];
  for (int c = 1; c < DC; ++c) s += a[c];
#if defined(__AVX512F__)
  __m512 v;
  std::memcpy(&v, &s, 64);
  return _mm512_reduce_add_ps(v);
#elif defined(__AVX__)
  __m256 v;
  std::memcpy(&v, &s, 32);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#else
  float t = 0.0f;
  for (int j = 0; j < LN; ++j) t += s[j];
  return t;
#endif
}

// 16 float16 values to float32
inline void f16x16(const uint16_t* h, float* out) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))));
#elif defined(__F16C__)
  for (int i = 0; i < 2; ++i)
    _mm256_storeu_ps(out + 8 * i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8 * i))));
#else
  for (int i = 0; i < 16; ++i) out[i] = half_to_float(h[i]);
#endif
}

// d and m of `count` (<= 16) F16_HEAD blocks `stride` bytes apart: each block's first 4 bytes are
// float16 d, then float16 m (Q4_1, Q5_1) or its first values (m unused); lanes past count are 0
inline void f16_heads(const uint8_t* b, int count, int stride, float* d, float* m) {
#if defined(__AVX512F__)
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(stride));
  const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)((1u << count) - 1), idx, b, 1);
  _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
  _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), low = _mm256_set1_epi32(0xFFFF);
  for (int h = 0; h < 2; ++h) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count - 8 * h), lane);
    const __m256i idx = _mm256_mullo_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(8 * h)), _mm256_set1_epi32(stride));
    const __m256i v = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(b), idx, mask, 1);
    const __m256i dv = _mm256_and_si256(v, low), mv = _mm256_srli_epi32(v, 16);
    _mm256_storeu_ps(d + 8 * h, _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(dv), _mm256_extracti128_si256(dv, 1))));
    _mm256_storeu_ps(m + 8 * h, _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(mv), _mm256_extracti128_si256(mv, 1))));
  }
#else
  for (int j = 0; j < 16; ++j) {
    d[j] = j < count ? f16(b + j * stride) : 0.0f;
    m[j] = j < count ? f16(b + j * stride + 2) : 0.0f;
  }
#endif
}

// 16 float16 values (2 bytes each, one after the other) to float32 lanes
inline vf f16_fields(const void* p) {
  uint16_t h[16];
  std::memcpy(h, p, 32);
  float f[16];
  f16x16(h, f);
  return loadf(f);
}

inline void to_lanes(const vf& v, vn* out) { std::memcpy(out, &v, 64); }

// a buffer left uninitialised, for what its user writes in full (zeroing a 512-row prefill's rounded input took as
// long as rounding it)
template <class V>
struct Written {
  std::unique_ptr<V[]> values;
  explicit Written(int64_t n = 0) : values(new V[n]) {}
  V* data() const { return values.get(); }
  V& operator[](int64_t i) const { return values[i]; }
};

// exp of 8 or 16 lanes: 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p of degree 6 (Cephes'
// expf, within 2 ulp); lanes below -87 (masked scores: -inf) give exactly 0
template <class V>
inline V vexp(V x) {
  using I = decltype(x < x);  // the same lanes as int32
  const I zero_mask = x > -87.0f;
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 88.0f ? V{} + 88.0f : x;
  const V half = (x > 0.0f) ? V{} + 0.5f : V{} - 0.5f;  // round to nearest, halves away from 0
  const V n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f + half, I), V);
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (I)p + (__builtin_convertvector(n, I) << 23);
  return (V)(bits & zero_mask);
}

// tanh of 8 or 16 lanes (Cephes' tanhf, within a few ulp): an odd polynomial below 0.625, else
// 1 - 2 / (exp(2 |x|) + 1) with the sign of x
template <class V>
inline V vtanh(V x) {
  const V a = x < 0.0f ? -x : x;
  const V big = 1.0f - 2.0f / (vexp(a + a) + 1.0f);
  const V z = x * x;
  const V small =
      ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z -
       3.33332819422e-1f) * z * x + x;
  return a < 0.625f ? small : (x < 0.0f ? -big : big);
}

template <class V> inline V vload(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <class V> inline void vstore(float* p, V v) { std::memcpy(p, &v, sizeof(V)); }
template <class V> inline V vmax(V a, V b) { return a > b ? a : b; }

#if defined(KVGEN_DOT8)
inline __m512 m512(const vf& v) {
  __m512 out;
  std::memcpy(&out, &v, 64);
  return out;
}

// byte tables built at compile time: a function-local static vector cost every use a guard check and
// a load inside the products' loops
template <class F>
struct alignas(64) ByteTable {
  uint8_t bytes[64];
  constexpr ByteTable(F f) : bytes{} {
    for (int i = 0; i < 64; ++i) bytes[i] = f(i);
  }
  __m512i get() const { return _mm512_load_si512(bytes); }
};
// byte 4 i + a <- byte 16 a + i
constexpr ByteTable BY_ROW([](int b) { return (uint8_t)(16 * (b % 4) + b / 4); });

// 4 runs of 16 bytes (byte i of run a: row i) -> byte 4 i + a: each row's 4 bytes in its lane
inline __m512i by_row(const uint8_t* p) { return _mm512_permutexvar_epi8(BY_ROW.get(), _mm512_loadu_si512(p)); }
inline __m512i low4(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline __m512i high4(__m512i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }

// acc += the products of u's bytes with the 4 bytes at p in every lane (the broadcast inside the
// instruction: written separately, GCC loaded each broadcast into a register first)
inline void dpbusd_broadcast(__m512i& acc, const __m512i& u, const int8_t* p) {
  asm("vpdpbusd %[p]%{1to16%}, %[u], %[acc]"
      : [acc] "+v"(acc)
      : [u] "v"(u), [p] "m"(*reinterpret_cast<const int32_t*>(p)));
}
#endif

// out[c * out_stride + r] = in[r * stride + c] for 16 rows r and 16 columns c: four rounds of interleaves (bytes,
// pairs, quads, eights), each round pairing rows twice as far apart
inline void transpose16(const uint8_t* in, int64_t stride, uint8_t* out, int64_t out_stride) {
#if defined(__SSE2__)
  __m128i a[16], b[16];
  for (int r = 0; r < 16; ++r) a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + r * stride));
  for (int p = 0; p < 8; ++p) {  // rows 2p, 2p + 1: columns 0-7, 8-15
    b[p] = _mm_unpacklo_epi8(a[2 * p], a[2 * p + 1]);
    b[8 + p] = _mm_unpackhi_epi8(a[2 * p], a[2 * p + 1]);
  }
  for (int h = 0; h < 2; ++h)  // rows 4q .. 4q + 3: columns 8h + 0-3, 8h + 4-7
    for (int q = 0; q < 4; ++q) {
      a[8 * h + q] = _mm_unpacklo_epi16(b[8 * h + 2 * q], b[8 * h + 2 * q + 1]);
      a[8 * h + 4 + q] = _mm_unpackhi_epi16(b[8 * h + 2 * q], b[8 * h + 2 * q + 1]);
    }
  for (int g = 0; g < 4; ++g)  // rows 8o .. 8o + 7: columns 4g + 0-1, 4g + 2-3
    for (int o = 0; o < 2; ++o) {
      b[4 * g + o] = _mm_unpacklo_epi32(a[4 * g + 2 * o], a[4 * g + 2 * o + 1]);
      b[4 * g + 2 + o] = _mm_unpackhi_epi32(a[4 * g + 2 * o], a[4 * g + 2 * o + 1]);
    }
  for (int h = 0; h < 8; ++h) {  // all 16 rows: columns 2h, 2h + 1
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * h * out_stride), _mm_unpacklo_epi64(b[2 * h], b[2 * h + 1]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * h + 1) * out_stride),
                     _mm_unpackhi_epi64(b[2 * h], b[2 * h + 1]));
  }
#else
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) out[c * out_stride + r] = in[r * stride + c];
#endif
}

#if defined(KVGEN_DOT2)
// 16 rows' 4 bytes each in two registers, as by_row's one 64-byte register: lanes in the order rows 0-3, 8-11 (h[0])
// and 4-7, 12-15 (h[1]), each row's bytes from runs 0, 2, 1, 3 (what two byte and two word interleaves within
// 128-bit lanes would give; round_x stores each 4 input values in that order, to_quads orders the d and m of rows so)
struct Quads {
  __m256i h[2];
};
// 4 runs of a tile block as tile_rows stores them for AVX2 (formats.h's quad_runs: already Quads)
inline Quads load_quads(const uint8_t* p) {
  return {{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))}};
}
// 4 runs of 16 bytes (byte i of run a: row i) at p -> as Quads at out (may be p): what tile_rows stores
inline void quads_from_rows(const uint8_t* p, uint8_t* out) {
  const __m256i ab = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 0xD8);
  const __m256i cd = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 0xD8);
  // ab: runs 0, 1 of rows 0-7 | the same of rows 8-15; ac: (run 0, run 2) a row, bd: (run 1, run 3)
  const __m256i ac = _mm256_unpacklo_epi8(ab, cd), bd = _mm256_unpackhi_epi8(ab, cd);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_unpacklo_epi16(ac, bd));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_unpackhi_epi16(ac, bd));
}
// and back: Quads at p -> 4 runs in row order at out (may be p)
inline void rows_from_quads(const uint8_t* p, uint8_t* out) {
  // each row's bytes (runs 0, 2, 1, 3) -> each lane's 4 rows run by run
  const __m256i by_run = _mm256_setr_epi8(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15, 0, 4, 8, 12, 2, 6, 10,
                                          14, 1, 5, 9, 13, 3, 7, 11, 15);
  const __m256i h0 = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), by_run);
  const __m256i h1 = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), by_run);
  // h0: rows 0-3 | rows 8-11, h1: rows 4-7 | rows 12-15; lo: runs 0, 1 of rows 0-7 | of rows 8-15, hi: runs 2, 3
  const __m256i lo = _mm256_unpacklo_epi32(h0, h1), hi = _mm256_unpackhi_epi32(h0, h1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(lo, 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_permute4x64_epi64(hi, 0xD8));
}
inline Quads low4(const Quads& v) {
  const __m256i n = _mm256_set1_epi8(15);
  return {{_mm256_and_si256(v.h[0], n), _mm256_and_si256(v.h[1], n)}};
}
inline Quads high4(const Quads& v) {
  const __m256i n = _mm256_set1_epi8(15);
  return {{_mm256_and_si256(_mm256_srli_epi16(v.h[0], 4), n), _mm256_and_si256(_mm256_srli_epi16(v.h[1], 4), n)}};
}
// 16 lanes in row order -> Quads' order of rows (and back: the same exchange of 128-bit halves)
struct Lanes {
  __m256 h[2];
};
inline Lanes to_quads(const vf& v) {
  __m256 n[2];
  std::memcpy(n, &v, 64);
  return {{_mm256_permute2f128_ps(n[0], n[1], 0x20), _mm256_permute2f128_ps(n[0], n[1], 0x31)}};
}
// 16 lanes in Quads' order of rows stored at y in row order (the same exchange)
inline void store_rows(float* y, const Lanes& v) {
  _mm256_storeu_ps(y, _mm256_permute2f128_ps(v.h[0], v.h[1], 0x20));
  _mm256_storeu_ps(y + 8, _mm256_permute2f128_ps(v.h[0], v.h[1], 0x31));
}
#endif

}  // namespace kvgen
