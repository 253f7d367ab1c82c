// Matrix products and dequantisation over weights kept in their stored formats (GGUF blocks,
// kvgen's int8/int4 rows, float16/bfloat16), registered as torch ops ``kvgen::qmatmul`` and
// ``kvgen::dequantize_``. Built for this CPU and loaded by kvgen/kernels/__init__.py.
//
// A weight is (N, row_bytes) uint8: each output row is a run of blocks of QK values. Every
// format decodes a block into groups of small integers (as floats) sharing a scale d and a min
// m; dequantize_ computes q * d + m with exactly the operations of gguf.quants' numpy code
// (the product kept apart from the sum by round(): no fused multiply-add), so it matches gguf
// bit for bit. qmatmul decodes each block once and, for up to 8 input rows, accumulates
// d * sum(q * x) + m * sum(x) per group in 16-lane float32 accumulators (fused multiply-adds):
// one pass over the stored bytes, fewer operations per weight than dequantizing first, and
// the float32 dot product up to rounding order. Q4_0, Q4_1, Q5_0, Q4_K and Q6_K weights (and Q8_0 and
// kvgen's int8 and int4 where integer dot products run) in tiles of 16 rows (formats 2000 + the format)
// put 16 rows' values in the lanes instead (matmul_tiles); with AVX-512 VNNI they take integer dot products
// of their stored values with x rounded to 21 bits per block of 32 (matmul_tiles_dot); with AMX, products of 16 rows
// or more take the same sums 16 x 16 at a time (matmul_tiles_amx), and BF16 weights AMX's bfloat16 products with
// the rows split exactly into three bfloat16 parts (matmul_bf16_amx). The decoder ops at the end run a decode step's
// layer around these products.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <tuple>
#include <omp.h>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

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
  return c10::detail::fp16_ieee_to_fp32_value(h);
}
inline float f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
const vi LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// Each format: QK values per block, BYTES per block, GROUP values per scale, and
// decode(block, emit) calling emit(run, q, n, d, m) for each group: n vectors of 16 values from
// value 16 * run on, worth q * d + m (m only where HAS_MIN; d is 1 where not SCALED). q holds
// small integers, so the products and sums below are those of gguf's numpy code. F16_HEAD: a
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
// the 16 rows' 5th bits). Q8_0 stays in rows: its one-row product already streams at the memory's
// speed (22 GB/s, 2 threads), tiled it did not.
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
  template <int R, class F> static void dot_groups(const uint8_t* blk, F&& f);
};

// Q8_0: run j holds value j of the 16 rows (signed bytes); only where the integer dot products run
// (the float32 one-row product streams Q8_0 rows at the memory's speed, 2 threads: tiles did not help)
struct Q8_0x16 : Tiled<Q8_0, 2> {
  template <class E> static void columns(None, const uint8_t* run, int j, E&& emit);
  template <int CH, class E, class C> static void block(const uint8_t* blk, E&& emit, C&& close);
  static constexpr bool DOT = true;  // integer dot products (AVX-512 VNNI)
  static constexpr int BIAS = 128;  // dot_groups gives value + 128 (unsigned)
  template <int R, class F> static void dot_groups(const uint8_t* blk, F&& f);
};

// head: d and dmin; runs 0-11: the 6-bit scales and mins (k_scales' bytes), runs 12-139: the nibbles
struct Q4_Kx16 : Tiled<Q4_K, 4> {
  template <int CH> static constexpr int SLOTS = 2 * std::max(1, CH / 2);  // two groups open at a time
  template <int CH, class E, class C> static void block(const uint8_t* blk, E&& emit, C&& close);
  static constexpr bool DOT = true;  // integer dot products (AVX-512 VNNI)
  template <int R, class F> static void dot_groups(const uint8_t* blk, F&& f);
};

// no head (d is the last two bytes of a block): runs 0-127 the low 4 bits, 128-191 the high 2 bits,
// 192-207 the int8 scales of the 16 groups of 16, 208-209 the bytes of d
struct Q6_Kx16 : Tiled<Q6_K, 0> {
  template <int CH> static constexpr int SLOTS = 4 * std::max(1, CH / 4);  // four groups open at a time
  template <int CH, class E, class C> static void block(const uint8_t* blk, E&& emit, C&& close);
  static constexpr bool DOT = true;  // integer dot products (AVX-512 VNNI)
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

template <class T>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, float* out,
                     int64_t ld);

// the tiles whose first row lies in n0..n1: 16 rows each, back to GGUF blocks, then the format's own decode
template <class T>
void dequantize_tiles(const uint8_t* w, int64_t n0, int64_t n1, int64_t K, float* out, int64_t ld) {
  using G = typename T::Gguf;
  constexpr int FIELD = field_bytes<T>(), TAIL = has_row_scale<T>() ? 4 : 0;  // TAIL: a row's scale after its blocks
  const int64_t nb = K / G::QK, TB = 16 * G::BYTES, rb = nb * G::BYTES + TAIL;
  std::vector<uint8_t> rows(16 * rb);  // one tile as 16 rows
  for (int64_t t = (n0 + 15) / 16; t * 16 < n1; ++t) {
    const uint8_t* tile = w + t * 16 * rb;
    for (int i = 0; i < 16; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* g = rows.data() + i * rb + b * G::BYTES;
        for (int f = 0; f < T::HEAD / FIELD; ++f)
          std::memcpy(g + FIELD * f, tile + b * TB + 16 * FIELD * f + FIELD * i, FIELD);
        for (int v = 0; v < G::BYTES - T::HEAD; ++v) g[T::HEAD + v] = tile[b * TB + 16 * T::HEAD + 16 * v + i];
      }
      std::memcpy(rows.data() + i * rb + nb * G::BYTES, tile + nb * TB + TAIL * i, TAIL);
    }
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
  for (int i = 0; i < 16; ++i) out[i] = c10::detail::fp16_ieee_to_fp32_value(h[i]);
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

Q5_0x16::High Q5_0x16::state(const uint8_t* blk) {
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

// 16 float16 values (2 bytes each, one after the other) to float32 lanes
inline vf f16_fields(const void* p) {
  uint16_t h[16];
  std::memcpy(h, p, 32);
  float f[16];
  f16x16(h, f);
  return loadf(f);
}

inline void to_lanes(const vf& v, vn* out) { std::memcpy(out, &v, 64); }

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

template <int CH, class E, class C>
void Q6_Kx16::block(const uint8_t* blk, E&& emit, C&& close) {
  constexpr int S = SLOTS<CH> / 4;
  const vh bits = __builtin_convertvector(toi(load16(blk + 16 * 208)) | (toi(load16(blk + 16 * 209)) << 8), vh);
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

// a buffer left uninitialised, for what its user writes in full (zeroing a 512-row prefill's rounded input took as
// long as rounding it)
template <class V>
struct Written {
  std::unique_ptr<V[]> values;
  explicit Written(int64_t n = 0) : values(new V[n]) {}
  V* data() const { return values.get(); }
  V& operator[](int64_t i) const { return values[i]; }
};

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define KVGEN_DOT8 1
// ---- Integer dot products (AVX-512 VNNI) for the tiled formats (4-6 bits; Q8_0's values + 128 as
// unsigned bytes, 128 * sum(X) subtracted again in int32). The float32 path above
// needs one multiply-add per weight and input row after widening each value to float32: one
// thread ran compute-bound at 10-14 GB/s of stored bytes (Zen 4). Here the input rows are
// rounded to 21 bits and a sign per block of 32 values, x~ = X * s with s = max|x| / (127 * 2^14)
// and X split into three int8 levels X = X1 * 2^14 + X2 * 2^7 + X3, and each group's sum(q * X)
// is three exact integer dot products of the unsigned stored values with the levels (vpdpbusd:
// 4 products a lane per instruction), combined exactly, rounded once: d * s * sum(q * X) + m * sum(x~) per
// row. So the product is W @ x~ up to float32 rounding; x~ differs from x by at most
// max|x| / 2^22 per block (float32 itself rounds at 2^-24 of each value).
constexpr float XQ_MAX = 127.0f * 16384.0f;

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVGEN_AMX 1
// whether this process may use the tile registers (Linux hands them out on request: ARCH_REQ_XCOMP_PERM);
// KVGEN_DISABLE_AMX=1 keeps the vpdpbusd products
bool amx_permitted() {
  static const bool permitted = [] {
    const char* off = std::getenv("KVGEN_DISABLE_AMX");
    if (off != nullptr && *off != '\0' && std::strcmp(off, "0") != 0) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}

// the input rows that take AMX's tile products: all but R % 16 (none of fewer than 16)
int64_t amx_rows(int64_t R) { return R >= 16 && amx_permitted() ? R / 16 * 16 : 0; }
#else
int64_t amx_rows(int64_t) { return 0; }
#endif

// the input rows, rounded: levels (R, 3, K) int8, scales (R, K / 32), sums of x~ per 16 values (R, K / 16),
// sums of each level per 32 values (R, 3, K / 32; only where asked: Q8_0's and int8's bias needs them; zero for
// the first tile_rows rows)
// and, for AMX's tile loads (tile_rows > 0), the levels of the first tile_rows rows (a multiple of 16) again, a
// tile's operand at a time: (tile_rows / 16, K / 32, 3, 16, 32), 16 rows by 32 values of one level in 512
// contiguous bytes (strided loads of (R, 3, K) took as long as the tile products). Those rows keep (R, 3, K) too: a
// Q6_K segment of the same product takes vpdpbusd for every row
struct RoundedX {
  int64_t K;
  Written<int8_t> levels;
  Written<float> scales, sums;
  std::vector<int32_t> level_sums;
  Written<int8_t> tiles;
};

RoundedX round_x(const float* x, int64_t ldx, int64_t R, int64_t K, bool with_level_sums, int64_t tile_rows) {
  RoundedX out{K, Written<int8_t>(R * 3 * K), Written<float>(R * (K / 32)), Written<float>(R * (K / 16)),
               std::vector<int32_t>(with_level_sums ? R * 3 * (K / 32) : 0), Written<int8_t>(tile_rows * 3 * K)};
  const __m512i c64 = _mm512_set1_epi32(64), c127 = _mm512_set1_epi32(127);
  // rows in parallel (a prefill's 512 rows of 2048 values took ~0.5 ms: ~3% of a two-thread prefill, serial)
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
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
  const vh bits = __builtin_convertvector(toi(load16(blk + 16 * 208)) | (toi(load16(blk + 16 * 209)) << 8), vh);
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

template <class T>
constexpr bool has_dot() { return requires { T::DOT; }; }

// what dot_groups adds to the stored values to make them unsigned (subtracted again: BIAS * sum(X))
template <class T>
constexpr int dot_bias() {
  if constexpr (requires { T::BIAS; }) return T::BIAS;
  return 0;
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
#if defined(KVGEN_AMX)
// ---- The same integer sums on AMX (Intel's tile unit): one tdpbsud takes a group's values of 16 input rows (a
// tile of their levels, signed) times the same values of 16 weight rows (the group's u, unsigned: the rows of
// the tile operand as dot_groups lays them out) into 16 x 16 int32 sums, where vpdpbusd takes one input row.
// The sums leave the tile unit per group (each group has its own scales) and go through add_group as above:
// the products' bits are matmul_tiles_dot's.

// whether T's products of 16 rows or more take the tile unit: not Q6_K's (its groups of 16 values give a tile
// instruction half the work for the same read-back, and at 512 rows ran at 142-221 GFLOP/s against 263-295 for
// dequantize + oneDNN, 158-184 with vpdpbusd)
template <class T>
constexpr bool takes_tile_unit() { return has_dot<T>() && !std::is_same_v<T, Q6_Kx16>; }

// loads the tile unit's configuration (palette 1): tile i holds tiles[i] = (rows, bytes a row)
void amx_configure(std::initializer_list<std::pair<uint8_t, uint16_t>> tiles) {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  int i = 0;
  for (const auto& [rows, bytes] : tiles) {
    config.rows[i] = rows;
    config.colsb[i++] = bytes;
  }
  _tile_loadconfig(&config);
}

// y[r, 16 t + i] for tiles t0..t1 and rows r0 .. r0 + R - 1 of the rounded input (R a multiple of 16). Runs of
// tiles are unpacked once (their u, d and m per group) for all input rows, then taken 16 rows at a time
template <class T>
__attribute__((noinline)) void matmul_tiles_amx(const RoundedX& x, int64_t r0, int64_t R, const uint8_t* w,
                                                int64_t t0, int64_t t1, float* y, int64_t ldy) {
  constexpr int QK = T::Gguf::QK, N = 8, GV = N + 2;  // N: u vectors a group (32 values); GV: with d and m
  constexpr int64_t TB = 16 * T::Gguf::BYTES;
  const int64_t K = x.K, nb = K / QK, tile_bytes = nb * TB + (has_row_scale<T>() ? 64 : 0), groups = K / (4 * N);
  // tiles unpacked at a time: ~512 kB (2 threads, 512 rows, 3072 x 1536: 418-444 GFLOP/s against 355-370 with 128 kB,
  // 387-411 with 1.5 MB)
  const int64_t run = std::max<int64_t>(1, (512 << 10) / (groups * GV * 64));
  thread_local std::vector<__m512i> unpacked;
  thread_local std::vector<int64_t> starts;  // each group's first value, in dot_groups' order
  unpacked.resize(run * groups * GV);
  starts.resize(groups);
  alignas(64) int32_t sums[3][16][16];
  // tiles 0-2: a group's sums per level (16 input rows x 16 weight rows, int32); 3-5: its levels (16 input rows x 32
  // bytes); 6: its u (8 rows of 16 weight rows x 4 bytes)
  amx_configure({{16, 64}, {16, 64}, {16, 64}, {16, 4 * N}, {16, 4 * N}, {16, 4 * N}, {N, 64}});
  for (int64_t ta = t0; ta < t1; ta += run) {
    const int64_t tb = std::min(t1, ta + run);
    for (int64_t t = ta; t < tb; ++t) {
      __m512i* out = unpacked.data() + (t - ta) * groups * GV;
      int64_t g = 0;
      for (int64_t b = 0; b < nb; ++b)
        T::template dot_groups<16>(w + t * tile_bytes + b * TB, [&](auto n, int k0, const __m512i* u, __m512 d,
                                                                     __m512 m) {
          static_assert(decltype(n)::value == N, "groups of 32 values only (Q6_K's 16 take vpdpbusd)");
          for (int j = 0; j < N; ++j)  // the formats with a bias: their signed values back (tdpbssd)
            _mm512_store_si512(out + g * GV + j,
                               dot_bias<T>() ? _mm512_xor_si512(u[j], _mm512_set1_epi8(-128)) : u[j]);
          _mm512_store_ps(reinterpret_cast<float*>(out + g * GV + N), d);
          _mm512_store_ps(reinterpret_cast<float*>(out + g * GV + N + 1), m);
          starts[g++] = b * QK + k0;
        });
    }
    for (int64_t r = r0; r < r0 + R; r += 16) {
      const int8_t* levels = x.tiles.data() + r * 3 * K;  // level l of rows r.. r + 15, values k..: levels[
      // 1536 (k / 32) + 512 l + k % 32], 32 bytes a row
      for (int64_t t = ta; t < tb; ++t) {
        const __m512i* groups_u = unpacked.data() + (t - ta) * groups * GV;
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          const __m512i* u = groups_u + g * GV;
          const int64_t k = starts[g];
          _tile_loadd(6, u, 64);
          const int8_t* a = levels + 1536 * (k / 32) + k % 32;
          _tile_loadd(3, a, 32);
          _tile_loadd(4, a + 512, 32);
          _tile_loadd(5, a + 1024, 32);
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          if constexpr (dot_bias<T>() != 0) {
            _tile_dpbssd(0, 3, 6);
            _tile_dpbssd(1, 4, 6);
            _tile_dpbssd(2, 5, 6);
          } else {
            _tile_dpbsud(0, 3, 6);
            _tile_dpbsud(1, 4, 6);
            _tile_dpbsud(2, 5, 6);
          }
          _tile_stored(0, sums[0], 64);
          _tile_stored(1, sums[1], 64);
          _tile_stored(2, sums[2], 64);
          const __m512 d = _mm512_load_ps(reinterpret_cast<const float*>(u + N)),
                       m = _mm512_load_ps(reinterpret_cast<const float*>(u + N + 1));
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {  // (unrolled: acc stays in registers)
            const __m512i dot[3] = {_mm512_load_si512(sums[0][i]), _mm512_load_si512(sums[1][i]),
                                    _mm512_load_si512(sums[2][i])};
            acc[i] = add_group<T, N, false>(acc[i], dot, d, m, x, r + i, k);
          }
        }
        const __m512 scale = has_row_scale<T>() ? _mm512_loadu_ps(w + t * tile_bytes + nb * TB) : _mm512_set1_ps(1.0f);
        for (int i = 0; i < 16; ++i)
          _mm512_storeu_ps(y + (r + i) * ldy + 16 * t, has_row_scale<T>() ? _mm512_mul_ps(acc[i], scale) : acc[i]);
      }
    }
  }
  _tile_release();
}
#endif
#else
struct RoundedX {};
template <class T>
constexpr bool has_dot() { return false; }
#endif

#if defined(KVGEN_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVGEN_AMX_BF16 1
// ---- BF16 weights times 16 input rows or more on AMX (tdpbf16ps): the rows split exactly into three bfloat16
// parts, x = x1 + x2 + x3 (8 significant bits each: x1 rounded to bfloat16, x2 the rest rounded, x3 what remains;
// values below ~2^-110 lose their last parts), each product of a weight with a part exact in float32 and summed
// in the tile unit's float32 accumulators: W @ x up to float32 rounding order, as the float32 matmul. Per 32 values
// a 16 x 16 output tile takes 3 instructions and keeps its sums in the tile unit over all K.

// the rows' three parts: (3, R, K) bfloat16 bits, part p of row r at parts + (p R + r) K
Written<uint16_t> split_bf16(const float* x, int64_t ldx, int64_t R, int64_t K) {
  Written<uint16_t> parts(3 * R * K);
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < K; k += 16) {
        __m512 rest = _mm512_loadu_ps(x + r * ldx + k);
        for (int p = 0; p < 3; ++p) {
          const __m256i part = (__m256i)_mm512_cvtneps_pbh(rest);  // rounded to nearest, ties to even
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts.data() + (p * R + r) * K + k), part);
          rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(part), 16)));
        }
      }
  });
  return parts;
}

