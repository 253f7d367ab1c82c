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
// the float32 dot product up to rounding order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float vf __attribute__((vector_size(64)));      // 16 float32 lanes (2 registers on AVX2)
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(16)));
typedef int8_t vsb __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(32)));

// an empty asm the value must pass through: the compiler cannot fuse a product into a later sum
inline vf round(vf x) {
  asm("" : "+v"(x));
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
inline vi toi(vb v) { return __builtin_convertvector(v, vi); }
inline vf tof(vb v) { return __builtin_convertvector(toi(v), vf); }  // via int32: direct is scalarised
inline vf tof(vsb v) { return __builtin_convertvector(toi((vb)v ^ 0x80) - 128, vf); }  // int8 via uint8: direct is scalarised
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
// small integers, so the products and sums below are those of gguf's numpy code.

struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18, GROUP = 32;
  static constexpr bool SCALED = true, HAS_MIN = false;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vb q = load16(b + 2);
    const vf v[2] = {tof(q & 0x0F) - 8.0f, tof(q >> 4) - 8.0f};
    emit(0, v, 2, f16(b), 0.0f);
  }
};

struct Q4_1 {
  static constexpr int QK = 32, BYTES = 20, GROUP = 32;
  static constexpr bool SCALED = true, HAS_MIN = true;
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
  static constexpr bool SCALED = true, HAS_MIN = false;
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
  static constexpr bool SCALED = true, HAS_MIN = true;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    vf v[2];
    q5_values(b + 4, b + 8, v);
    emit(0, v, 2, f16(b), f16(b + 2));
  }
};

struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34, GROUP = 32;
  static constexpr bool SCALED = true, HAS_MIN = false;
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

template <class T>
constexpr bool has_row_scale() { return false; }
template <>
constexpr bool has_row_scale<I8>() { return true; }

template <class T>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, float* out,
                     int64_t ld) {
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

// y[r, n] = sum_k x[r, k] * w[n, k] for R rows of x (R <= 8), rows n0..n1 of w. Per group:
// d * sum(q * x) + m * sum(x), with sum(x) over each group precomputed in xsum (R, K / GROUP).
template <class T, int R>
void matmul_rows(const float* x, int64_t ldx, const float* xsum, const uint8_t* w, int64_t row_bytes, int64_t n0,
                 int64_t n1, int64_t K, float* y, int64_t ldy) {
  constexpr int QK = T::QK;
  const int64_t nb = K / QK, ngroups = K / T::GROUP;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    vf acc[R] = {};
    float macc[R] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * QK;
      T::decode(wr + b * T::BYTES, [&](int run, const vf* q, int count, float d, float m) {
        for (int r = 0; r < R; ++r) {
          const float* xr = xb + r * ldx + 16 * run;
          vf t = q[0] * loadf(xr);
          for (int i = 1; i < count; ++i) t += q[i] * loadf(xr + 16 * i);  // fused multiply-add
          if constexpr (T::SCALED) acc[r] += splat(d) * t;
          else acc[r] += t;
          if constexpr (T::HAS_MIN) macc[r] += m * xsum[r * ngroups + (b * QK + 16 * run) / T::GROUP];
        }
      });
    }
    for (int r = 0; r < R; ++r) {
      float s = macc[r];
      for (int j = 0; j < 16; ++j) s += acc[r][j];
      if constexpr (has_row_scale<T>()) s = s * f32(wr + K);
      y[r * ldy + n] = s;
    }
  }
}

