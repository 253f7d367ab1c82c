// Matrix products and dequantisation over weights kept in their stored formats (GGUF blocks,
// kvgen's int8/int4 rows, float16/bfloat16), registered as torch ops ``kvgen::qmatmul`` and
// ``kvgen::dequantize_``. Built for this CPU and loaded by kvgen/kernels/__init__.py.
//
// A weight is (N, row_bytes) uint8: each output row is a run of blocks of QK values. Every
// format decodes a block as vectors of 16 floats with exactly the operations of gguf.quants'
// numpy code (products are kept apart from sums by round(): no fused multiply-add there), so
// dequantize_ matches gguf bit for bit and qmatmul computes the dot product with the very
// dequantized weights, differing from a float32 matmul only in summation order. qmatmul
// decodes each block once and accumulates it against up to 8 input rows (fused multiply-add
// into 16-lane accumulators): one pass over the stored bytes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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

// Each format: QK values per block, BYTES per block, and decode(block, emit) calling emit(i, v)
// with the i-th run of 16 values, in order.

struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vf d = splat(f16(b));
    const vb q = load16(b + 2);
    emit(0, (tof(q & 0x0F) - 8.0f) * d);
    emit(1, (tof(q >> 4) - 8.0f) * d);
  }
};

struct Q4_1 {
  static constexpr int QK = 32, BYTES = 20;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vf d = splat(f16(b)), m = splat(f16(b + 2));
    const vb q = load16(b + 4);
    emit(0, round(tof(q & 0x0F) * d) + m);
    emit(1, round(tof(q >> 4) * d) + m);
  }
};

// 5-bit values of Q5_0/Q5_1: the low 4 bits in nibbles, the 5th in a 32-bit mask
inline void q5_values(const uint8_t* qh_bytes, const uint8_t* qs, vf& lo, vf& hi) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const vb q = load16(qs);
  const vi h = (vi)(((vu{} + qh) >> (vu)LANE) & 1u);
  const vi h2 = (vi)(((vu{} + (qh >> 16)) >> (vu)LANE) & 1u);
  lo = __builtin_convertvector(toi(q & 0x0F) | (h << 4), vf);
  hi = __builtin_convertvector(toi(q >> 4) | (h2 << 4), vf);
}

struct Q5_0 {
  static constexpr int QK = 32, BYTES = 22;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vf d = splat(f16(b));
    vf lo, hi;
    q5_values(b + 2, b + 6, lo, hi);
    emit(0, (lo - 16.0f) * d);
    emit(1, (hi - 16.0f) * d);
  }
};

struct Q5_1 {
  static constexpr int QK = 32, BYTES = 24;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vf d = splat(f16(b)), m = splat(f16(b + 2));
    vf lo, hi;
    q5_values(b + 4, b + 8, lo, hi);
    emit(0, round(lo * d) + m);
    emit(1, round(hi * d) + m);
  }
};

struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vf d = splat(f16(b));
    emit(0, tof((vsb)load16(b + 2)) * d);
    emit(1, tof((vsb)load16(b + 18)) * d);
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
  static constexpr int QK = 256, BYTES = 144;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    float d[8], m[8];
    k_scales(b, d, m);
    for (int c = 0; c < 4; ++c) {
      const vb q0 = load16(b + 16 + 32 * c), q1 = load16(b + 32 + 32 * c);
      const vf d0 = splat(d[2 * c]), m0 = splat(m[2 * c]), d1 = splat(d[2 * c + 1]), m1 = splat(m[2 * c + 1]);
      emit(4 * c, round(tof(q0 & 0x0F) * d0) - m0);
      emit(4 * c + 1, round(tof(q1 & 0x0F) * d0) - m0);
      emit(4 * c + 2, round(tof(q0 >> 4) * d1) - m1);
      emit(4 * c + 3, round(tof(q1 >> 4) * d1) - m1);
    }
  }
};

struct Q5_K {
  static constexpr int QK = 256, BYTES = 176;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    float d[8], m[8];
    k_scales(b, d, m);
    const vb h0 = load16(b + 16), h1 = load16(b + 32);  // bit s of qh[j]: the 5th bit of value 32 s + j
    for (int c = 0; c < 4; ++c) {
      const vb q0 = load16(b + 48 + 32 * c), q1 = load16(b + 64 + 32 * c);
      const vf d0 = splat(d[2 * c]), m0 = splat(m[2 * c]), d1 = splat(d[2 * c + 1]), m1 = splat(m[2 * c + 1]);
      const int s0 = 2 * c, s1 = 2 * c + 1;
      emit(4 * c, round(tof((q0 & 0x0F) | (((h0 >> s0) & 1) << 4)) * d0) - m0);
      emit(4 * c + 1, round(tof((q1 & 0x0F) | (((h1 >> s0) & 1) << 4)) * d0) - m0);
      emit(4 * c + 2, round(tof((q0 >> 4) | (((h0 >> s1) & 1) << 4)) * d1) - m1);
      emit(4 * c + 3, round(tof((q1 >> 4) | (((h1 >> s1) & 1) << 4)) * d1) - m1);
    }
  }
};