// output tiles (XT input-row tiles from r) x (WT weight tiles from t), over all K
template <int XT, int WT>
inline void bf16_tiles(const uint16_t* parts, int64_t R, int64_t K, int64_t r, const uint8_t* packed, int64_t t,
                       float* y, int64_t ldy) {
  const int64_t steps = K / 32;
  _tile_zero(0);
  if constexpr (WT > 1) _tile_zero(1);
  if constexpr (XT > 1) _tile_zero(2);
  if constexpr (XT > 1 && WT > 1) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, packed + (t * steps + s) * 1024, 64);
    if constexpr (WT > 1) _tile_loadd(7, packed + ((t + 1) * steps + s) * 1024, 64);
    for (int p = 0; p < 3; ++p) {
      const uint16_t* a = parts + (p * R + r) * K + 32 * s;
      _tile_loadd(4, a, 2 * K);
      if constexpr (XT > 1) _tile_loadd(5, a + 16 * K, 2 * K);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (WT > 1) _tile_dpbf16ps(1, 4, 7);
      if constexpr (XT > 1) _tile_dpbf16ps(2, 5, 6);
      if constexpr (XT > 1 && WT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  float* out = y + r * ldy + 16 * t;
  _tile_stored(0, out, 4 * ldy);
  if constexpr (WT > 1) _tile_stored(1, out + 16, 4 * ldy);
  if constexpr (XT > 1) _tile_stored(2, out + 16 * ldy, 4 * ldy);
  if constexpr (XT > 1 && WT > 1) _tile_stored(3, out + 16 * ldy + 16, 4 * ldy);
}

// y[r, 16 t + i] for weight tiles t0..t1 (16 rows of a BF16 weight, rb bytes apart) and the R rows in their
// three parts (R a multiple of 16)
void matmul_bf16_amx(const uint16_t* parts, int64_t R, const uint8_t* w, int64_t rb, int64_t t0, int64_t t1,
                     int64_t K, float* y, int64_t ldy) {
  const int64_t steps = K / 32, tiles = t1 - t0;
  // the weight tiles as the tile unit takes them: per 32 values, row j holds pairs j of the 16 weight rows
  thread_local Written<uint8_t> packed;
  thread_local int64_t packed_size = 0;
  if (packed_size < tiles * steps * 1024) packed = Written<uint8_t>(packed_size = tiles * steps * 1024);
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32((int32_t)rb));
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t s = 0; s < steps; ++s)
      for (int j = 0; j < 16; ++j)
        _mm512_storeu_si512(packed.data() + (t * steps + s) * 1024 + 64 * j,
                           _mm512_i32gather_epi32(rows, w + 16 * (t0 + t) * rb + 64 * s + 4 * j, 1));
  // tiles 0-3: the float32 sums of 2 x 2 output tiles (16 input rows x 16 weight rows); 4-5: two tiles of input rows
  // (16 rows x 32 values of one part); 6-7: two weight tiles (16 pairs of values x 16 rows x 2)
  amx_configure({{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}});
  for (int64_t r = 0; r < R; r += 32) {
    const uint8_t* p = packed.data() - t0 * steps * 1024;  // indexed by the tile's own number
    int64_t t = t0;
    if (R - r >= 32) {
      for (; t + 2 <= t1; t += 2) bf16_tiles<2, 2>(parts, R, K, r, p, t, y, ldy);
      if (t < t1) bf16_tiles<2, 1>(parts, R, K, r, p, t, y, ldy);
    } else {
      for (; t + 2 <= t1; t += 2) bf16_tiles<1, 2>(parts, R, K, r, p, t, y, ldy);
      if (t < t1) bf16_tiles<1, 1>(parts, R, K, r, p, t, y, ldy);
    }
  }
  _tile_release();
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
#if defined(KVGEN_DOT8)
  if constexpr (has_dot<T>()) {  // the tiles whose first row lies in n0..n1, 16 rows of x at a time while there
    // are as many, else 1-8 (each unpacked block serves twice the rows of 8: 512-row products 3-14% faster on Zen
    // 4; 24 or 32 rows no faster)
    // over runs of tiles of ~256 kB, so that many rows (a prefill) read each run from L2, not memory
    // (with AMX: all but the last R % 16 rows in tiles of 16 by 16)
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
        switch (rows = R - r >= 16 ? 16 : std::min<int64_t>(8, R - r)) {
          case 1: matmul_tiles_dot<T, 1>(rx, r, w, t0, t, yr, ldy); break;
          case 2: matmul_tiles_dot<T, 2>(rx, r, w, t0, t, yr, ldy); break;
          case 3: matmul_tiles_dot<T, 3>(rx, r, w, t0, t, yr, ldy); break;
          case 4: matmul_tiles_dot<T, 4>(rx, r, w, t0, t, yr, ldy); break;
          case 5: matmul_tiles_dot<T, 5>(rx, r, w, t0, t, yr, ldy); break;
          case 6: matmul_tiles_dot<T, 6>(rx, r, w, t0, t, yr, ldy); break;
          case 7: matmul_tiles_dot<T, 7>(rx, r, w, t0, t, yr, ldy); break;
          case 8: matmul_tiles_dot<T, 8>(rx, r, w, t0, t, yr, ldy); break;
          default: matmul_tiles_dot<T, 16>(rx, r, w, t0, t, yr, ldy); break;
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

// format codes: GGML's type ids; kvgen's own formats above 1000; formats in tiles of 16 rows: 2000 + the format
template <class F>
void dispatch(int64_t format, F&& f) {
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
    default: TORCH_CHECK(false, "kvgen: no kernel for weight format ", format);
  }
}

// F32 rows may also be a float32 (N, K) tensor (a float model's own weight, read in place), whose bytes they are
template <class T>
void check_weight(const at::Tensor& w, int64_t K) {
  constexpr int64_t tile = tile_rows<T>();
  TORCH_CHECK(tile == 1 || (w.size(0) % tile == 0 && w.is_contiguous()), "kvgen: a weight in tiles of ", tile,
              " rows must be contiguous with a multiple of ", tile, " rows");
  const bool floats = std::is_same_v<T, F32> && w.scalar_type() == at::kFloat;
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kByte || floats) && w.stride(1) == 1,
              "kvgen: weight must be 2-D uint8 rows", std::is_same_v<T, F32> ? " or float32 rows" : "");
  TORCH_CHECK(K % T::QK == 0, "kvgen: input features ", K, " are not a multiple of the block size ", T::QK);
  TORCH_CHECK(w.size(1) * w.element_size() == K / T::QK * T::BYTES + (has_row_scale<T>() ? 4 : 0),
              "kvgen: weight rows hold ", w.size(1) * w.element_size(), " bytes, not what ", K, " input features need");
}

// a checked weight's rows as bytes: the first row, and the bytes from one row to the next
inline const uint8_t* weight_bytes(const at::Tensor& w) { return static_cast<const uint8_t*>(w.const_data_ptr()); }
inline int64_t row_stride(const at::Tensor& w) { return w.stride(0) * w.element_size(); }

// A product's weight: its row segments ws[i] (each in formats[i]) checked and taken apart once, so
// that a registered decode stack (kvgen::decoder_stack) does not redo it at every step.
struct Product {
  struct Segment { int64_t format, start, rows, row_bytes; const uint8_t* w; };
  std::vector<Segment> segments;
  std::vector<at::Tensor> held;  // the tensors behind the segments
  int64_t K = 0, N = 0;  // input features, output rows
  bool rounded = false;  // some segment takes integer dot products: x rounded once for all of them
  bool biased = false;  // and some of those adds a bias to its values (Q8_0): sums of each level needed
  bool split = false;  // some segment is BF16, and every BF16 segment has a multiple of 16 rows (tdpbf16ps)
};

