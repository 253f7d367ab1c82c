// Weight formats: GGUF's block types, kvgen's int8/int4 rows and float rows, and the same blocks in tiles of 16
// rows. Each format says how a block decodes (decode: the float32 path and dequantization); the tiles' walkers
// and integer groups are in tiles.h. dispatch() maps a format code to its type.
//
// A weight is (N, row_bytes) bytes: each output row is a run of blocks of QK values. Every format
// decodes a block into groups of small integers (as floats) sharing a scale d and a min m;
// dequantize_rows computes q * d + m with exactly the operations of gguf.quants' numpy code (the
// product kept apart from the sum by round(): no fused multiply-add), so it matches gguf bit for bit.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace kvgen {

// Each format: QK values per block, BYTES per block, GROUP values per scale, and
// decode(block, emit) calling emit(run, q, n, d, m) for each group: n vectors of 16 values from
// value 16 * run on, worth q * d + m (m only where HAS_MIN; d is 1 where not SCALED). q holds
// small integers, so the products and sums of dot.cpp are those of gguf's numpy code. F16_HEAD: a
// block of 32 that begins with its float16 d (and m), which matmul_rows converts 16 blocks at a time.

struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18, GROUP = 32;
  static constexpr bool SCALED = true, HAS_MIN = false, F16_HEAD = true;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vb q = load16(b + 2);
    const vf v[2] = {tof(q & 0x0F) - 8.0f, tof(q >> 4) - 8.0f};
    emit(0, v, 2, f16(b), 0.0f);
  }
};

struct Q4_1 {
  static constexpr int QK = 32, BYTES = 20, GROUP = 32;
  static constexpr bool SCALED = true, HAS_MIN = true, F16_HEAD = true;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vb q = load16(b + 4);
    const vf v[2] = {tof(q & 0x0F), tof(q >> 4)};
    emit(0, v, 2, f16(b), f16(b + 2));
  }
};

// 5-bit values of Q5_0/Q5_1: the low 4 bits in nibbles, the 5th in a 32-bit mask
inline void q5_values(const uint8_t* qh_bytes, const uint8_t* qs, vf* v) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const vb q = load16(qs);
  const vi h = (vi)(((vu{} + qh) >> (vu)LANE) & 1u);
  const vi h2 = (vi)(((vu{} + (qh >> 16)) >> (vu)LANE) & 1u);
  v[0] = __builtin_convertvector(toi(q & 0x0F) | (h << 4), vf);
  v[1] = __builtin_convertvector(toi(q >> 4) | (h2 << 4), vf);
}

struct Q5_0 {
  static constexpr int QK = 32, BYTES = 22, GROUP = 32;
  static constexpr bool SCALED = true, HAS_MIN = false, F16_HEAD = true;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    vf v[2];
    q5_values(b + 2, b + 6, v);
    v[0] -= 16.0f;
    v[1] -= 16.0f;
    emit(0, v, 2, f16(b), 0.0f);
  }
};

struct Q5_1 {
  static constexpr int QK = 32, BYTES = 24, GROUP = 32;
  static constexpr bool SCALED = true, HAS_MIN = true, F16_HEAD = true;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    vf v[2];
    q5_values(b + 4, b + 8, v);
    emit(0, v, 2, f16(b), f16(b + 2));
  }
};

struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34, GROUP = 32;
  static constexpr bool SCALED = true, HAS_MIN = false, F16_HEAD = true;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vf v[2] = {tof((vsb)load16(b + 2)), tof((vsb)load16(b + 18))};
    emit(0, v, 2, f16(b), 0.0f);
  }
};