struct Q6_K {
  static constexpr int QK = 256, BYTES = 210;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float dd = f16(b + 208);
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 2; ++k) {  // lanes 16 k .. 16 k + 15 of each run of 32 values
        const vb l0 = load16(b + 64 * h + 16 * k), l1 = load16(b + 64 * h + 32 + 16 * k);
        const vb hb = load16(b + 128 + 32 * h + 16 * k);
        const vb q0 = (l0 & 0x0F) | ((hb & 3) << 4), q1 = (l1 & 0x0F) | (((hb >> 2) & 3) << 4);
        const vb q2 = (l0 >> 4) | (((hb >> 4) & 3) << 4), q3 = (l1 >> 4) | ((hb >> 6) << 4);
        const int run = 8 * h + k;  // values 128 h + 32 s + 16 k + lane: run 8 h + 2 s + k, its own scale
        emit(run, splat(dd * (float)sc[run]) * (tof(q0) - 32.0f));
        emit(run + 2, splat(dd * (float)sc[run + 2]) * (tof(q1) - 32.0f));
        emit(run + 4, splat(dd * (float)sc[run + 4]) * (tof(q2) - 32.0f));
        emit(run + 6, splat(dd * (float)sc[run + 6]) * (tof(q3) - 32.0f));
      }
    }
  }
};

struct F16 {
  static constexpr int QK = 32, BYTES = 64;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    for (int i = 0; i < 2; ++i) {
#if defined(__AVX512F__)
      __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * i)));
      vf w;
      std::memcpy(&w, &v, 64);
#elif defined(__F16C__)
      __m256 v[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32 * i))),
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32 * i + 16)))};
      vf w;
      std::memcpy(&w, v, 64);
#else
      vf w;
      for (int j = 0; j < 16; ++j) w[j] = f16(b + 32 * i + 2 * j);
#endif
      emit(i, w);
    }
  }
};

struct BF16 {
  static constexpr int QK = 32, BYTES = 64;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    for (int i = 0; i < 2; ++i) {
      vh h;
      std::memcpy(&h, b + 32 * i, 32);
      emit(i, (vf)(__builtin_convertvector(h, vu) << 16));
    }
  }
};

// kvgen's int4 rows (quantized at load): blocks of G values as float32 scale, float32 min, G/2
// bytes of nibbles (low nibbles: the first G/2 values, high nibbles: the rest), w = q * d + m
template <int G>
struct I4 {
  static constexpr int QK = G, BYTES = 8 + G / 2;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    const vf d = splat(f32(b)), m = splat(f32(b + 4));
    for (int i = 0; i < G / 32; ++i) {
      const vb q = load16(b + 8 + 16 * i);
      emit(i, round(tof(q & 0x0F) * d) + m);
      emit(G / 32 + i, round(tof(q >> 4) * d) + m);
    }
  }
};

// kvgen's int8 rows: K int8 values, then the row's float32 scale; blocks carry no scale, the
// row scale multiplies the finished dot product (and the dequantized row)
struct I8 {
  static constexpr int QK = 32, BYTES = 32;
  template <class E> static void decode(const uint8_t* b, E&& emit) {
    emit(0, tof((vsb)load16(b)));
    emit(1, tof((vsb)load16(b + 16)));
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
      T::decode(wr + b * T::BYTES, [&](int i, vf v) {
        if constexpr (has_row_scale<T>()) v = v * s;
        std::memcpy(ob + 16 * i, &v, 64);
      });
    }
  }
}

// y[r, n] = sum_k x[r, k] * w[n, k] for R rows of x (R <= 8), rows n0..n1 of w
template <class T, int R>
void matmul_rows(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                 int64_t K, float* y, int64_t ldy) {
  constexpr int QK = T::QK;
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    vf acc[R] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * QK;
      T::decode(wr + b * T::BYTES, [&](int i, vf v) {
        for (int r = 0; r < R; ++r) acc[r] += v * loadf(xb + r * ldx + 16 * i);  // fused multiply-add
      });
    }
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      for (int j = 0; j < 16; ++j) s += acc[r][j];
      if constexpr (has_row_scale<T>()) s = s * f32(wr + K);
      y[r * ldy + n] = s;
    }
  }
}

template <class T>
void matmul(const float* x, int64_t ldx, int64_t R, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K,
            float* y, int64_t ldy) {
  // grain: enough output rows per task that a task streams a few kB of weights
  const int64_t grain = std::max<int64_t>(1, 16384 / row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < R; r += 8) {
      const int64_t rows = std::min<int64_t>(8, R - r);
      const float* xr = x + r * ldx;
      float* yr = y + r * ldy;
      switch (rows) {
        case 1: matmul_rows<T, 1>(xr, ldx, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 2: matmul_rows<T, 2>(xr, ldx, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 3: matmul_rows<T, 3>(xr, ldx, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 4: matmul_rows<T, 4>(xr, ldx, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 5: matmul_rows<T, 5>(xr, ldx, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 6: matmul_rows<T, 6>(xr, ldx, w, row_bytes, n0, n1, K, yr, ldy); break;
        case 7: matmul_rows<T, 7>(xr, ldx, w, row_bytes, n0, n1, K, yr, ldy); break;
        default: matmul_rows<T, 8>(xr, ldx, w, row_bytes, n0, n1, K, yr, ldy); break;
      }
    }
  });
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

// x (R, K) float32 rows -> (R, N) float32
at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& w, int64_t format) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "kvgen: x must be (rows, K) float32");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  const int64_t K = x.size(1);
  dispatch(format, [&](auto t) {
    using T = decltype(t);
    check_weight(w, K, T::QK, T::BYTES, has_row_scale<T>());
    matmul<T>(x.data_ptr<float>(), x.stride(0), x.size(0), w.data_ptr<uint8_t>(), w.stride(0), w.size(0), K,
              y.data_ptr<float>(), y.stride(0));
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

}  // namespace

TORCH_LIBRARY(kvgen, m) {
  m.def("qmatmul(Tensor x, Tensor w, int format) -> Tensor");
  m.def("dequantize_(Tensor(a!) out, Tensor w, int format) -> ()");
}

TORCH_LIBRARY_IMPL(kvgen, CPU, m) {
  m.impl("qmatmul", qmatmul);
  m.impl("dequantize_", dequantize_);
}