Product make_product(at::TensorList ws, at::IntArrayRef formats, int64_t K) {
  TORCH_CHECK(ws.size() == formats.size() && !ws.empty(), "kvgen: one format per weight segment");
  Product p;
  p.K = K;
  for (size_t i = 0; i < ws.size(); ++i) {
    dispatch(formats[i], [&](auto t) {
      using T = decltype(t);
      check_weight<T>(ws[i], K);
      p.rounded |= has_dot<T>();
      p.biased |= requires { T::BIAS; };
    });
    p.segments.push_back({formats[i], p.N, ws[i].size(0), row_stride(ws[i]), weight_bytes(ws[i])});
    p.held.push_back(ws[i]);
    p.N += ws[i].size(0);
  }
  const auto bf16 = [](const Product::Segment& seg) { return seg.format == 30; };
  p.split = std::any_of(p.segments.begin(), p.segments.end(), bf16) &&
             std::all_of(p.segments.begin(), p.segments.end(),
                         [&](const Product::Segment& seg) { return !bf16(seg) || seg.rows % 16 == 0; });
  return p;
}

// A product's input rows (R of K values, ldx apart), prepared once for all its output rows: their sums
// per group (formats with a min and no integer dot products) and their rounding (formats with them).
struct ProductInput {
  const float* x;
  int64_t ldx, R;
  std::vector<std::vector<float>> xsums;  // per segment
  RoundedX rx;
  int64_t split_rows = 0;  // the first rows split into bfloat16 parts for BF16 segments (split_bf16), or none
  Written<uint16_t> parts;
};

ProductInput product_input(const Product& p, const float* xp, int64_t ldx, int64_t R) {
  ProductInput in{xp, ldx, R, std::vector<std::vector<float>>(p.segments.size()), {}};
  for (size_t i = 0; i < p.segments.size(); ++i)
    dispatch(p.segments[i].format, [&](auto t) {
      using T = decltype(t);
      if constexpr (!has_dot<T>()) in.xsums[i] = group_sums<T>(xp, ldx, R, p.K);
    });
#if defined(KVGEN_DOT8)
  if (p.rounded) in.rx = round_x(xp, ldx, R, p.K, p.biased, amx_rows(R));
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

// y (R, N) = x (R, K, rows ldx apart) times the product's weight, output rows in parallel
void product_into(const Product& p, const float* xp, int64_t ldx, int64_t R, float* yp) {
  const ProductInput in = product_input(p, xp, ldx, R);
  at::parallel_for(0, p.N, product_grain(p), [&](int64_t n0, int64_t n1) { product_rows(p, in, n0, n1, yp); });
}

// x (R, K) float32 rows times the row segments ws[i] (each in formats[i]) -> (R, sum of their rows)
at::Tensor qmatmul(const at::Tensor& x, at::TensorList ws, at::IntArrayRef formats) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "kvgen: x must be (rows, K) float32");
  const Product p = make_product(ws, formats, x.size(1));
  at::Tensor y = at::empty({x.size(0), p.N}, x.options());
  product_into(p, x.data_ptr<float>(), x.stride(0), x.size(0), y.data_ptr<float>());
  return y;
}

// out (N, K) float32 rows (may be a row slice of a bigger buffer)
void dequantize_(at::Tensor out, const at::Tensor& w, int64_t format) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1, "kvgen: out must be (N, K) float32");
  TORCH_CHECK(out.size(0) == w.size(0), "kvgen: out has ", out.size(0), " rows, the weight ", w.size(0));
  const int64_t K = out.size(1);
  dispatch(format, [&](auto t) {
    using T = decltype(t);
    check_weight<T>(w, K);
    const uint8_t* wp = weight_bytes(w);
    float* op = out.data_ptr<float>();
    const int64_t rb = row_stride(w), ld = out.stride(0);
    at::parallel_for(0, w.size(0), 16, [&](int64_t n0, int64_t n1) { dequantize_rows<T>(wp, rb, n0, n1, K, op, ld); });
  });
}

// rows ids of a packed (N, K) weight as float32 (n, K): an embedding lookup in one op (a decode step's
// index_select + dequantize + pick of a row in its tile were five ATen calls, ~40 us; after a step's
// weights streamed through the caches, ~200 us). A tiled row is decoded with its tile's 15 others.
at::Tensor embedding(const at::Tensor& w, const at::Tensor& ids, int64_t K, int64_t format) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "kvgen: embedding ids must be 1-D int64");
  const at::Tensor idc = ids.contiguous();
  const int64_t n = idc.size(0), N = w.size(0);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < N, "kvgen: token id ", ip[i], " is outside the embedding table's ", N,
                      " rows");
  at::Tensor out = at::empty({n, K}, w.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  dispatch(format, [&](auto t) {
    using T = decltype(t);
    check_weight<T>(w, K);
    const uint8_t* wp = weight_bytes(w);
    const int64_t rb = row_stride(w);
    at::parallel_for(0, n, 8, [&](int64_t i0, int64_t i1) {
      std::vector<float> tile(tiled<T>() ? 16 * K : 0);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t id = ip[i];
        if constexpr (tiled<T>()) {
          const int64_t first = id / 16 * 16;  // the tile holds rows first .. first + 15
          dequantize_rows<T>(wp + first * rb, rb, 0, 16, K, tile.data(), K);
          std::memcpy(op + i * K, tile.data() + (id - first) * K, K * sizeof(float));
        } else {
          dequantize_rows<T>(wp + id * rb, rb, 0, 1, K, op + i * K, K);
        }
      }
    });
  });
  return out;
}

// -- small decode-time ops --------------------------------------------------------------------------

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

// y = x * rsqrt(mean(x^2) + eps) * (w + offset) over D values (y may be x); Gemma's norms scale by
// 1 + w, rounded as its modules round it (a sum before products: nothing to fuse)
inline void rms_row(const float* x, const float* w, int64_t D, double eps, float* y, float offset = 0.0f) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef double v8d __attribute__((vector_size(64)));
  v8d part[2] = {};  // the squares summed in double, 16 lanes (one sum in order: ~4 cycles a value)
  int64_t j = 0;
  for (; j + 16 <= D; j += 16)
    for (int h = 0; h < 2; ++h) {
      v8 v;
      std::memcpy(&v, x + j + 8 * h, 32);
      const v8d d = __builtin_convertvector(v, v8d);
      part[h] += d * d;  // exact products (48 bits)
    }
  double ss = 0.0;
  for (int i = 0; i < 8; ++i) ss += part[0][i] + part[1][i];
  for (; j < D; ++j) ss += (double)x[j] * x[j];
  const float scale = 1.0f / std::sqrt((float)(ss / D) + (float)eps);
  for (int64_t j = 0; j < D; ++j) y[j] = x[j] * scale * (w[j] + offset);
}

// rows of D values: y = rms_norm(x) * (w + offset), rows in parallel (y may be x)
void rms_rows(const float* x, const float* w, int64_t rows, int64_t D, double eps, double offset, float* y) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / D), [&](int64_t r0, int64_t r1) {  // ~64 kB a task
    for (int64_t r = r0; r < r1; ++r) rms_row(x + r * D, w, D, eps, y + r * D, (float)offset);
  });
}

// x (rows, D) float32 contiguous -> x / sqrt(mean(x^2) + eps) * (weight + offset), one pass per row
at::Tensor rms_norm_offset(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous() && x.size(-1) == weight.numel(), "kvgen: rms_norm takes contiguous float32");
  const int64_t D = weight.numel(), rows = x.numel() / D;
  at::Tensor y = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  rms_rows(xp, wp, rows, D, eps, offset, yp);
  return y;
}

// -- attention ------------------------------------------------------------------------------------
//
// kvgen::attention(q, k, v, mask?, scale, softcap): q (B, H, T, D), k and v (B, Hkv, S, D) (any
// strides, the last dim contiguous, D a multiple of 16, H a multiple of Hkv: the G = H / Hkv query
// heads of a group share one key head), mask: bool (B or 1, 1, T, S), True where allowed, or
// undefined (all allowed). softcap > 0: scores become tanh(s / softcap) * softcap. Returns
// (B, H, T, D) as a view of (B, T, H, D) storage, so the caller's transpose + flatten is free. A
// query row that allows no key gets zeros (SDPA gives NaN there); callers never use such rows.
//
// One scheme for every shape: flash attention over the 16-key tiles that the mask allows, work in
// proportion to those tiles, so a ragged batch over a paged block pool (S = every slot of the
// layer, each row allowing its own sequence's scattered blocks) costs what its sequences hold, not
// T * S, and a causal or sliding-window prefill skips the excluded tiles:
//  1. scan: each mask row becomes two bit sets over tiles, "some key allowed" and "every key
//     allowed" (AVX2: 64 bytes a step, all-zero runs skipped with one test), rows in parallel.
//     Without a mask every tile is allowed;
//  2. row blocks: consecutive query positions of one mask row-set join a block (at most P
//     positions, P * G <= 64 query rows) while their tile sets nearly agree (symmetric difference
//     at most max(1, shared / 8) tiles). Rows of different sequences own different pool blocks, so
//     each starts a new row block and no decode row pays for another sequence's tiles, while a
//     causal or sliding-window prefill keeps full blocks. A block attends to its rows' union;
//  3. work items: (batch row, row block, key head): the block's positions times the G query heads
//     of the key head, each tile's keys and values read once for all of them. An item costlier
//     than 1 / (4 * threads) of the total is split into chunks of its tile list (>= 8 tiles), their
//     partial softmax states merged after: flash-decoding, so one long decode row still uses every
//     thread. Items are handed out costliest first, dynamically (ragged batches are uneven);
//  4. per tile (the next one prefetched): scores; the soft-cap; -inf where the mask excludes a key
//     (only in tiles not fully allowed: masked keys are exactly excluded); the online softmax with
//     one vector lane per query row; acc[row] = acc[row] * alpha + sum_s p[s, row] * V[s] (rows
//     by 6, 16 value columns at a time, in registers). Scores of many rows: K_tile Q^T with the
//     rows in vector lanes (Q transposed and scaled once per item; 3 x 4 register tiles); of a few
//     rows (decode: 2 R <= lanes): dot products along D, 4 keys at a time, lanes summed at the end.

constexpr int64_t TILE = 16;


template <class V> inline V vload(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <class V> inline void vstore(float* p, V v) { std::memcpy(p, &v, sizeof(V)); }
template <class V> inline V vmax(V a, V b) { return a > b ? a : b; }

inline bool has_zero_byte(uint64_t x) { return ((x - 0x0101010101010101ull) & ~x & 0x8080808080808080ull) != 0; }

// one mask row of S bools -> bit j of any: tile j (keys 16 j .. 16 j + 15) has an allowed key;
// of full: all 16 keys are allowed (a tile cut short by S never is). Both start zeroed.
void scan_mask_row(const uint8_t* m, int64_t S, uint64_t* any, uint64_t* full) {
  const int64_t whole = S / TILE, tiles = (S + TILE - 1) / TILE;
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256i zero = _mm256_setzero_si256();
  for (; j + 4 <= whole; j += 4) {  // 4 tiles a step; j % 4 == 0, so their bits share a word
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + TILE * j));
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + TILE * j + 32));
    const __m256i o = _mm256_or_si256(x, y);
    if (_mm256_testz_si256(o, o)) continue;  // nothing allowed: the common case of a sparse mask
    const uint64_t z = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, zero)) |
                       (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(y, zero)) << 32;  // bit: a zero byte
    uint64_t a = 0, f = 0;
    for (int t = 0; t < 4; ++t) {
      const uint64_t h = (z >> (16 * t)) & 0xFFFF;
      a |= (uint64_t)(h != 0xFFFF) << t;
      f |= (uint64_t)(h == 0) << t;
    }
    any[j >> 6] |= a << (j & 63);
    full[j >> 6] |= f << (j & 63);
  }
#endif
  for (; j < tiles; ++j) {
    bool a = false, f = false;
    if (j < whole) {
      uint64_t x, y;
      std::memcpy(&x, m + TILE * j, 8);
      std::memcpy(&y, m + TILE * j + 8, 8);
      a = (x | y) != 0;
      f = !has_zero_byte(x) && !has_zero_byte(y);
    } else {
      for (int64_t s = TILE * j; s < S; ++s) a |= m[s] != 0;
    }
    if (a) any[j >> 6] |= 1ull << (j & 63);
    if (f) full[j >> 6] |= 1ull << (j & 63);
  }
}

// consecutive query positions t0 .. t0 + n - 1 of mask row-set mrow, and the tiles any of them
// allows: 2 * tile + (1 where every key of the tile is allowed for every one of them)
struct RowBlock {
  int64_t mrow, t0, n;
  std::vector<int32_t> tiles;
};

struct AttentionArgs {
  const float *q, *k, *v;
  int64_t q0, q1, q2, k0, k1, k2, v0, v1, v2;  // strides of batch, head, position
  const uint8_t* mask;                         // (MB, T, S) or null: all allowed
  int64_t T, S, H, G, D;
  float scale, cap;
  float* out;  // (B, T, H, D)
};

