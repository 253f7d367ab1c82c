// Rows of a KV cache turned into float32 and back (kv_rows.h).
#include "kv_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "simd.h"

namespace kvgen {

void kv_decode(KvFormat f, const void* row, int64_t D, float* out) {
  if (f == KvFormat::F32) {
    std::memcpy(out, row, D * sizeof(float));
  } else if (f == KvFormat::F16) {
    const uint16_t* h = static_cast<const uint16_t*>(row);
#if defined(__F16C__)
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + d))));
#else
    for (int64_t d = 0; d < D; ++d) out[d] = half_to_float(h[d]);
#endif
  } else if (f == KvFormat::BF16) {
    const uint16_t* h = static_cast<const uint16_t*>(row);
    for (int64_t d = 0; d < D; ++d) {  // a bfloat16 is a float32's upper half
      const uint32_t bits = (uint32_t)h[d] << 16;
      std::memcpy(out + d, &bits, 4);
    }
  } else {  // Q8: D codes, then D / 32 scales
    const int8_t* code = static_cast<const int8_t*>(row);
    for (int64_t g = 0; g < D / 32; ++g) {
      float scale;
      std::memcpy(&scale, code + D + 4 * g, 4);
      for (int64_t i = 32 * g; i < 32 * g + 32; ++i) out[i] = (float)code[i] * scale;
    }
  }
}

namespace {

// float32 -> float16 bits, rounded to nearest even (torch's conversion; F16C's vcvtps2ph where the CPU has it),
// saturated at +-65504 first
inline uint16_t to_half(float x) {
  const _Float16 h = (_Float16)std::clamp(x, -65504.0f, 65504.0f);  // (NaN stays NaN)
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

// float32 -> bfloat16 bits, rounded to nearest even; NaN -> a quiet NaN (as torch)
inline uint16_t to_bfloat16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return 0x7FC0;
  return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

}  // namespace

void kv_encode(KvFormat f, const float* x, int64_t D, void* row) {
  if (f == KvFormat::F32) {
    std::memcpy(row, x, D * sizeof(float));
  } else if (f == KvFormat::F16) {
    uint16_t* h = static_cast<uint16_t*>(row);
    for (int64_t d = 0; d < D; ++d) h[d] = to_half(x[d]);
  } else if (f == KvFormat::BF16) {
    uint16_t* h = static_cast<uint16_t*>(row);
    for (int64_t d = 0; d < D; ++d) h[d] = to_bfloat16(x[d]);
  } else {  // Q8: the codes of each 32 values, then their scales
    int8_t* code = static_cast<int8_t*>(row);
    for (int64_t g = 0; g < D / 32; ++g) {
      const float* v = x + 32 * g;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float scale = amax / 127.0f;
      for (int i = 0; i < 32; ++i)
        code[32 * g + i] = scale > 0.0f ? (int8_t)std::clamp(std::nearbyint(v[i] / scale), -127.0f, 127.0f) : 0;
      std::memcpy(code + D + 4 * g, &scale, 4);
    }
  }
}

}  // namespace kvgen