// rows n0..n1 of one weight, every row of x (in runs of at most 8)
template <class T>
void matmul_range(const float* x, int64_t ldx, int64_t R, const float* xsum, const uint8_t* w, int64_t row_bytes,
                  int64_t n0, int64_t n1, int64_t K, float* y, int64_t ldy) {
  const int64_t ngroups = K / T::GROUP;
  for (int64_t r = 0; r < R; r += 8) {
    const float* xr = x + r * ldx;
    const float* xs = xsum + r * ngroups;
    float* yr = y + r * ldy;
    switch (std::min<int64_t>(8, R - r)) {
      case 1: matmul_rows<T, 1>(xr, ldx, xs, w, row_bytes, n0, n1, K, yr, ldy); break;
      case 2: matmul_rows<T, 2>(xr, ldx, xs, w, row_bytes, n0, n1, K, yr, ldy); break;
      case 3: matmul_rows<T, 3>(xr, ldx, xs, w, row_bytes, n0, n1, K, yr, ldy); break;
      case 4: matmul_rows<T, 4>(xr, ldx, xs, w, row_bytes, n0, n1, K, yr, ldy); break;
      case 5: matmul_rows<T, 5>(xr, ldx, xs, w, row_bytes, n0, n1, K, yr, ldy); break;
      case 6: matmul_rows<T, 6>(xr, ldx, xs, w, row_bytes, n0, n1, K, yr, ldy); break;
      case 7: matmul_rows<T, 7>(xr, ldx, xs, w, row_bytes, n0, n1, K, yr, ldy); break;
      default: matmul_rows<T, 8>(xr, ldx, xs, w, row_bytes, n0, n1, K, yr, ldy); break;
    }
  }
}

// x's sum over each group of values: (R, K / GROUP), for formats with a min
template <class T>
std::vector<float> group_sums(const float* x, int64_t ldx, int64_t R, int64_t K) {
  const int64_t ngroups = K / T::GROUP;
  std::vector<float> xsum(T::HAS_MIN ? R * ngroups : 0);
  if constexpr (T::HAS_MIN)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < ngroups; ++g) {
        float s = 0.0f;
        for (int j = 0; j < T::GROUP; ++j) s += x[r * ldx + g * T::GROUP + j];
        xsum[r * ngroups + g] = s;
      }
  return xsum;
}

// format codes: GGML's type ids; kvgen's own formats above 1000
template <class F>
void dispatch(int64_t format, F&& f) {
  switch (format) {
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
    case 1008: f(I8{}); break;
    case 1032: f(I4<32>{}); break;
    case 1064: f(I4<64>{}); break;
    case 1128: f(I4<128>{}); break;
    default: TORCH_CHECK(false, "kvgen: no kernel for weight format ", format);
  }
}

void check_weight(const at::Tensor& w, int64_t K, int64_t QK, int64_t BYTES, bool row_scale) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1, "kvgen: weight must be 2-D uint8 rows");
  TORCH_CHECK(K % QK == 0, "kvgen: input features ", K, " are not a multiple of the block size ", QK);
  TORCH_CHECK(w.size(1) == K / QK * BYTES + (row_scale ? 4 : 0), "kvgen: weight rows hold ", w.size(1),
              " bytes, not what ", K, " input features need");
}

// x (R, K) float32 rows times the row segments ws[i] (each in formats[i]) -> (R, sum of their rows).
// One parallel loop over all output rows: a fused projection stored in several tensors (q, k
// and v; gate and up) or formats is one call, its parts read where they are stored.
at::Tensor qmatmul(const at::Tensor& x, at::TensorList ws, at::IntArrayRef formats) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "kvgen: x must be (rows, K) float32");
  TORCH_CHECK(ws.size() == formats.size() && !ws.empty(), "kvgen: one format per weight segment");
  const int64_t R = x.size(0), K = x.size(1), ldx = x.stride(0);
  const float* xp = x.data_ptr<float>();
  struct Segment { int64_t format, start, rows, row_bytes; const uint8_t* w; std::vector<float> xsum; };
  std::vector<Segment> segments;
  int64_t N = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    dispatch(formats[i], [&](auto t) {
      using T = decltype(t);
      check_weight(ws[i], K, T::QK, T::BYTES, has_row_scale<T>());
      segments.push_back({formats[i], N, ws[i].size(0), ws[i].stride(0), ws[i].data_ptr<uint8_t>(),
                          group_sums<T>(xp, ldx, R, K)});
    });
    N += ws[i].size(0);
  }
  at::Tensor y = at::empty({R, N}, x.options());
  float* yp = y.data_ptr<float>();
  // grain: enough output rows per task that a task streams a few kB of weights
  const int64_t grain = std::max<int64_t>(1, 16384 / segments[0].row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (const Segment& seg : segments) {
      const int64_t lo = std::max(n0, seg.start), hi = std::min(n1, seg.start + seg.rows);
      if (lo >= hi) continue;
      dispatch(seg.format, [&](auto t) {
        using T = decltype(t);
        matmul_range<T>(xp, ldx, R, seg.xsum.data(), seg.w, seg.row_bytes, lo - seg.start, hi - seg.start, K,
                        yp + seg.start, N);
      });
    }
  });
  return y;
}