// a few query rows' scores are taken CHUNK tiles at a time: one softmax pass (max, exp, rescaling of
// the values so far) per 64 keys instead of per 16
constexpr int64_t CHUNK = 4;

// one thread's buffers for row blocks of at most `rows` (padded) query rows; left uninitialised
struct Scratch {
  std::unique_ptr<float[]> buffer;
  float *qt, *sc, *m, *l, *alpha, *acc, *ktail, *vtail;
  Scratch(int64_t rows, int64_t D) : buffer(new float[rows * (2 * D + CHUNK * TILE + 3) + 2 * TILE * D]) {
    qt = buffer.get(), sc = qt + rows * D, m = sc + CHUNK * TILE * rows, l = m + rows, alpha = l + rows,
    acc = alpha + rows;
    ktail = acc + rows * D, vtail = ktail + TILE * D;
  }
};

// sc[s, r] = sum_d k[s, d] * qt[d, r] for the 16 keys of a tile (key s at k + s * ks) and JR * LN
// query rows r in vector lanes; KS keys at a time (JR * KS accumulators in registers)
template <int JR, int KS>
__attribute__((noinline)) void tile_scores(const float* qt, int64_t Rp, const float* k, int64_t ks, int64_t D,
                                           float* sc) {
  for (int64_t s0 = 0; s0 < TILE; s0 += KS) {
    vn acc[JR][KS] = {};
    const float* kk = k + s0 * ks;
    for (int64_t d = 0; d < D; ++d) {
      vn x[JR];
      for (int j = 0; j < JR; ++j) x[j] = vload<vn>(qt + d * Rp + j * LN);
      for (int i = 0; i < KS; ++i) {
        const float kv = kk[i * ks + d];
        for (int j = 0; j < JR; ++j) acc[j][i] += x[j] * kv;
      }
    }
    for (int i = 0; i < KS; ++i)
      for (int j = 0; j < JR; ++j) vstore(sc + (s0 + i) * Rp + j * LN, acc[j][i]);
  }
}

// the sums of 4 vectors' lanes
inline void sum4(const vn* x, float* out) {
#if defined(__AVX2__)
  __m256 v[4];
#if defined(__AVX512F__)
  for (int i = 0; i < 4; ++i) {  // the two halves of each 16 lanes added first
    __m512 w;
    std::memcpy(&w, x + i, 64);
    v[i] = _mm256_add_ps(_mm512_castps512_ps256(w), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1)));
  }
#else
  std::memcpy(v, x, sizeof(v));
#endif
  const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1)));
#else
  for (int i = 0; i < 4; ++i) {
    float t = 0.0f;
    for (int64_t j = 0; j < LN; ++j) t += x[i][j];
    out[i] = t;
  }
#endif
}

// for a few query rows: sc[r, s] = sum_d q[r, d] * k[s, d] for RR rows (q row-major, R x D) and
// the 16 keys of a tile (sc row-major, rows ss apart, the keys in lanes), as dot products along D, 4 keys
// at a time.
// ahead (or null): a later tile's keys (same stride), each vector of them prefetched into L2 as the
// same vector of this tile is loaded
template <int RR>
__attribute__((noinline)) void tile_scores_dot(const float* q, int64_t D, const float* k, int64_t ks, float* sc,
                                               int64_t ss, const float* ahead) {
  for (int64_t s0 = 0; s0 < TILE; s0 += 4) {
    vn acc[RR][4] = {};
    const float* kk = k + s0 * ks;
    for (int64_t d = 0; d < D; d += LN) {
      vn x[4];
      for (int i = 0; i < 4; ++i) {
        if (ahead) __builtin_prefetch(ahead + (s0 + i) * ks + d, 0, 2);
        x[i] = vload<vn>(kk + i * ks + d);
#if defined(__AVX__)  // (an SSE register holds half a vn)
        asm("" : "+x"(x[i]));  // held in a register: GCC would load each key vector again for every row
#endif
      }
      for (int j = 0; j < RR; ++j) {
        vn y = vload<vn>(q + j * D + d);
#if defined(__AVX512F__)
        asm("" : "+v"(y));  // loaded once: GCC would fold the load into each of the 4 multiply-adds (Zen 4: load-bound)
#endif
        for (int i = 0; i < 4; ++i) acc[j][i] += x[i] * y;
      }
    }
    for (int j = 0; j < RR; ++j) {
      float t[4];
      sum4(acc[j], t);
      for (int i = 0; i < 4; ++i) sc[j * ss + s0 + i] = t[i];
    }
  }
}

// acc[i] = acc[i] * alpha[i] (alpha null: acc[i]) + sum_s p[s, i] * v[s] for RR consecutive query rows (acc rows of D
// floats, value s at v + s * vs, p[s, i] at p + s * ps + i * pi), 16 columns at a time
// (32 columns a pass where D allows on AVX-512: each broadcast weight then serves two multiply-adds).
// ahead (or null): a later tile's values, prefetched into L2 vector by vector as tile_scores_dot does
template <int RR, int W = DC>
void tile_values_by(float* acc, int64_t D, const float* p, int64_t ps, int64_t pi, const float* alpha,
                    const float* v, int64_t vs, const float* ahead) {
  for (int64_t d = 0; d < D; d += W * LN) {
    vn x[RR][W];
    for (int i = 0; i < RR; ++i)
      for (int c = 0; c < W; ++c) x[i][c] = alpha ? vload<vn>(acc + i * D + d + c * LN) * alpha[i]
                                                 : vload<vn>(acc + i * D + d + c * LN);
    for (int64_t s = 0; s < TILE; ++s) {
      vn y[W];
      for (int c = 0; ahead && c < W; ++c) __builtin_prefetch(ahead + s * vs + d + c * LN, 0, 2);
      for (int c = 0; c < W; ++c) {
        y[c] = vload<vn>(v + s * vs + d + c * LN);
#if defined(__AVX512F__)
        asm("" : "+v"(y[c]));  // loaded once: GCC would fold the load into each row's multiply-add (Zen 4: load-bound)
#endif
      }
      for (int i = 0; i < RR; ++i) {
        const float w = p[s * ps + i * pi];
        for (int c = 0; c < W; ++c) x[i][c] += y[c] * w;
      }
    }
    for (int i = 0; i < RR; ++i)
      for (int c = 0; c < W; ++c) vstore(acc + i * D + d + c * LN, x[i][c]);
  }
}

template <int RR>
__attribute__((noinline)) void tile_values(float* acc, int64_t D, const float* p, int64_t ps, int64_t pi,
                                           const float* alpha, const float* v, int64_t vs, const float* ahead) {
#if defined(__AVX512F__)
  if (D % 32 == 0) return tile_values_by<RR, 2>(acc, D, p, ps, pi, alpha, v, vs, ahead);
#endif
  tile_values_by<RR>(acc, D, p, ps, pi, alpha, v, vs, ahead);
}

// tile_values for R consecutive query rows (6 at a time, then the rest), acc R x D, p[s, i] at p + s * ps + i * pi
inline void values_rows(int64_t R, float* acc, int64_t D, const float* p, int64_t ps, int64_t pi, const float* alpha,
                        const float* v, int64_t vs, const float* ahead) {
  int64_t r = 0;
  for (; r + 6 <= R; r += 6)
    tile_values<6>(acc + r * D, D, p + r * pi, ps, pi, alpha ? alpha + r : nullptr, v, vs, r ? nullptr : ahead);
  float* ar = acc + r * D;
  const float *pr = p + r * pi, *al = alpha ? alpha + r : nullptr, *va = r ? nullptr : ahead;
  switch (R - r) {
    case 1: tile_values<1>(ar, D, pr, ps, pi, al, v, vs, va); break;
    case 2: tile_values<2>(ar, D, pr, ps, pi, al, v, vs, va); break;
    case 3: tile_values<3>(ar, D, pr, ps, pi, al, v, vs, va); break;
    case 4: tile_values<4>(ar, D, pr, ps, pi, al, v, vs, va); break;
    case 5: tile_values<5>(ar, D, pr, ps, pi, al, v, vs, va); break;
    default: break;
  }
}

// the query rows of a row block: R = n * G, padded to Rp lanes
inline int64_t padded_rows(int64_t R) { return (R + LN - 1) / LN * LN; }