// Q4_K / Q5_K: eight sub-blocks of 32 with 6-bit scales and mins under two float16 super-scales
inline void k_scales(const uint8_t* b, float* d, float* m) {
  const float dd = f16(b), dmin = f16(b + 2);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 4; ++j) {
    d[j] = dd * (float)(s[j] & 0x3F);
    m[j] = dmin * (float)(s[j + 4] & 0x3F);
    d[j + 4] = dd * (float)((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
    m[j + 4] = dmin * (float)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
  }
}

struct Q4_K {
  static constexpr int QK = 256, BYTES = 144, GROUP = 32;
  static constexpr bool SCALED = true, HAS_MIN = true;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    float d[8], m[8];
    k_scales(b, d, m);
    for (int c = 0; c < 4; ++c) {
      const vb q0 = load16(b + 16 + 32 * c), q1 = load16(b + 32 + 32 * c);
      const vf lo[2] = {tof(q0 & 0x0F), tof(q1 & 0x0F)}, hi[2] = {tof(q0 >> 4), tof(q1 >> 4)};
      emit(4 * c, lo, 2, d[2 * c], -m[2 * c]);
      emit(4 * c + 2, hi, 2, d[2 * c + 1], -m[2 * c + 1]);
    }
  }
};

struct Q5_K {
  static constexpr int QK = 256, BYTES = 176, GROUP = 32;
  static constexpr bool SCALED = true, HAS_MIN = true;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    float d[8], m[8];
    k_scales(b, d, m);
    const vb h0 = load16(b + 16), h1 = load16(b + 32);  // bit s of qh[j]: the 5th bit of value 32 s + j
    for (int c = 0; c < 4; ++c) {
      const vb q0 = load16(b + 48 + 32 * c), q1 = load16(b + 64 + 32 * c);
      const int s0 = 2 * c, s1 = 2 * c + 1;
      const vf lo[2] = {tof((q0 & 0x0F) | (((h0 >> s0) & 1) << 4)), tof((q1 & 0x0F) | (((h1 >> s0) & 1) << 4))};
      const vf hi[2] = {tof((q0 >> 4) | (((h0 >> s1) & 1) << 4)), tof((q1 >> 4) | (((h1 >> s1) & 1) << 4))};
      emit(4 * c, lo, 2, d[2 * c], -m[2 * c]);
      emit(4 * c + 2, hi, 2, d[2 * c + 1], -m[2 * c + 1]);
    }
  }
};

struct Q6_K {
  static constexpr int QK = 256, BYTES = 210, GROUP = 16;
  static constexpr bool SCALED = true, HAS_MIN = false;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float dd = f16(b + 208);
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 2; ++k) {  // lanes 16 k .. 16 k + 15 of each run of 32 values
        const vb l0 = load16(b + 64 * h + 16 * k), l1 = load16(b + 64 * h + 32 + 16 * k);
        const vb hb = load16(b + 128 + 32 * h + 16 * k);
        const vf q[4] = {tof((l0 & 0x0F) | ((hb & 3) << 4)) - 32.0f, tof((l1 & 0x0F) | (((hb >> 2) & 3) << 4)) - 32.0f,
                         tof((l0 >> 4) | (((hb >> 4) & 3) << 4)) - 32.0f, tof((l1 >> 4) | ((hb >> 6) << 4)) - 32.0f};
        const int run = 8 * h + k;  // values 128 h + 32 s + 16 k + lane: run 8 h + 2 s + k, its own scale
        for (int s = 0; s < 4; ++s) emit(run + 2 * s, q + s, 1, dd * (float)sc[run + 2 * s], 0.0f);
      }
    }
  }
};

struct F16 {
  static constexpr int QK = 32, BYTES = 64, GROUP = 32;
  static constexpr bool SCALED = false, HAS_MIN = false;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    vf w[2];
#if defined(__AVX512F__)
    for (int i = 0; i < 2; ++i) {
      __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * i)));
      std::memcpy(&w[i], &v, 64);
    }
#elif defined(__F16C__)
    for (int i = 0; i < 4; ++i) {
      __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * i)));
      std::memcpy(reinterpret_cast<char*>(w) + 32 * i, &v, 32);
    }
#else
    for (int j = 0; j < 32; ++j) w[j / 16][j % 16] = f16(b + 2 * j);
#endif
    emit(0, w, 2, 1.0f, 0.0f);
  }
};

// float32 rows (GGML type 0): a float model's own weights, read in place by the fused decode ops
struct F32 {
  static constexpr int QK = 32, BYTES = 128, GROUP = 32;
  static constexpr bool SCALED = false, HAS_MIN = false;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vf w[2] = {loadf(reinterpret_cast<const float*>(b)), loadf(reinterpret_cast<const float*>(b + 64))};
    emit(0, w, 2, 1.0f, 0.0f);
  }
};