// out (N, K) float32 rows (may be a row slice of a bigger buffer)
void dequantize_(at::Tensor out, const at::Tensor& w, int64_t format) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1, "kvgen: out must be (N, K) float32");
  TORCH_CHECK(out.size(0) == w.size(0), "kvgen: out has ", out.size(0), " rows, the weight ", w.size(0));
  const int64_t K = out.size(1);
  dispatch(format, [&](auto t) {
    using T = decltype(t);
    check_weight(w, K, T::QK, T::BYTES, has_row_scale<T>());
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    const int64_t rb = w.stride(0), ld = out.stride(0);
    at::parallel_for(0, w.size(0), 16, [&](int64_t n0, int64_t n1) { dequantize_rows<T>(wp, rb, n0, n1, K, op, ld); });
  });
}

// -- small decode-time ops --------------------------------------------------------------------------

inline float hsum(vf v) {  // a tree of halves
  const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15};
  const vi hi4 = {4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7};
  const vi hi2 = {2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3};
  v += __builtin_shuffle(v, hi8);
  v += __builtin_shuffle(v, hi4);
  v += __builtin_shuffle(v, hi2);
  return v[0] + v[1];
}

// exp of 16 lanes: 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p of degree 6 (Cephes' expf,
// within 2 ulp); lanes below -87 (masked scores: -inf) give exactly 0
inline vf vexp(vf x) {
  const vi zero_mask = x > -87.0f;
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  const vf n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f + 0.5f * ((x > 0.0f) ? splat(1.0f) : splat(-1.0f)), vi), vf);
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (vi)p + (__builtin_convertvector(n, vi) << 23);
  return (vf)(bits & zero_mask);
}

// x (rows, D) float32 contiguous -> x / sqrt(mean(x^2) + eps) * weight, one pass per row
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous() && x.size(-1) == weight.numel(), "kvgen: rms_norm takes contiguous float32");
  const int64_t D = weight.numel(), rows = x.numel() / D;
  at::Tensor y = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * D;
    double ss = 0.0;
    for (int64_t j = 0; j < D; ++j) ss += (double)xr[j] * xr[j];
    const float scale = 1.0f / std::sqrt((float)(ss / D) + (float)eps);
    for (int64_t j = 0; j < D; ++j) yp[r * D + j] = xr[j] * scale * wp[j];
  }
  return y;
}