// tiles c0 .. c1 - 1 of a row block for key head g of batch row b. Query row r = p * G + h:
// position t0 + p, head g * G + h. part null: write the normalised output; else leave the
// running max (part[0, R)), sum (part[Rp, Rp + R)) and unnormalised values (part + 2 Rp, R x D).
void attend_tiles(const AttentionArgs& a, int64_t b, int64_t g, const RowBlock& blk, int64_t c0, int64_t c1,
                  Scratch& w, float* part) {
  const int64_t G = a.G, D = a.D, S = a.S, n = blk.n, R = n * G, Rp = padded_rows(R);
  float *qt = w.qt, *sc = w.sc, *m = w.m, *l = w.l, *alpha = w.alpha, *acc = w.acc;
  // few rows: dot products along D and the scores row-major (each row's 16 keys in lanes: one exp
  // vector per row, not per key), else the rows in vector lanes
  const bool dots = 2 * R <= LN;
  for (int64_t p = 0; p < n; ++p)
    for (int64_t h = 0; h < G; ++h) {
      const float* qr = a.q + b * a.q0 + (g * G + h) * a.q1 + (blk.t0 + p) * a.q2;
      const int64_t r = p * G + h;
      for (int64_t d = 0; d < D; ++d) (dots ? qt[r * D + d] : qt[d * Rp + r]) = qr[d] * a.scale;
    }
  if (!dots)
    for (int64_t d = 0; d < D; ++d) std::fill(qt + d * Rp + R, qt + (d + 1) * Rp, 0.0f);
  std::fill(m, m + Rp, -INFINITY);
  std::fill(l, l + Rp, 0.0f);
  std::fill(acc, acc + R * D, 0.0f);
  const float* kb = a.k + b * a.k0 + g * a.k1;
  const float* vb_ = a.v + b * a.v0 + g * a.v1;
  const uint8_t* mrows = a.mask ? a.mask + (blk.mrow * a.T + blk.t0) * S : nullptr;
  auto prefetch = [&](int64_t c) {  // a tile's keys and values, while the one before is computed
    const int64_t s0 = (int64_t)(blk.tiles[c] >> 1) * TILE;
    for (int64_t s = s0; s < std::min(s0 + TILE, S); ++s)
      for (int64_t d = 0; d < D; d += 16) {
        __builtin_prefetch(kb + s * a.k2 + d);
        __builtin_prefetch(vb_ + s * a.v2 + d);
      }
  };
  constexpr int64_t AHEAD = 2;  // few rows: tiles prefetched ahead
  auto cut_tail = [&](int64_t s0, const float*& kt, const float*& vt, int64_t& ks, int64_t& vs) {
    if (s0 + TILE <= S) return;  // the last tile, cut short: its keys and values padded with zeros
    std::fill(w.ktail, w.ktail + TILE * D, 0.0f);
    std::fill(w.vtail, w.vtail + TILE * D, 0.0f);
    for (int64_t s = 0; s < S - s0; ++s) {
      std::copy(kt + s * ks, kt + s * ks + D, w.ktail + s * D);
      std::copy(vt + s * vs, vt + s * vs + D, w.vtail + s * D);
    }
    kt = w.ktail, vt = w.vtail, ks = vs = D;
  };
  // the score of key s of a tile for row r: sc[r * row_stride + s * key_stride], -inf where the mask excludes it
  auto exclude = [&](int64_t c, int64_t s0, float* scores, int64_t key_stride, int64_t row_stride) {
    if (blk.tiles[c] & 1) return;  // every key of the tile allowed for every row
    for (int64_t s = 0; s < TILE; ++s)
      for (int64_t p = 0; p < n; ++p)
        if (s0 + s >= S || (mrows && !mrows[p * S + s0 + s]))
          for (int64_t h = 0; h < G; ++h) scores[s * key_stride + (p * G + h) * row_stride] = -INFINITY;
  };
  if (dots) {
    // few rows: dot products along D; CHUNK tiles' scores, one softmax pass over them, then their values.
    // The tile AHEAD tiles on is prefetched into L2 while this one is computed, a vector per vector
    // loaded (one burst of a whole tile into L1 per tile left the reads and the arithmetic of a decode
    // step's attention one after the other: Zen 4, keys and values from memory, 2 threads, 1.2-1.3x
    // faster, 1-3 tiles ahead alike)
    constexpr int64_t CT = CHUNK * TILE;  // a row's scores in sc
    for (int64_t c = c0; c < std::min(c1, c0 + AHEAD); ++c) prefetch(c);
    for (int64_t cc = c0; cc < c1; cc += CHUNK) {
      const int64_t count = std::min(CHUNK, c1 - cc), keys = count * TILE;
      const float *vts[CHUNK], *vaheads[CHUNK];
      int64_t vss[CHUNK];
      for (int64_t j = 0; j < count; ++j) {
        const int64_t c = cc + j, s0 = (int64_t)(blk.tiles[c] >> 1) * TILE;
        const float* kahead = nullptr;  // a whole tile AHEAD on (a cut last tile is not)
        vaheads[j] = nullptr;
        if (c + AHEAD < c1 && (int64_t)(blk.tiles[c + AHEAD] >> 1) * TILE + TILE <= S) {
          const int64_t sa = (int64_t)(blk.tiles[c + AHEAD] >> 1) * TILE;
          kahead = kb + sa * a.k2, vaheads[j] = vb_ + sa * a.v2;
        }
        const float* kt = kb + s0 * a.k2;
        int64_t ks = a.k2;
        vts[j] = vb_ + s0 * a.v2, vss[j] = a.v2;
        cut_tail(s0, kt, vts[j], ks, vss[j]);
        float* scj = sc + j * TILE;
        int64_t r = 0;
#if defined(__AVX512F__)  // 16 accumulators: each key vector loaded serves 4 rows (32 registers)
        for (; r + 4 <= R; r += 4) tile_scores_dot<4>(qt + r * D, D, kt, ks, scj + r * CT, CT, r ? nullptr : kahead);
        if (R - r == 3) tile_scores_dot<3>(qt + r * D, D, kt, ks, scj + r * CT, CT, r ? nullptr : kahead), r += 3;
#endif
        for (; r + 2 <= R; r += 2) tile_scores_dot<2>(qt + r * D, D, kt, ks, scj + r * CT, CT, r ? nullptr : kahead);
        if (r < R) tile_scores_dot<1>(qt + r * D, D, kt, ks, scj + r * CT, CT, r ? nullptr : kahead);
        if (a.cap > 0.0f)
          for (int64_t r = 0; r < R; ++r)
            for (int64_t i = r * CT; i < r * CT + TILE; i += LN)
              vstore(scj + i, vtanh(vload<vn>(scj + i) / a.cap) * a.cap);
        exclude(c, s0, scj, 1, CT);
      }
      for (int64_t r = 0; r < R; ++r) {  // online softmax over the chunk's keys, in lanes
        float* row = sc + r * CT;
        vn mx = vload<vn>(row);
        for (int64_t i = LN; i < keys; i += LN) mx = vmax(mx, vload<vn>(row + i));
        float top = mx[0];
        for (int64_t j = 1; j < LN; ++j) top = std::max(top, mx[j]);
        // (nothing allowed yet: exp(-inf) = 0)
        const float mn = std::max(m[r], top), base = mn == -INFINITY ? 0.0f : mn;
        vn sum[DC] = {};
        for (int64_t i = 0; i < keys; i += TILE)
          for (int c = 0; c < DC; ++c) {
            const vn e = vexp(vload<vn>(row + i + c * LN) - base);
            vstore(row + i + c * LN, e);
            sum[c] += e;
          }
        const float al = vexp(vn{} + (m[r] - base))[0];
        l[r] = l[r] * al + hsum(sum);
        m[r] = mn;
        alpha[r] = al;
      }
      for (int64_t j = 0; j < count; ++j)  // the values so far rescaled once, with the chunk's first tile
        values_rows(R, acc, D, sc + j * TILE, 1, CT, j ? nullptr : alpha, vts[j], vss[j], vaheads[j]);
    }
  } else {
    // many rows: the rows in vector lanes, the next tile prefetched in a burst
    for (int64_t c = c0; c < c1; ++c) {
      if (c == c0) prefetch(c);
      if (c + 1 < c1) prefetch(c + 1);
      const int64_t s0 = (int64_t)(blk.tiles[c] >> 1) * TILE;
      const float *kt = kb + s0 * a.k2, *vt = vb_ + s0 * a.v2;
      int64_t ks = a.k2, vs = a.v2;
      cut_tail(s0, kt, vt, ks, vs);
      int64_t r = 0;
      for (; r + 3 * LN <= Rp; r += 3 * LN) tile_scores<3, 4>(qt + r, Rp, kt, ks, D, sc + r);
      if (r + 2 * LN <= Rp) tile_scores<2, 4>(qt + r, Rp, kt, ks, D, sc + r);
      else if (r < Rp) tile_scores<1, 8>(qt + r, Rp, kt, ks, D, sc + r);
      // the score of key s for row r: sc[s, r]
      if (a.cap > 0.0f)
        for (int64_t i = 0; i < TILE * Rp; i += LN) vstore(sc + i, vtanh(vload<vn>(sc + i) / a.cap) * a.cap);
      exclude(c, s0, sc, Rp, 1);
      for (int64_t r = 0; r < Rp; r += LN) {  // online softmax, one lane per query row
        vn mx = vload<vn>(sc + r);
        for (int64_t s = 1; s < TILE; ++s) mx = vmax(mx, vload<vn>(sc + s * Rp + r));
        const vn mo = vload<vn>(m + r), mn = vmax(mo, mx);
        const vn base = mn == -INFINITY ? vn{} : mn;  // a row with nothing allowed yet: exp(-inf) = 0
        const vn al = vexp(mo - base);
        vn sum = {};
        for (int64_t s = 0; s < TILE; ++s) {
          const vn e = vexp(vload<vn>(sc + s * Rp + r) - base);
          vstore(sc + s * Rp + r, e);
          sum += e;
        }
        vstore(l + r, vload<vn>(l + r) * al + sum);
        vstore(m + r, mn);
        vstore(alpha + r, al);
      }
      values_rows(R, acc, D, sc, Rp, 1, alpha, vt, vs, nullptr);
    }
  }
  if (part) {
    std::copy(m, m + R, part);
    std::copy(l, l + R, part + Rp);
    std::copy(acc, acc + R * D, part + 2 * Rp);
    return;
  }
  for (int64_t p = 0; p < n; ++p)
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = p * G + h;
      float* o = a.out + ((b * a.T + blk.t0 + p) * a.H + g * G + h) * D;
      const float f = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;  // no allowed key: zeros
      for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * f;
    }
}

// The work of one attention call, worked out before any key is read: which tiles each block of
// query rows attends to, and the items (a key head of a row block, over a range of its tiles)
// handed to the threads. It depends on the shapes, the mask and the thread count only, so a decode
// step's layers that attend over as many keys without a mask share one.
struct AttentionPlan {
  struct Item {
    int64_t b, g, blk, c0, c1, split, part, cost;
  };
  struct Split {
    int64_t b, g, blk, part0, parts;
  };
  std::vector<RowBlock> blocks;
  std::vector<Item> items;
  std::vector<Split> splits;
  std::vector<int64_t> order;  // items, costliest first
  int64_t nparts = 0, RMAX = 0, threads = 0;  // RMAX: query rows of the largest row block, padded
};

// B batch rows of T query positions, H heads in Hkv groups of G, S keys; mp: bool (MB, T, S) or null
AttentionPlan plan_attention(int64_t B, int64_t T, int64_t Hkv, int64_t G, int64_t S, const uint8_t* mp,
                             int64_t MB) {
  AttentionPlan plan;
  std::vector<RowBlock>& blocks = plan.blocks;
  std::vector<AttentionPlan::Item>& items = plan.items;
  std::vector<AttentionPlan::Split>& splits = plan.splits;
  const bool masked = mp != nullptr;
  const int64_t NT = (S + TILE - 1) / TILE, W = (NT + 63) / 64;
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(32, 64 / G));  // positions per row block
  // 1. which tiles each mask row allows
  std::vector<uint64_t> any(masked ? MB * T * W : 0), full(masked ? MB * T * W : 0);
  if (masked)
    at::parallel_for(0, MB * T, std::max<int64_t>(1, (1 << 20) / S), [&](int64_t i0, int64_t i1) {  // ~1 MB a task
      for (int64_t i = i0; i < i1; ++i) scan_mask_row(mp + i * S, S, any.data() + i * W, full.data() + i * W);
    });
  // 2. row blocks
  std::vector<int64_t> first(MB + 1);
  std::vector<uint64_t> U(W), F(W);
  for (int64_t mr = 0; mr < MB; ++mr) {
    first[mr] = blocks.size();
    for (int64_t t = 0; t < T;) {
      int64_t n = 1;
      RowBlock blk{mr, t, 0, {}};
      if (masked) {
        const uint64_t *a0 = any.data() + (mr * T + t) * W, *f0 = full.data() + (mr * T + t) * W;
        std::copy(a0, a0 + W, U.begin());
        std::copy(f0, f0 + W, F.begin());
        for (; n < P && t + n < T; ++n) {
          const uint64_t *ar = a0 + n * W, *fr = f0 + n * W;
          int64_t shared = 0, differ = 0;
          for (int64_t j = 0; j < W; ++j) {
            shared += __builtin_popcountll(U[j] & ar[j]);
            differ += __builtin_popcountll(U[j] ^ ar[j]);
          }
          if (differ > std::max<int64_t>(1, shared / 8)) break;
          for (int64_t j = 0; j < W; ++j) {
            U[j] |= ar[j];
            F[j] &= fr[j];
          }
        }
        for (int64_t j = 0; j < W; ++j)
          for (uint64_t bits = U[j]; bits; bits &= bits - 1) {
            const int64_t bit = __builtin_ctzll(bits);
            blk.tiles.push_back((int32_t)(2 * (64 * j + bit) + ((F[j] >> bit) & 1)));
          }
      } else {
        n = std::min(P, T - t);
        for (int64_t j = 0; j < NT; ++j) blk.tiles.push_back((int32_t)(2 * j + (j < S / TILE)));
      }
      blk.n = n;
      blocks.push_back(std::move(blk));
      t += n;
    }
  }
  first[MB] = blocks.size();
  // 3. work items, split where one would hold more than its share
  const int64_t threads = at::get_num_threads();
  auto rows_of = [&](const RowBlock& blk) { return padded_rows(blk.n * G); };
  auto mrow_of = [&](int64_t b) { return MB == 1 ? 0 : b; };
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = first[mrow_of(b)]; i < first[mrow_of(b) + 1]; ++i)
      total += Hkv * ((int64_t)blocks[i].tiles.size() + 1) * rows_of(blocks[i]);
  const int64_t share = threads > 1 ? std::max<int64_t>(1, total / (4 * threads)) : INT64_MAX;
  int64_t& nparts = plan.nparts;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = first[mrow_of(b)]; i < first[mrow_of(b) + 1]; ++i)
      for (int64_t g = 0; g < Hkv; ++g) {
        const int64_t nt = blocks[i].tiles.size(), cost = (nt + 1) * rows_of(blocks[i]);
        const int64_t pieces = std::max<int64_t>(1, std::min((cost + share - 1) / share, nt / 8));
        const int64_t split = pieces > 1 ? (int64_t)splits.size() : -1;
        if (pieces > 1) splits.push_back({b, g, i, nparts, pieces});
        for (int64_t c = 0; c < pieces; ++c) {
          const int64_t c0 = nt * c / pieces, c1 = nt * (c + 1) / pieces;
          items.push_back({b, g, i, c0, c1, split, pieces > 1 ? nparts++ : -1, (c1 - c0 + 1) * rows_of(blocks[i])});
        }
      }
  std::vector<int64_t>& order = plan.order;
  order.resize(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return items[x].cost > items[y].cost; });
  int64_t most = 1;  // positions in the largest row block
  for (const RowBlock& blk : blocks) most = std::max(most, blk.n);
  plan.RMAX = padded_rows(most * G);
  plan.threads = threads;
  return plan;
}

// Attention calls as planned, one at a time (start), into args.out (B, T, H, D): the threads take the items
// costliest first (work), and the last part of a split item to finish merges them. Its buffers are sized once for
// the plans it takes (a decode stack's layers: an allocation a layer was ~2 us of its first thread's time).
class AttentionRun {
 public:
  // for the plans first .. last - 1, of heads of D values
  AttentionRun(const AttentionPlan* first, const AttentionPlan* last, int64_t D) {
    size_t parts = 0, splits = 0;
    for (const AttentionPlan* plan = first; plan != last; ++plan) {
      parts = std::max<size_t>(parts, plan->nparts * plan->RMAX * (D + 2));
      splits = std::max(splits, plan->splits.size());
    }
    parts_.resize(parts);
    pending_.reset(new std::atomic<int64_t>[splits]);
  }

  // the next call (before any thread works on it)
  void start(const AttentionPlan& plan, const AttentionArgs& args) {
    plan_ = &plan, args_ = args, slot_ = plan.RMAX * (args.D + 2);
    next_.store(0, std::memory_order_relaxed);
    for (size_t i = 0; i < plan.splits.size(); ++i) pending_[i].store(plan.splits[i].parts, std::memory_order_relaxed);
  }

  // items until none is left (w: this thread's scratch, for plan.RMAX rows)
  void work(Scratch& w) {
    const int64_t nitems = plan_->items.size();
    for (int64_t i = next_++; i < nitems; i = next_++) {
      const AttentionPlan::Item& it = plan_->items[plan_->order[i]];
      float* part = it.part >= 0 ? parts_.data() + it.part * slot_ : nullptr;
      attend_tiles(args_, it.b, it.g, plan_->blocks[it.blk], it.c0, it.c1, w, part);
      if (it.split >= 0 && pending_[it.split].fetch_sub(1, std::memory_order_acq_rel) == 1)
        merge(plan_->splits[it.split], w.acc);
    }
  }