struct BF16 {
  static constexpr int QK = 32, BYTES = 64, GROUP = 32;
  static constexpr bool SCALED = false, HAS_MIN = false;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    vh h[2];
    std::memcpy(h, b, 64);
    const vf w[2] = {(vf)(__builtin_convertvector(h[0], vu) << 16), (vf)(__builtin_convertvector(h[1], vu) << 16)};
    emit(0, w, 2, 1.0f, 0.0f);
  }
};

// kvgen's int4 rows (quantized at load): blocks of G values as float32 scale, float32 min, G/2
// bytes of nibbles (low nibbles: the first G/2 values, high nibbles: the rest), w = q * d + m
template <int G>
struct I4 {
  static constexpr int QK = G, BYTES = 8 + G / 2, GROUP = G;
  static constexpr bool SCALED = true, HAS_MIN = true;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    vf v[G / 16];
    for (int i = 0; i < G / 32; ++i) {
      const vb q = load16(b + 8 + 16 * i);
      v[i] = tof(q & 0x0F);
      v[G / 32 + i] = tof(q >> 4);
    }
    emit(0, v, G / 16, f32(b), f32(b + 4));
  }
};

// kvgen's int8 rows: K int8 values, then the row's float32 scale; blocks carry no scale, the
// row scale multiplies the finished dot product (and the dequantized row)
struct I8 {
  static constexpr int QK = 32, BYTES = 32, GROUP = 32;
  static constexpr bool SCALED = false, HAS_MIN = false;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vf v[2] = {tof((vsb)load16(b)), tof((vsb)load16(b + 16))};
    emit(0, v, 2, 1.0f, 0.0f);
  }
};

// GGUF blocks in tiles of 16 rows (kvgen.models.packed.tile_rows), format 2000 + the GGML type: for
// each GGUF block of columns, the 16 rows' 2-byte head fields one field after the other (float16 d,
// then float16 m where the format has one), then the rest of the block bytes in runs of 16: run j
// holds byte j of the 16 rows' remaining bytes, one row per lane. A tile block holds the bytes of
// 16 GGUF blocks. A one-row product decodes 16 rows' values per instruction and multiplies them
// by one broadcast input value: no per-row sums. block<CH>(blk, emit, close) walks one tile block:
// emit(slot, column, v) for the 16 rows' values v of each column, close(slot, count, d, m, group)
// where the sums of slots slot..slot + count - 1 are done (the sums of a group of values sharing
// a scale, in CH or more independent chains); SLOTS<CH> slots in all. For 32-value blocks with
// one scale (block32): columns(state, run, j, emit) calls emit(column, v) for the columns whose
// values run j holds; state(block) is what columns needs of a tile block beyond its run (Q5_0:
// the 16 rows' 5th bits). Q8_0 is tiled only where integer dot products take it (Q8_0x16, below).
template <class G, int H>
struct Tiled : G {
  static constexpr bool TILED = true;
  static constexpr int TILE = 16, HEAD = H, RUNS = G::BYTES - H;  // head bytes per GGUF block; runs of 16 bytes per tile block
  using Gguf = G;
  struct None {};
  static None state(const uint8_t*) { return {}; }
  template <int CH> static constexpr int SLOTS = CH;
};

// 4-bit values, nibble + BASE: run j holds columns j (low nibbles) and j + 16 (high nibbles)
template <class G, int H, int BASE>
struct Nibbles16 : Tiled<G, H> {
  template <class E> static void columns(typename Tiled<G, H>::None, const uint8_t* run, int j, E&& emit);
  template <int CH, class E, class C> static void block(const uint8_t* blk, E&& emit, C&& close);
  static constexpr bool DOT = true;  // integer dot products (AVX-512 VNNI)
  static constexpr int CODE_MAX = 15;  // and AVX2's (vpmaddubsw): the largest stored value it takes
  static constexpr int QUADS_FIRST = H, QUADS_TAIL = 0;  // the runs of quad_runs (below): all but the head's
  template <int R, class F> static void dot_groups(const uint8_t* blk, F&& f);
};
using Q4_0x16 = Nibbles16<Q4_0, 2, -8>;
using Q4_1x16 = Nibbles16<Q4_1, 4, 0>;

