// How a KV cache stores keys and values (kvgen.cache.precision), and its rows turned into float32 and back.
//
// Example: a float16 row of D values
//     uint16_t row[64];
//     kv_encode(KvFormat::F16, x, 64, row);      // float32 -> stored
//     kv_decode(KvFormat::F16, row, 64, back);   // stored -> float32
#pragma once

#include <cstdint>

namespace kvgen {

// float32, float16, bfloat16, or Q8 rows: a position's D values of a head as D int8 codes, then D / 32 float32
// scales, one per 32 codes (value = code * scale, scale = max |x| / 127 over the 32: llama.cpp's q8_0 KV cache)
enum class KvFormat : int32_t { F32 = 0, F16 = 1, BF16 = 2, Q8 = 3 };

// bytes of one stored element of format f (Q8: a byte of its rows; strides count these)
constexpr int64_t kv_element_bytes(KvFormat f) { return f == KvFormat::F32 ? 4 : f == KvFormat::Q8 ? 1 : 2; }

// stored elements of one position's head of D values
constexpr int64_t kv_row_elements(KvFormat f, int64_t D) { return f == KvFormat::Q8 ? D + D / 8 : D; }

// one stored row of D values (D a multiple of 32 for Q8, of 16 else) as float32
void kv_decode(KvFormat f, const void* row, int64_t D, float* out);

// D float32 values stored as format f, with the rounding of kvgen.cache.precision.encode (so the same bits for
// finite values): float16 saturated at 65504 then rounded to nearest even, bfloat16 rounded to nearest even,
// Q8 codes round(x / scale) to nearest even
void kv_encode(KvFormat f, const float* x, int64_t D, void* row);

}  // namespace kvgen