 private:
  // a split item's partial states (max, sum, values per query row) merged into the output
  void merge(const AttentionPlan::Split& sp, float* acc) {
    const RowBlock& blk = plan_->blocks[sp.blk];
    const int64_t T = args_.T, H = args_.H, G = args_.G, D = args_.D, Rp = padded_rows(blk.n * G);
    for (int64_t p = 0; p < blk.n; ++p)
      for (int64_t h = 0; h < G; ++h) {
        const int64_t r = p * G + h;
        float best = -INFINITY, sum = 0.0f;
        for (int64_t c = 0; c < sp.parts; ++c) best = std::max(best, parts_[(sp.part0 + c) * slot_ + r]);
        std::fill(acc, acc + D, 0.0f);
        if (best > -INFINITY)
          for (int64_t c = 0; c < sp.parts; ++c) {
            const float* pa = parts_.data() + (sp.part0 + c) * slot_;
            if (pa[r] == -INFINITY) continue;
            const float f = std::exp(pa[r] - best);
            sum += pa[Rp + r] * f;
            for (int64_t d = 0; d < D; ++d) acc[d] += f * pa[2 * Rp + r * D + d];
          }
        float* o = args_.out + ((sp.b * T + blk.t0 + p) * H + sp.g * G + h) * D;
        const float f = sum > 0.0f ? 1.0f / sum : 0.0f;  // no allowed key: zeros
        for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * f;
      }
  }

  const AttentionPlan* plan_ = nullptr;
  AttentionArgs args_{};
  int64_t slot_ = 0;
  std::vector<float> parts_;
  std::unique_ptr<std::atomic<int64_t>[]> pending_;
  std::atomic<int64_t> next_{0};
};

// attends as planned, into args.out (B, T, H, D), in one parallel region (each region can wait a time
// slice for a thread on a busy host)
void attend(const AttentionPlan& plan, const AttentionArgs& args) {
  AttentionRun run(&plan, &plan + 1, args.D);
  run.start(plan, args);
  at::parallel_for(0, std::min<int64_t>(plan.threads, plan.items.size()), 1, [&](int64_t, int64_t) {
    Scratch w(plan.RMAX, args.D);
    run.work(w);
  });
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                     double scale, double softcap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat &&
              k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "kvgen: attention takes 4-D float32");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(D % 16 == 0 && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && H % Hkv == 0,
              "kvgen: attention needs a head size that is a multiple of 16 and contiguous heads");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && k.size(3) == D &&
              v.size(3) == D, "kvgen: attention's keys and values must be (B, Hkv, S, D)");
  const bool masked = mask.has_value() && mask->defined();
  at::Tensor m;
  if (masked) {
    m = mask->contiguous();
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && (m.size(0) == B || m.size(0) == 1) &&
                m.size(1) == 1 && m.size(2) == T && m.size(3) == S,
                "kvgen: attention mask must be bool (B or 1, 1, T, S)");
  }
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  if (B == 0 || T == 0 || H == 0) return out.transpose(1, 2);
  if (S == 0) return out.zero_().transpose(1, 2);
  const uint8_t* mp = masked ? reinterpret_cast<const uint8_t*>(m.data_ptr<bool>()) : nullptr;
  const AttentionPlan plan = plan_attention(B, T, Hkv, H / Hkv, S, mp, masked ? m.size(0) : 1);
  const AttentionArgs args{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                           v.stride(0), v.stride(1), v.stride(2), mp, T, S, H, H / Hkv, D, (float)scale, (float)softcap,
                           out.data_ptr<float>()};
  attend(plan, args);
  return out.transpose(1, 2);
}

}  // namespace

// ---- Decoder layers (Llama family, Gemma 2/3) on stored-precision weights: the dense parts of a
// decode step's layer as two ops, so the step pays a few op calls per layer instead of ~40 small
// ones. Each computes what the eager modules compute (rms_norm, qmatmul and float32 element-wise
// steps in the same order, each product rounded before its sum), so the two paths agree up to the
// last bit of the activation's exp / tanh.

// Where a layer's queries, keys and values go: (B, heads, T, D) rows at p + b * s0 + h * s1 + t * s2.
struct Heads {
  float* p;
  int64_t s0, s1, s2;
};

// The heads of a fused q/k/v product's rows (B * T rows of (H + 2 Hkv) D values): optional RMSNorm
// of each query / key head (Qwen3, Gemma 3), rotary on the query and key heads (cos/sin (B * T, D),
// sin's first half negated: rotated = x * cos + roll(x, D / 2) * sin, as kvgen.rope.apply_rotary),
// written to q, k and v; heads h0 .. h1 - 1 of the product's H + 2 Hkv.
void rotate_heads(const float* src, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, const float* cp,
                  const float* sp, const float* qn, const float* kn, double head_eps, double offset, Heads q, Heads k,
                  Heads v, int64_t h0, int64_t h1) {
  const int64_t runs = D / 16, half = runs / 2, width = (H + 2 * Hkv) * D;
  // rows in parallel (a prefill's; a decode step's few rows stay on this thread)
  at::parallel_for(0, B * T, std::max<int64_t>(1, 4096 / width), [&](int64_t r0, int64_t r1) {
    std::vector<float> normed(D);
    for (int64_t bt = r0; bt < r1; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      const float *row = src + bt * width, *cr = cp + bt * D, *sr = sp + bt * D;
      for (int64_t h = h0; h < h1; ++h) {
        const float* in = row + h * D;
        float* out = h < H ? q.p + b * q.s0 + h * q.s1 + t * q.s2
                   : h < H + Hkv ? k.p + b * k.s0 + (h - H) * k.s1 + t * k.s2
                                 : v.p + b * v.s0 + (h - H - Hkv) * v.s1 + t * v.s2;
        if (h >= H + Hkv) {
          std::memcpy(out, in, D * sizeof(float));
          continue;
        }
        const float* head_norm = h < H ? qn : kn;
        if (head_norm != nullptr) {
          rms_row(in, head_norm, D, head_eps, normed.data(), (float)offset);
          in = normed.data();
        }
        for (int64_t j = 0; j < runs; ++j) {  // rolled by D / 2: run j reads run (j + half) mod runs
          const vf a = round(loadf(in + 16 * j) * loadf(cr + 16 * j));
          const vf r = round(loadf(in + 16 * ((j + half) % runs)) * loadf(sr + 16 * j));
          const vf sum = a + r;
          std::memcpy(out + 16 * j, &sum, 64);
        }
      }
    }
  });
}

const float* data_or_null(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

// rms_norm(x) -> one fused q/k/v product -> optional RMSNorm of each query / key head (Qwen3,
// Gemma 3) -> rotary on the query and key heads. x (B, T, hidden); cos/sin (B, T, D) with sin's first
// half negated (rotated = x * cos + roll(x, D / 2) * sin, as kvgen.rope.apply_rotary). Returns q (B,
// H, T, D), k and v (B, Hkv, T, D), contiguous.
std::vector<at::Tensor> decoder_attention_inputs(const at::Tensor& x, const at::Tensor& norm, double eps,
                                                 at::TensorList ws, at::IntArrayRef formats, const at::Tensor& cos,
                                                 const at::Tensor& sin, int64_t H, int64_t Hkv,
                                                 const c10::optional<at::Tensor>& q_norm,
                                                 const c10::optional<at::Tensor>& k_norm, double head_eps,
                                                 double offset) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
              cos.size(1) == x.size(1) && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "kvgen: decoder_attention_inputs takes x (B, T, hidden) and float32 cos/sin (B, T, D)");
  const int64_t B = x.size(0), T = x.size(1), D = cos.size(2), R = B * T;
  TORCH_CHECK(D % 32 == 0, "kvgen: decoder_attention_inputs needs a head size that is a multiple of 32, not ", D);
  for (const auto* n : {&q_norm, &k_norm})
    TORCH_CHECK(!n->has_value() || ((*n)->numel() == D && (*n)->is_contiguous() && (*n)->scalar_type() == at::kFloat),
                "kvgen: a head norm holds D float32 weights");
  const at::Tensor qkv = qmatmul(rms_norm_offset(x.contiguous(), norm, eps, offset).view({R, x.size(2)}), ws, formats);  // (R, (H + 2 Hkv) D)
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "kvgen: the q/k/v product has ", qkv.size(1), " features, not (",
              H, " + 2 * ", Hkv, ") * ", D);
  const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
  at::Tensor q = at::empty({B, H, T, D}, x.options()), k = at::empty({B, Hkv, T, D}, x.options()),
             v = at::empty({B, Hkv, T, D}, x.options());
  rotate_heads(qkv.data_ptr<float>(), B, T, H, Hkv, D, c.data_ptr<float>(), sn.data_ptr<float>(),
               data_or_null(q_norm), data_or_null(k_norm), head_eps, offset, {q.data_ptr<float>(), H * T * D, T * D, D},
               {k.data_ptr<float>(), Hkv * T * D, T * D, D}, {v.data_ptr<float>(), Hkv * T * D, T * D, D}, 0,
               H + 2 * Hkv);
  return {q, k, v};
}

// y[i] = x[i] + y[i] over n values: y becomes x + y, as ATen adds them
void add_into(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] + y[i];
}

// act(g) * u of gate_up = [g, u] (R rows of 2 I) -> (R, I), as a gated MLP computes it: act 0 SiLU, 1
// GELU (tanh), 16 values at a time (vexp / vtanh: a few ulp, as ATen's vectorised ones; the C
// library's one value at a time cost a decode step ~10 us a layer for SmolLM2, ~40 us for Gemma 3's
// tanh), rows in parallel (a prefill: ATen's gelu and mul of two strided halves took ~2 ms a layer)
void gated_rows(const float* g, int64_t R, int64_t I, int64_t act, float* mp) {
  auto activate = [act](auto gv) {
    if (act == 0) return gv / (1.0f + vexp(-gv));
    const auto inner = 0.7978845608028654f * (gv + 0.044715f * (gv * gv * gv));  // ATen's tanh GELU
    return 0.5f * gv * (1.0f + vtanh(inner));
  };
  at::parallel_for(0, R, std::max<int64_t>(1, 8192 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *gr = g + r * 2 * I, *ur = gr + I;
      float* out = mp + r * I;
      int64_t j = 0;
      for (; j + 16 <= I; j += 16) {
        const vf a = activate(loadf(gr + j));  // a product apart from the one by u: act(g) rounded first
        const vf y = a * loadf(ur + j);
        std::memcpy(out + j, &y, 64);
      }
      for (; j < I; ++j) {
        float a = activate(vf{} + gr[j])[0];
        asm("" : "+x"(a));  // rounded before the product, as act(g) * u
        out[j] = a * ur[j];
      }
    }
  });
}

at::Tensor gated_activation(const at::Tensor& gate_up, int64_t act) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() && gate_up.dim() >= 1 &&
              gate_up.size(-1) % 2 == 0, "kvgen: gated_activation takes contiguous float32 (..., 2 I)");
  TORCH_CHECK(act == 0 || act == 1, "kvgen: the activation is 0 (SiLU) or 1 (GELU, tanh), not ", act);
  const int64_t I = gate_up.size(-1) / 2, R = I ? gate_up.numel() / (2 * I) : 0;
  std::vector<int64_t> sizes = gate_up.sizes().vec();
  sizes.back() = I;
  at::Tensor m = at::empty(sizes, gate_up.options());
  gated_rows(gate_up.data_ptr<float>(), R, I, act, m.data_ptr<float>());
  return m;
}

// The weights of a decoder layer's MLP half (kvgen::decoder_mlp): the o, gate/up and down products and
// the norms (post_attention and post_feedforward: Gemma's sandwich norms, else null).
struct MlpWeights {
  Product o, gate_up, down;
  const float *post_attention, *pre_feedforward, *post_feedforward;
  int64_t hidden, I, act;
  double eps, offset;
};

MlpWeights mlp_weights(at::TensorList o, at::IntArrayRef o_formats, const c10::optional<at::Tensor>& post_attention,
                       const at::Tensor& pre_feedforward, const c10::optional<at::Tensor>& post_feedforward,
                       at::TensorList gate_up, at::IntArrayRef gate_up_formats, at::TensorList down,
                       at::IntArrayRef down_formats, int64_t act, int64_t attn_width, int64_t hidden, double eps,
                       double offset) {
  TORCH_CHECK(act == 0 || act == 1, "kvgen: decoder_mlp's activation is 0 (SiLU) or 1 (GELU, tanh), not ", act);
  for (const at::Tensor* n : {&pre_feedforward, post_attention ? &*post_attention : nullptr,
                              post_feedforward ? &*post_feedforward : nullptr})
    TORCH_CHECK(!n || (n->numel() == hidden && n->is_contiguous() && n->scalar_type() == at::kFloat),
                "kvgen: decoder_mlp's norms hold hidden = ", hidden, " float32 weights");
  MlpWeights w{make_product(o, o_formats, attn_width), make_product(gate_up, gate_up_formats, hidden), {},
               data_or_null(post_attention), pre_feedforward.data_ptr<float>(), data_or_null(post_feedforward),
               hidden, 0, act, eps, offset};
  TORCH_CHECK(w.o.N == hidden, "kvgen: o has ", w.o.N, " rows, the hidden size is ", hidden);
  TORCH_CHECK(w.gate_up.N % 2 == 0, "kvgen: gate/up has an odd number of rows (", w.gate_up.N, ")");
  w.I = w.gate_up.N / 2;
  w.down = make_product(down, down_formats, w.I);
  TORCH_CHECK(w.down.N == hidden, "kvgen: down has ", w.down.N, " rows, the hidden size is ", hidden);
  return w;
}