struct Q5_0x16 : Tiled<Q5_0, 6> {  // head: d, then the 32-bit mask of 5th bits as two 2-byte fields
  struct High { vn low[DC], high[DC]; };  // each row's mask << 4 (bits 0-15 used), and the mask itself
  static High state(const uint8_t* blk);
  template <class E> static void columns(const High& h, const uint8_t* run, int j, E&& emit);
  template <int CH, class E, class C> static void block(const uint8_t* blk, E&& emit, C&& close);
  static constexpr bool DOT = true;  // integer dot products (AVX-512 VNNI)
  static constexpr int CODE_MAX = 31;  // and AVX2's
  static constexpr int QUADS_FIRST = 6, QUADS_TAIL = 0;
  template <int R, class F> static void dot_groups(const uint8_t* blk, F&& f);
};

// Q8_0: run j holds value j of the 16 rows (signed bytes); only where the integer dot products run
// (the float32 one-row product streams Q8_0 rows at the memory's speed on AVX-512, 2 threads: tiles did not help;
// on AVX2 it ran at 5 Gw/s on one thread, compute-bound)
struct Q8_0x16 : Tiled<Q8_0, 2> {
  template <class E> static void columns(None, const uint8_t* run, int j, E&& emit);
  template <int CH, class E, class C> static void block(const uint8_t* blk, E&& emit, C&& close);
  static constexpr bool DOT = true;  // integer dot products (AVX-512 VNNI)
  static constexpr int BIAS = 128;  // dot_groups gives value + 128 (unsigned)
  // and AVX2's, on the signed values (dot2.h's matmul_q8_0: no dot_groups, no CODE_MAX)
  static constexpr int QUADS_FIRST = 2, QUADS_TAIL = 0;
  template <int R, class F> static void dot_groups(const uint8_t* blk, F&& f);
};

// head: d and dmin; runs 0-11: the 6-bit scales and mins (k_scales' bytes), runs 12-139: the nibbles
struct Q4_Kx16 : Tiled<Q4_K, 4> {
  template <int CH> static constexpr int SLOTS = 2 * std::max(1, CH / 2);  // two groups open at a time
  template <int CH, class E, class C> static void block(const uint8_t* blk, E&& emit, C&& close);
  static constexpr bool DOT = true;  // integer dot products (AVX-512 VNNI)
  static constexpr int CODE_MAX = 15;  // and AVX2's
  static constexpr int QUADS_FIRST = 4 + 12, QUADS_TAIL = 0;  // the nibbles
  template <int R, class F> static void dot_groups(const uint8_t* blk, F&& f);
};

// no head (d is the last two bytes of a block): runs 0-127 the low 4 bits, 128-191 the high 2 bits,
// 192-207 the int8 scales of the 16 groups of 16, 208-209 the bytes of d
struct Q6_Kx16 : Tiled<Q6_K, 0> {
  template <int CH> static constexpr int SLOTS = 4 * std::max(1, CH / 4);  // four groups open at a time
  template <int CH, class E, class C> static void block(const uint8_t* blk, E&& emit, C&& close);
  static constexpr bool DOT = true;  // integer dot products (AVX-512 VNNI)
  static constexpr int CODE_MAX = 63;  // and AVX2's
  static constexpr int QUADS_FIRST = 0, QUADS_TAIL = 18;  // the low 4 and high 2 bits
  template <int R, class F> static void dot_groups(const uint8_t* blk, F&& f);
  // dot_groups reads a 3360-byte tile block end first (scales, d), then three interleaved runs: the
  // hardware's prefetchers lag, and a one-row product from memory ran at half its speed from cache
  static constexpr bool PREFETCH = true;
};

// kvgen's int8 rows in tiles of 16 (format 3008; only where integer dot products run): per block of 32 columns,
// run j holds value j of the 16 rows (signed bytes), as Q8_0's tiles without a d; after the tile's last block,
// the 16 rows' float32 scales (ROW_SCALES), which multiply the finished sums
struct I8x16 : Tiled<I8, 0> {
  static constexpr bool DOT = true, ROW_SCALES = true;
  static constexpr int BIAS = 128;
  template <int R, class F> static void dot_groups(const uint8_t* blk, F&& f);
};