// Attention of a few query positions: q (B, H, T, D), k and v (B, Hkv, S, D) (any strides, the
// last dim contiguous, D a multiple of 16), mask: bool (B or 1, 1, T, S), True where allowed, or
// undefined (all allowed). softcap > 0: scores become tanh(s / softcap) * softcap. Returns
// (B, H, T, D) as a view of (B, T, H, D) storage, so the caller's transpose + flatten is free.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                     double scale, double softcap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat &&
              k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "kvgen: attention takes 4-D float32");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(D % 16 == 0 && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && H % Hkv == 0,
              "kvgen: attention needs a head size that is a multiple of 16 and contiguous heads");
  const bool masked = mask.has_value() && mask->defined();
  const bool* mp = nullptr;
  int64_t mb = 0, mt = 0;
  at::Tensor m;
  if (masked) {
    m = mask->contiguous();
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(2) == T && m.size(3) == S,
                "kvgen: attention mask must be bool (B or 1, 1, T, S)");
    mp = m.data_ptr<bool>();
    mb = m.size(0) == 1 ? 0 : T * S;
    mt = S;
  }
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = H / Hkv, nv = D / 16, rows = G * T;  // the query rows that share one key head
  const float sc = (float)scale, cap = (float)softcap;
  // Flash-decoding: tasks are (batch, key head, chunk of keys); each reads its keys and values once
  // for all the query rows of its group and leaves a partial (max, sum, weighted values); the
  // partials are merged after.
  const int64_t CHUNK = 128, C = (S + CHUNK - 1) / CHUNK;
  std::vector<float> part_max(B * Hkv * C * rows), part_sum(B * Hkv * C * rows), part_acc(B * Hkv * C * rows * D);
  at::parallel_for(0, B * Hkv * C, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(rows * CHUNK);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (Hkv * C), g = (i / C) % Hkv, c = i % C;
      const int64_t s0 = c * CHUNK, n = std::min(CHUNK, S - s0);
      const float* kb = kp + b * k.stride(0) + g * k.stride(1) + s0 * k.stride(2);
      const float* vb_ = vp + b * v.stride(0) + g * v.stride(1) + s0 * v.stride(2);
      for (int64_t s = 0; s < n; ++s) {
        const float* ks = kb + s * k.stride(2);
        for (int64_t r = 0; r < rows; ++r) {  // row r: head g * G + r / T, position r % T
          const float* qr = qp + b * q.stride(0) + (g * G + r / T) * q.stride(1) + (r % T) * q.stride(2);
          vf d = loadf(qr) * loadf(ks);
          for (int64_t j = 1; j < nv; ++j) d += loadf(qr + 16 * j) * loadf(ks + 16 * j);
          float score = hsum(d) * sc;
          if (cap > 0.0f) score = std::tanh(score / cap) * cap;
          if (masked && !mp[b * mb + (r % T) * mt + s0 + s]) score = -INFINITY;
          scores[r * CHUNK + s] = score;
        }
      }
      float* pm = part_max.data() + i * rows;
      float* ps = part_sum.data() + i * rows;
      float* pa = part_acc.data() + i * rows * D;
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores.data() + r * CHUNK;
        float best = -INFINITY;
        for (int64_t s = 0; s < n; ++s) best = std::max(best, sr[s]);
        for (int64_t s = n; s < CHUNK; ++s) sr[s] = -INFINITY;
        vf total = {};
        if (best > -INFINITY)
          for (int64_t s = 0; s < CHUNK; s += 16) {
            const vf e = vexp(loadf(sr + s) - best);
            std::memcpy(sr + s, &e, 64);
            total += e;
          }
        else
          std::fill(sr, sr + CHUNK, 0.0f);  // every key of this chunk masked for this row
        pm[r] = best;
        ps[r] = hsum(total);
        std::fill(pa + r * D, pa + (r + 1) * D, 0.0f);
      }
      for (int64_t s = 0; s < n; ++s) {
        const float* vs = vb_ + s * v.stride(2);
        for (int64_t r = 0; r < rows; ++r) {
          const float w = scores[r * CHUNK + s];
          if (w == 0.0f) continue;
          float* a = pa + r * D;
          for (int64_t j = 0; j < nv; ++j) {
            const vf x = loadf(a + 16 * j) + splat(w) * loadf(vs + 16 * j);
            std::memcpy(a + 16 * j, &x, 64);
          }
        }
      }
    }
  });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t base = (b * Hkv + g) * C;
        float best = -INFINITY;
        for (int64_t c = 0; c < C; ++c) best = std::max(best, part_max[(base + c) * rows + r]);
        float total = 0.0f;
        std::vector<vf> acc(nv, vf{});
        for (int64_t c = 0; c < C; ++c) {
          const float m = part_max[(base + c) * rows + r];
          if (m == -INFINITY) continue;
          const float f = std::exp(m - best);
          total += part_sum[(base + c) * rows + r] * f;
          const float* a = part_acc.data() + ((base + c) * rows + r) * D;
          for (int64_t j = 0; j < nv; ++j) acc[j] += splat(f) * loadf(a + 16 * j);
        }
        float* o = op + ((b * T + r % T) * H + g * G + r / T) * D;
        for (int64_t j = 0; j < nv; ++j) {
          const vf x = acc[j] * (1.0f / total);
          std::memcpy(o + 16 * j, &x, 64);
        }
      }
  return out.transpose(1, 2);
}

}  // namespace

TORCH_LIBRARY(kvgen, m) {
  m.def("qmatmul(Tensor x, Tensor[] ws, int[] formats) -> Tensor");
  m.def("dequantize_(Tensor(a!) out, Tensor w, int format) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvgen, CPU, m) {
  m.impl("qmatmul", qmatmul);
  m.impl("dequantize_", dequantize_);
  m.impl("rms_norm", rms_norm);
  m.impl("attention", attention);
}