// Rows of a layer's MLP half, R of each: the products' outputs o and down (hidden) and gate/up (2 I), which
// every thread of a parallel region reads, and those a thread computes for itself: h and normed (hidden),
// act(g) * u (I). h may be o, and mlp_rows' out may be down, where one thread computes them all.
struct MlpScratch {
  float *o, *gu, *down;
  float *h, *normed, *m;
};

// y = rms_norm(x) * (norm + offset) where a norm is given, else a copy of x (none where y is x)
void norm_or_copy(const float* x, const float* norm, int64_t R, int64_t hidden, double eps, double offset, float* y) {
  if (norm)
    rms_rows(x, norm, R, hidden, eps, offset, y);
  else if (y != x)
    std::memcpy(y, x, R * hidden * sizeof(float));
}

// out = h + post_feedforward(act(g) * u @ down^T) with [g, u] = pre_feedforward(h) @ gate_up^T, h = x +
// post_attention(attn @ o^T); x and out (R, hidden), attn (R, attn_width). product(p, in, ldx, y) computes a
// product's rows (this thread's share of them in a region); products_done() returns once every thread's
// share is in (a barrier; nothing for one thread). The decode stack's region and kvgen::decoder_mlp both run
// this, so they compute the same bits.
template <class ProductFn, class Done>
void mlp_rows(const MlpWeights& w, const float* x, const float* attn, int64_t R, const MlpScratch& s, float* out,
              ProductFn product, Done products_done) {
  const int64_t hidden = w.hidden;
  product(w.o, attn, w.o.K, s.o);
  products_done();
  norm_or_copy(s.o, w.post_attention, R, hidden, w.eps, w.offset, s.h);
  add_into(s.h, x, R * hidden);
  rms_rows(s.h, w.pre_feedforward, R, hidden, w.eps, w.offset, s.normed);
  product(w.gate_up, s.normed, hidden, s.gu);
  products_done();
  gated_rows(s.gu, R, w.I, w.act, s.m);
  product(w.down, s.m, w.I, s.down);
  products_done();
  norm_or_copy(s.down, w.post_feedforward, R, hidden, w.eps, w.offset, out);
  add_into(out, s.h, R * hidden);
}

// h = x + post_attention(attn @ o^T); out = h + post_feedforward((act(g) * u) @ down^T) with
// [g, u] = pre_feedforward(h) @ gate_up^T. act: 0 SiLU, 1 GELU (tanh). The post norms are Gemma's
// sandwich norms (absent for Llama); every norm scales by weight + offset (Gemma: 1). x (B, T,
// hidden) and attn (B, T, H * D).
at::Tensor decoder_mlp(const at::Tensor& x, const at::Tensor& attn, at::TensorList o, at::IntArrayRef o_formats,
                       const c10::optional<at::Tensor>& post_attention, const at::Tensor& pre_feedforward,
                       const c10::optional<at::Tensor>& post_feedforward, double eps, at::TensorList gate_up,
                       at::IntArrayRef gate_up_formats, at::TensorList down, at::IntArrayRef down_formats, int64_t act,
                       double offset) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && attn.scalar_type() == at::kFloat && attn.dim() >= 1 &&
              attn.numel() == x.size(0) * x.size(1) * attn.size(-1),
              "kvgen: decoder_mlp takes x (B, T, hidden) and attn (B, T, features) float32");
  const int64_t R = x.size(0) * x.size(1), hidden = x.size(2);
  const MlpWeights w = mlp_weights(o, o_formats, post_attention, pre_feedforward, post_feedforward, gate_up,
                                   gate_up_formats, down, down_formats, act, attn.size(-1), hidden, eps, offset);
  const at::Tensor xc = x.contiguous(), ac = attn.contiguous();
  at::Tensor scratch = at::empty({R * (2 * hidden + 3 * w.I)}, x.options()), out = at::empty(x.sizes(), x.options());
  float *const h = scratch.data_ptr<float>(), *const normed = h + R * hidden, *const gu = normed + R * hidden;
  float* const op = out.data_ptr<float>();
  mlp_rows(w, xc.data_ptr<float>(), ac.data_ptr<float>(), R, {h, gu, op, h, normed, gu + 2 * R * w.I}, op,
           [&](const Product& p, const float* in, int64_t ldx, float* y) { product_into(p, in, ldx, R, y); }, [] {});
  return out;
}

// A decode stack's weights, registered once (kvgen::decoder_stack) and named by an id in each step's
// kvgen::decoder_layers, rather than the ~300 tensors of SmolLM2's 30 layers converted from Python
// lists and checked at every call.
struct StackLayer {
  const float *input_norm, *q_norm, *k_norm;
  Product qkv;
  MlpWeights mlp;
  double scale, softcap;
};

struct StackWeights {
  std::vector<StackLayer> layers;
  // every tensor the layers' pointers read, the storage it had and where its data was: a tensor whose data is
  // set anew (``param.data = ...``, ``module.to(...)``) keeps its object, so the stack must look at the data
  std::vector<std::tuple<at::Tensor, c10::Storage, const void*>> held;
  int64_t H, Hkv, D, hidden, I;  // I: the largest intermediate size
  double eps, head_eps, offset;

  void hold(const at::Tensor& t) { held.emplace_back(t, t.storage(), t.const_data_ptr()); }
  // whether a held tensor's data moved since registration (its old storage is kept alive: no dangling pointer)
  bool moved() const {
    for (const auto& [t, storage, data] : held)
      if (t.const_data_ptr() != data) return true;
    return false;
  }
};

std::mutex g_stacks_mutex;
std::unordered_map<int64_t, std::shared_ptr<const StackWeights>> g_stacks;
int64_t g_next_stack = 1;

// each layer's first segment of a list of weight segments, counts[i] of them per layer, then the end
std::vector<int64_t> firsts(at::TensorList ws, at::IntArrayRef formats, at::IntArrayRef counts, const char* what) {
  TORCH_CHECK(formats.size() == ws.size(), "kvgen: decoder_stack takes one format per ", what, " segment");
  std::vector<int64_t> out{0};
  for (int64_t c : counts) {
    TORCH_CHECK(c > 0, "kvgen: decoder_stack's layers each have at least one ", what, " segment");
    out.push_back(out.back() + c);
  }
  TORCH_CHECK(out.back() == (int64_t)ws.size(), "kvgen: decoder_stack's ", what, " counts add up to ", out.back(),
              " segments, not ", ws.size());
  return out;
}

// Registers the weights of L decoder layers (layer i's weight segments: the next qkv_counts[i]
// (o_counts[i], ...) tensors of qkv (o, ...)); returns the id kvgen::decoder_layers takes.
int64_t decoder_stack(at::ArrayRef<double> scales, at::ArrayRef<double> softcaps, at::TensorList input_norms,
                      const c10::List<c10::optional<at::Tensor>>& q_norms,
                      const c10::List<c10::optional<at::Tensor>>& k_norms, at::TensorList qkv,
                      at::IntArrayRef qkv_formats, at::IntArrayRef qkv_counts, at::TensorList o,
                      at::IntArrayRef o_formats, at::IntArrayRef o_counts,
                      const c10::List<c10::optional<at::Tensor>>& post_attention,
                      at::TensorList pre_feedforward, const c10::List<c10::optional<at::Tensor>>& post_feedforward,
                      at::TensorList gate_up, at::IntArrayRef gate_up_formats, at::IntArrayRef gate_up_counts,
                      at::TensorList down, at::IntArrayRef down_formats, at::IntArrayRef down_counts, int64_t H,
                      int64_t Hkv, double eps, double head_eps, double offset, int64_t act) {
  const size_t L = input_norms.size();
  for (size_t n : {scales.size(), softcaps.size(), q_norms.size(), k_norms.size(), qkv_counts.size(),
                   o_counts.size(), post_attention.size(), pre_feedforward.size(), post_feedforward.size(),
                   gate_up_counts.size(), down_counts.size()})
    TORCH_CHECK(n == L, "kvgen: decoder_stack takes one entry per layer in every per-layer list (", L, " layers)");
  TORCH_CHECK(L > 0 && H > 0 && Hkv > 0 && H % Hkv == 0, "kvgen: decoder_stack takes at least one layer, and ",
              "query heads (", H, ") in groups of the key heads (", Hkv, ")");
  const std::vector<int64_t> qkv_first = firsts(qkv, qkv_formats, qkv_counts, "q/k/v"),
                             o_first = firsts(o, o_formats, o_counts, "o"),
                             gate_up_first = firsts(gate_up, gate_up_formats, gate_up_counts, "gate/up"),
                             down_first = firsts(down, down_formats, down_counts, "down");
  auto w = std::make_shared<StackWeights>();
  const int64_t hidden = input_norms[0].numel();
  *w = StackWeights{{}, {}, H, Hkv, 0, hidden, 0, eps, head_eps, offset};
  auto slice = [](auto list, const std::vector<int64_t>& first, size_t i) {
    return list.slice(first[i], first[i + 1] - first[i]);
  };
  auto norm = [&](const c10::optional<at::Tensor>& t, int64_t n, const char* what) -> const float* {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->numel() == n && t->is_contiguous() && t->scalar_type() == at::kFloat, "kvgen: decoder_stack's ",
                what, " norms hold ", n, " float32 weights");
    w->hold(*t);
    return t->data_ptr<float>();
  };
  for (size_t i = 0; i < L; ++i) {
    Product p = make_product(slice(qkv, qkv_first, i), slice(qkv_formats, qkv_first, i), hidden);
    const int64_t D = p.N / (H + 2 * Hkv);
    TORCH_CHECK(D % 32 == 0 && D > 0 && p.N == (H + 2 * Hkv) * D && (i == 0 || D == w->D),
                "kvgen: decoder_stack's q/k/v products have (H + 2 Hkv) D rows, D the same multiple of 32 in every "
                "layer; layer ", i, " has ", p.N);
    w->D = D;
    const float* input = norm(input_norms[i], hidden, "input");
    const float *qn = norm(q_norms.get(i), D, "query head"), *kn = norm(k_norms.get(i), D, "key head");
    MlpWeights mlp = mlp_weights(slice(o, o_first, i), slice(o_formats, o_first, i), post_attention.get(i),
                                 pre_feedforward[i], post_feedforward.get(i), slice(gate_up, gate_up_first, i),
                                 slice(gate_up_formats, gate_up_first, i), slice(down, down_first, i),
                                 slice(down_formats, down_first, i), act, H * D, hidden, eps, offset);
    for (const c10::optional<at::Tensor>& t : {post_attention.get(i), c10::optional<at::Tensor>(pre_feedforward[i]),
                                               post_feedforward.get(i)})
      if (t.has_value()) w->hold(*t);
    w->I = std::max(w->I, mlp.I);
    w->layers.push_back({input, qn, kn, std::move(p), std::move(mlp), scales[i], softcaps[i]});
  }
  for (const StackLayer& l : w->layers)
    for (const Product* p : {&l.qkv, &l.mlp.o, &l.mlp.gate_up, &l.mlp.down})
      for (const at::Tensor& t : p->held) w->hold(t);
  std::lock_guard<std::mutex> lock(g_stacks_mutex);
  g_stacks.emplace(g_next_stack, std::move(w));
  return g_next_stack++;
}

// forgets a registered stack (its tensors are released once no step runs it)
void decoder_stack_free(int64_t id) {
  std::lock_guard<std::mutex> lock(g_stacks_mutex);
  g_stacks.erase(id);
}

// A barrier for the n threads of a parallel region, spinning (a decode step's phases are a few
// microseconds apart; an OpenMP region per phase cost ~1 us to open and close), then yielding.
class SpinBarrier {
 public:
  void wait(int64_t n) {
    const int64_t phase = phase_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins)
      if (spins < 4096) _mm_pause(); else std::this_thread::yield();  // (~0.1 ms of pauses: more threads than cores)
  }

 private:
  alignas(64) std::atomic<int64_t> count_{0};
  alignas(64) std::atomic<int64_t> phase_{0};
};