// kvgen's int4 groups in tiles of 16 rows (format 2000 + 1000 + G; only where integer dot products run): per
// group, the 16 rows' float32 scales, then their float32 mins (head fields of FIELD = 4 bytes), then the G / 2
// bytes of nibbles in runs of 16 (run j: byte j of the 16 rows: value j in its low nibble, G / 2 + j in its high)
template <int G>
struct I4x16 : Tiled<I4<G>, 8> {
  static constexpr int FIELD = 4;
  static constexpr bool DOT = true;
  template <int R, class F> static void dot_groups(const uint8_t* blk, F&& f);
};

// AVX2's integer products (KVGEN_DOT2) read a tile block's value runs 4 at a time, 64 bytes as simd.h's Quads (rows
// 0-3, 8-11, then rows 4-7, 12-15; each row's bytes from runs 0, 2, 1, 3). There, tile_rows stores runs
// quad_runs()[0] .. quad_runs()[1] - 1 of a tile block (run j: byte j of the GGUF block) 4 at a time in that order,
// and the products load them as they lie: over an L2-resident tile a one-row Q4_K product ran 1.2-1.3x faster than
// with two vpermq and four unpacks per 64 bytes (AMD EPYC Zen 3). Elsewhere runs stay in row order: {0, 0}
template <class T>
constexpr std::array<int, 2> quad_runs() {
#if defined(KVGEN_DOT2)
  if constexpr (requires { T::QUADS_FIRST; }) return {T::QUADS_FIRST, T::Gguf::BYTES - T::QUADS_TAIL};
#endif
  return {0, 0};
}

template <class T>
constexpr bool tiled() {
  if constexpr (requires { T::TILED; }) return T::TILED;
  return false;
}
template <class T>
constexpr int tile_rows() {
  if constexpr (tiled<T>()) return T::TILE;
  return 1;
}

template <class T>
constexpr bool f16_head() {
  if constexpr (tiled<T>()) return false;
  if constexpr (requires { T::F16_HEAD; }) return T::F16_HEAD;
  return false;
}

template <class T>
constexpr bool has_row_scale() { return false; }
template <>
constexpr bool has_row_scale<I8>() { return true; }
template <>
constexpr bool has_row_scale<I8x16>() { return true; }

// bytes of a tiled format's head fields (float16 d and m: 2; kvgen's float32 int4 scales and mins: 4)
template <class T>
constexpr int field_bytes() {
  if constexpr (requires { T::FIELD; }) return T::FIELD;
  return 2;
}

// whether T's tiles take integer dot products (dot_groups: AVX-512 VNNI, or AVX2 for stored values of at most 6 bits
// unsigned, CODE_MAX, and Q8_0's signed bytes: the formats AVX2 reads as Quads) on this CPU
template <class T>
constexpr bool has_dot() {
#if defined(KVGEN_DOT8)
  return requires { T::DOT; };
#elif defined(KVGEN_DOT2)
  return requires { T::QUADS_FIRST; };
#else
  return false;
#endif
}

// what dot_groups adds to the stored values to make them unsigned (subtracted again: BIAS * sum(X))
template <class T>
constexpr int dot_bias() {
  if constexpr (requires { T::BIAS; }) return T::BIAS;
  return 0;
}

template <class T>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, float* out,
                     int64_t ld);