// A whole decode step's layers as one op, so that the step pays one op call instead of a few Python
// calls per layer: for each layer i of registered stack `stack`, what decoder_attention_inputs
// computes (rotary tables cos[tables[i]], sin[tables[i]]), its new keys and values written into the
// last T of slots starts[i] .. ends[i] - 1 of keys[i] / values[i] (B, Hkv, slots, D: the cache's
// buffers, room already made for them); attention of the queries over those slots with masks[i] (B
// or 1, 1, T, ends[i] - starts[i]); what decoder_mlp computes. The same functions as those ops, in
// the same order, so the two paths give the same bits; here on raw rows in one scratch allocation,
// with every check made before the first layer, and one attention plan for the layers that attend
// over as many slots without a mask (the ops' ATen calls, allocations and plans were ~25 us a layer,
// a sixth of a SmolLM2 step on 2 cores). Returns an empty tensor, having done nothing, where a registered
// tensor's data has moved since kvgen::decoder_stack (the caller registers the weights anew).
at::Tensor decoder_layers(const at::Tensor& x0, at::TensorList cos, at::TensorList sin, at::IntArrayRef tables,
                          at::TensorList keys, at::TensorList values, at::IntArrayRef starts, at::IntArrayRef ends,
                          const c10::List<c10::optional<at::Tensor>>& masks, int64_t stack) {
  std::shared_ptr<const StackWeights> found;
  {
    std::lock_guard<std::mutex> lock(g_stacks_mutex);
    const auto it = g_stacks.find(stack);
    TORCH_CHECK(it != g_stacks.end(), "kvgen: decoder_layers: no registered stack ", stack,
                " (register the weights with kvgen::decoder_stack, and keep them until the last step)");
    found = it->second;
  }
  const StackWeights& w = *found;
  if (w.moved()) return at::empty({0}, x0.options());  // nothing done: the caller registers the weights anew
  const size_t L = w.layers.size();
  const int64_t H = w.H, Hkv = w.Hkv, D = w.D, hidden = w.hidden;
  for (size_t n : {tables.size(), keys.size(), values.size(), starts.size(), ends.size(), masks.size()})
    TORCH_CHECK(n == L, "kvgen: decoder_layers takes one entry per layer in every per-layer list (", L, " layers)");
  TORCH_CHECK(x0.dim() == 3 && x0.scalar_type() == at::kFloat && x0.size(2) == hidden,
              "kvgen: decoder_layers takes x (B, T, hidden = ", hidden, ") float32");
  const int64_t B = x0.size(0), T = x0.size(1), R = B * T;
  TORCH_CHECK(cos.size() == sin.size(), "kvgen: decoder_layers takes as many cos tables as sin tables");
  std::vector<at::Tensor> cs, ss;
  for (size_t j = 0; j < cos.size(); ++j) {
    TORCH_CHECK(cos[j].dim() == 3 && cos[j].sizes() == sin[j].sizes() && cos[j].size(0) == B &&
                cos[j].size(1) == T && cos[j].size(2) == D && cos[j].scalar_type() == at::kFloat &&
                sin[j].scalar_type() == at::kFloat, "kvgen: decoder_layers' rotary tables are float32 (B, T, D)");
    cs.push_back(cos[j].contiguous());
    ss.push_back(sin[j].contiguous());
  }
  std::vector<at::Tensor> ms(L);
  std::vector<const uint8_t*> mps(L);  // each layer's mask (B or 1, T, slots), or null: every slot allowed
  for (size_t i = 0; i < L; ++i) {
    TORCH_CHECK(0 <= tables[i] && tables[i] < (int64_t)cos.size(), "kvgen: decoder_layers' layer ", i,
                " takes rotary table ", tables[i], " of ", cos.size());
    for (const at::Tensor* kv : {&keys[i], &values[i]})
      TORCH_CHECK(kv->dim() == 4 && kv->scalar_type() == at::kFloat && kv->size(0) == B && kv->size(1) == Hkv &&
                  kv->size(3) == D && kv->stride(3) == 1 && 0 <= starts[i] && starts[i] + T <= ends[i] &&
                  ends[i] <= kv->size(2), "kvgen: decoder_layers' keys and values of layer ", i, " must be float32 ",
                  "(B, Hkv, slots, D) buffers with contiguous heads holding slots ", starts[i], " .. ", ends[i],
                  " - 1, at least T = ", T, " of them");
    const c10::optional<at::Tensor> mask = masks.get(i);
    if (mask.has_value() && mask->defined()) {
      ms[i] = mask->contiguous();
      TORCH_CHECK(ms[i].scalar_type() == at::kBool && ms[i].dim() == 4 && (ms[i].size(0) == B || ms[i].size(0) == 1) &&
                  ms[i].size(1) == 1 && ms[i].size(2) == T && ms[i].size(3) == ends[i] - starts[i],
                  "kvgen: decoder_layers' mask of layer ", i, " must be bool (B or 1, 1, T, slots)");
      mps[i] = reinterpret_cast<const uint8_t*>(ms[i].data_ptr<bool>());
    }
  }
  if (R == 0) return x0.clone();
  // every layer's attention plan, before the first layer
  std::vector<AttentionPlan> plans;  // the masked layers', then one per slot count of the others
  plans.reserve(L);
  std::vector<const AttentionPlan*> plan_of(L);
  std::vector<std::pair<int64_t, const AttentionPlan*>> by_slots;
  int64_t RMAX = 1;
  for (size_t i = 0; i < L; ++i) {
    const int64_t S = ends[i] - starts[i];
    const auto it = std::find_if(by_slots.begin(), by_slots.end(), [&](const auto& p) { return p.first == S; });
    if (!mps[i] && it != by_slots.end()) {
      plan_of[i] = it->second;
      continue;
    }
    plan_of[i] = &plans.emplace_back(plan_attention(B, T, Hkv, H / Hkv, S, mps[i], mps[i] ? ms[i].size(0) : 1));
    if (!mps[i]) by_slots.emplace_back(S, plan_of[i]);
    RMAX = std::max(RMAX, plans.back().RMAX);
  }
  // rows shared by the threads: q/k/v (width), q and attention (H D), o and down (hidden), gate/up (2 I);
  // each thread's own: x, normed and h (hidden), act(g) * u (I)
  const int64_t width = (H + 2 * Hkv) * D, I = w.I, threads = at::get_num_threads();
  const int64_t shared = R * (width + 2 * H * D + 2 * hidden + 2 * I), own = R * (3 * hidden + I);
  at::Tensor scratch = at::empty({shared + threads * own}, x0.options()), out = at::empty(x0.sizes(), x0.options());
  float* const qkv = scratch.data_ptr<float>();
  float *const q = qkv + R * width, *const attn = q + R * H * D, *const o = attn + R * H * D;
  float *const down = o + R * hidden, *const gu = down + R * hidden;
  const at::Tensor xc = x0.contiguous();
  SpinBarrier barrier;
  AttentionRun run(plans.data(), plans.data() + plans.size(), D);  // the present layer's attention
  // One parallel region for all layers, its phases apart by a spinning barrier (an OpenMP region per
  // product and attention was 5 regions a layer: the layers 1.06x / 1.10x faster for SmolLM2 / Gemma 3
  // at 2 threads, Zen 4). Each thread computes the few rows between products itself (norms, residuals,
  // act(g) * u: mlp_rows with a barrier after each product), so that only the products' and attention's
  // outputs are shared.
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), n = std::min<int64_t>(omp_get_num_threads(), threads);
    if (t < n) {
      float* const x = gu + R * 2 * I + t * own;
      float *const xn = x + R * hidden, *const h = xn + R * hidden, *const m = h + R * hidden;
      std::memcpy(x, xc.data_ptr<float>(), R * hidden * sizeof(float));
      Scratch scratch_rows(RMAX, D);
      // this thread's share of rows 0 .. N - 1, as at::parallel_for would split them
      auto product = [&](const Product& p, const float* in, int64_t ldx, float* y) {
        const ProductInput rows = product_input(p, in, ldx, R);
        const int64_t tasks = std::min(n, (p.N + product_grain(p) - 1) / product_grain(p));
        const int64_t chunk = (p.N + tasks - 1) / tasks;
        if (t < tasks) product_rows(p, rows, t * chunk, std::min(p.N, (t + 1) * chunk), y);
      };
      for (size_t i = 0; i < L; ++i) {
        const StackLayer& l = w.layers[i];
        const int64_t S = ends[i] - starts[i];
        const at::Tensor &k = keys[i], &v = values[i];
        float *kp = k.data_ptr<float>() + starts[i] * k.stride(2), *vp = v.data_ptr<float>() + starts[i] * v.stride(2);
        rms_rows(x, l.input_norm, R, hidden, w.eps, w.offset, xn);
        product(l.qkv, xn, hidden, qkv);
        if (t == 0)  // (the last layer's run ended before its o product)
          run.start(*plan_of[i], AttentionArgs{q, kp, vp, H * T * D, T * D, D, k.stride(0), k.stride(1), k.stride(2),
                                               v.stride(0), v.stride(1), v.stride(2), mps[i], T, S, H, H / Hkv, D,
                                               (float)l.scale, (float)l.softcap, attn});
        barrier.wait(n);
        const int64_t heads = H + 2 * Hkv, per = (heads + n - 1) / n;
        rotate_heads(qkv, B, T, H, Hkv, D, cs[tables[i]].data_ptr<float>(), ss[tables[i]].data_ptr<float>(),
                     l.q_norm, l.k_norm, w.head_eps, w.offset, {q, H * T * D, T * D, D},
                     {kp + (S - T) * k.stride(2), k.stride(0), k.stride(1), k.stride(2)},
                     {vp + (S - T) * v.stride(2), v.stride(0), v.stride(1), v.stride(2)}, std::min(heads, t * per),
                     std::min(heads, (t + 1) * per));
        barrier.wait(n);
        run.work(scratch_rows);
        barrier.wait(n);
        mlp_rows(l.mlp, x, attn, R, {o, gu, down, h, xn, m}, x, product, [&] { barrier.wait(n); });
      }
      if (t == 0) std::memcpy(out.data_ptr<float>(), x, R * hidden * sizeof(float));
    }
  }
  return out;
}

// the formats whose products take integer dot products on this CPU (AVX-512 VNNI), else none
std::vector<int64_t> integer_dot_formats() {
#if defined(KVGEN_DOT8)
  return {2002, 2003, 2006, 2008, 2012, 2014, 3008, 3032, 3064, 3128};
#else
  return {};
#endif
}

// the formats whose products of 16 input rows or more take AMX's tile products (the integer dot formats' sums 16 x 16
// at a time; BF16 with the rows in three bfloat16 parts), else none
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

TORCH_LIBRARY(kvgen, m) {
  m.def("integer_dot_formats() -> int[]", integer_dot_formats);
  m.def("tile_formats() -> int[]", tile_formats);
  m.def("qmatmul(Tensor x, Tensor[] ws, int[] formats) -> Tensor");
  m.def("dequantize_(Tensor(a!) out, Tensor w, int format) -> ()");
  m.def("embedding(Tensor w, Tensor ids, int k, int format) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset=0.0) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float softcap) -> Tensor");
  m.def("decoder_attention_inputs(Tensor x, Tensor norm, float eps, Tensor[] ws, int[] formats, Tensor cos, "
        "Tensor sin, int heads, int kv_heads, Tensor? q_norm, Tensor? k_norm, float head_eps, float offset) -> Tensor[]");
  m.def("decoder_mlp(Tensor x, Tensor attn, Tensor[] o, int[] o_formats, Tensor? post_attention, "
        "Tensor pre_feedforward, Tensor? post_feedforward, float eps, Tensor[] gate_up, int[] gate_up_formats, "
        "Tensor[] down, int[] down_formats, int act, float offset) -> Tensor");
  m.def("gated_activation(Tensor gate_up, int act) -> Tensor");
  m.def("decoder_stack(float[] scales, float[] softcaps, Tensor[] input_norms, Tensor?[] q_norms, "
        "Tensor?[] k_norms, Tensor[] qkv, int[] qkv_formats, int[] qkv_counts, Tensor[] o, int[] o_formats, "
        "int[] o_counts, Tensor?[] post_attention, Tensor[] pre_feedforward, Tensor?[] post_feedforward, "
        "Tensor[] gate_up, int[] gate_up_formats, int[] gate_up_counts, Tensor[] down, int[] down_formats, "
        "int[] down_counts, int heads, int kv_heads, float eps, float head_eps, float offset, int act) -> int",
        decoder_stack);
  m.def("decoder_stack_free(int stack) -> ()", decoder_stack_free);
  m.def("decoder_layers(Tensor x, Tensor[] cos, Tensor[] sin, int[] tables, Tensor[] keys, Tensor[] values, "
        "int[] starts, int[] ends, Tensor?[] masks, int stack) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvgen, CPU, m) {
  m.impl("qmatmul", qmatmul);
  m.impl("dequantize_", dequantize_);
  m.impl("embedding", embedding);
  m.impl("rms_norm", rms_norm_offset);
  m.impl("attention", attention);
  m.impl("decoder_attention_inputs", decoder_attention_inputs);
  m.impl("decoder_mlp", decoder_mlp);
  m.impl("decoder_layers", decoder_layers);
  m.impl("gated_activation", gated_activation);
}