// the tiles whose first row lies in n0..n1: 16 rows each, back to GGUF blocks (AVX2's Quads back in row order
// first), then the format's own decode
template <class T>
void dequantize_tiles(const uint8_t* w, int64_t n0, int64_t n1, int64_t K, float* out, int64_t ld) {
  using G = typename T::Gguf;
  constexpr int FIELD = field_bytes<T>(), TAIL = has_row_scale<T>() ? 4 : 0;  // TAIL: a row's scale after its blocks
  const int64_t nb = K / G::QK, TB = 16 * G::BYTES, rb = nb * G::BYTES + TAIL;
  constexpr std::array<int, 2> q = quad_runs<T>();
  std::vector<uint8_t> rows(16 * rb), runs(q[1] > q[0] ? nb * TB : 0);  // one tile as 16 rows; its runs in row order
  for (int64_t t = (n0 + 15) / 16; t * 16 < n1; ++t) {
    const uint8_t* tile = w + t * 16 * rb;
#if defined(KVGEN_DOT2)
    if constexpr (q[1] > q[0]) {
      std::memcpy(runs.data(), tile, nb * TB);
      for (int64_t b = 0; b < nb; ++b)
        for (int j = q[0]; j < q[1]; j += 4) {
          uint8_t* four = runs.data() + b * TB + 16 * j;
          rows_from_quads(four, four);
        }
      tile = runs.data();
    }
#endif
    constexpr int WHOLE = T::HEAD + (G::BYTES - T::HEAD) / 16 * 16;  // runs transposed back 16 at a time
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* g = rows.data() + b * G::BYTES;  // row i's block b at g + i rb
      for (int v = T::HEAD; v < WHOLE; v += 16) transpose16(tile + b * TB + 16 * v, 16, g + v, rb);
      for (int i = 0; i < 16; ++i) {
        for (int f = 0; f < T::HEAD / FIELD; ++f)
          std::memcpy(g + i * rb + FIELD * f, tile + b * TB + 16 * FIELD * f + FIELD * i, FIELD);
        for (int v = WHOLE; v < G::BYTES; ++v) g[i * rb + v] = tile[b * TB + 16 * v + i];
      }
    }
    for (int i = 0; i < 16; ++i) std::memcpy(rows.data() + i * rb + nb * G::BYTES, tile + nb * TB + TAIL * i, TAIL);
    dequantize_rows<G>(rows.data(), rb, 0, 16, K, out + t * 16 * ld, ld);
  }
}

template <class T>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, float* out,
                     int64_t ld) {
  if constexpr (tiled<T>()) return dequantize_tiles<T>(w, n0, n1, K, out, ld);
  const int64_t nb = K / T::QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float* o = out + n * ld;
    const vf s = splat(has_row_scale<T>() ? f32(wr + K) : 1.0f);
    for (int64_t b = 0; b < nb; ++b) {
      float* ob = o + b * T::QK;
      T::decode(wr + b * T::BYTES, [&](int run, const vf* q, int count, float d, float m) {
        for (int i = 0; i < count; ++i) {
          vf v = q[i];
          if constexpr (T::SCALED) v = round(v * splat(d));
          if constexpr (T::HAS_MIN) v = v + splat(m);
          if constexpr (has_row_scale<T>()) v = v * s;
          std::memcpy(ob + 16 * (run + i), &v, 64);
        }
      });
    }
  }
}

// format codes: GGML's type ids; kvgen's own formats above 1000; formats in tiles of 16 rows: 2000 + the format.
// Calls f(T{}) for the format's type; false (f not called) for a format this build has no kernel for
template <class F>
bool dispatch(int64_t format, F&& f) {
  switch (format) {
    case 0: f(F32{}); break;
    case 1: f(F16{}); break;
    case 2: f(Q4_0{}); break;
    case 3: f(Q4_1{}); break;
    case 6: f(Q5_0{}); break;
    case 7: f(Q5_1{}); break;
    case 8: f(Q8_0{}); break;
    case 12: f(Q4_K{}); break;
    case 13: f(Q5_K{}); break;
    case 14: f(Q6_K{}); break;
    case 30: f(BF16{}); break;
    case 2002: f(Q4_0x16{}); break;
    case 2003: f(Q4_1x16{}); break;
    case 2006: f(Q5_0x16{}); break;
    case 2008: f(Q8_0x16{}); break;
    case 2012: f(Q4_Kx16{}); break;
    case 2014: f(Q6_Kx16{}); break;
    case 1008: f(I8{}); break;
    case 1032: f(I4<32>{}); break;
    case 1064: f(I4<64>{}); break;
    case 1128: f(I4<128>{}); break;
#if defined(KVGEN_DOT8)  // kvgen's formats in tiles of 16 rows: 2000 + the format in rows
    case 3008: f(I8x16{}); break;
    case 3032: f(I4x16<32>{}); break;
    case 3064: f(I4x16<64>{}); break;
    case 3128: f(I4x16<128>{}); break;
#endif
    default: return false;
  }
  return true;
}

}  // namespace kvgen
