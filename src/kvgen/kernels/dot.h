// Matrix products over weights kept in their stored formats (formats.h): y = x W^T for float32 input rows x and
// a weight made of row segments, each in its own format. What the products take and give is here; how they run
// (rows, tiles, integer dot products, the tile unit) is in dot.cpp.
//
// Example (ops.cpp's kvgen::qmatmul): y (R, p.N) = x (R, K) times a Q4_0 weight of N rows
//     const Product p = make_product({{2, 0, N, K / 32 * 18, bytes}}, K);
//     product_into(p, x, K, R, y);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "simd.h"

namespace kvgen {

#if defined(KVGEN_DOTS)
// ---- Integer dot products for the tiled formats: AVX-512 VNNI's vpdpbusd (4-6 bits; Q8_0's values + 128 as unsigned
// bytes, 128 * sum(X) subtracted again in int32) or AVX2's vpmaddubsw (4-6 bits, Q8_0: dot2.h). The float32 path
// (dot.cpp's matmul_tiles) needs one multiply-add per weight and input row after widening each value to float32: one
// thread ran compute-bound at 10-14 GB/s of stored bytes (Zen 4). Here the input rows are rounded to 21 bits and a sign
// per block of 32 values, x~ = X * s with s = max|x| / (127 * 2^14) and X split into three int8 levels X = X1 * 2^14 +
// X2 * 2^7 + X3, and each group's sum(q * X) is three exact integer dot products of the unsigned stored values with the
// levels (vpdpbusd: 4 products a lane per instruction; vpmaddubsw: 2, summed in int16 while they fit), combined
// exactly, rounded once: d * s * sum(q * X) + m * sum(x~) per row. So the product is W @ x~ up to float32 rounding; x~
// differs from x by at most max|x| / 2^22 per block (float32 itself rounds at 2^-24 of each value).
constexpr float XQ_MAX = 127.0f * 16384.0f;

#if defined(KVGEN_DOT2)
// input rows rounded to 16 bits for AVX2's Q4_K products of prompt rows (panels16.h's round_x16): each row's window
// of 64 values keeps its value of the largest magnitude exact (at (RP, K / 64): its place in the window; outlier (RP,
// K / 64): the value), its other values rounded to int16 on the scale of their largest (values (K / 256, RP, 256),
// the exact value's 0; scale (RP, K / 64)). RP: R rounded up to 6 (rows of zeros). sums: each group of 32 inputs'
// sum as rounded (RP, K / 32), the exact value included
struct X16 {
  X16() = default;  // (not an aggregate: RoundedX's brace-initializations leave it empty without a warning)
  int64_t R = 0, RP = 0, K = 0;
  Written<int16_t> v;
  Written<float> scale, outlier, sums;
  Written<int32_t> at;
};
#endif

// the input rows, rounded for the integer dot products (dot.cpp's round_x): levels (R, 3, K) int8 (with AVX2's
// vpmaddubsw, each 4 values in the order 0, 2, 1, 3: simd.h's Quads), scales (R, K /
// 32), sums of x~ per 16 values (R, K / 16), sums of each level per 32 values (R, 3, K / 32; only where asked: Q8_0's
// and int8's bias needs them; zero for the first tile_rows rows) and, for AMX's tile loads (tile_rows > 0), the
// levels of the first tile_rows rows (a multiple of 16) again, a tile's operand at a time: (tile_rows / 16, K / 32,
// 3, 16, 32), 16 rows by 32 values of one level in 512 contiguous bytes (strided loads of (R, 3, K) took as long as
// the tile products). Those rows keep (R, 3, K) too: a Q6_K segment of the same product takes vpdpbusd for every row
struct RoundedX {
  int64_t K;
  Written<int8_t> levels;
  Written<float> scales, sums;
  std::vector<int32_t> level_sums;
  Written<int8_t> tiles;
#if defined(KVGEN_DOT2)
  X16 x16;
#endif
};
#else
struct RoundedX {};
#endif

// A product's weight: its row segments (each in its format, checked by the caller) taken apart once, so that a
// registered decode stack (kvgen::decoder_stack) does not redo it at every step.
struct Product {
  // rows start .. start + rows - 1 of the product: `rows` rows of `row_bytes` bytes from w
  struct Segment { int64_t format, start, rows, row_bytes; const uint8_t* w; };
  std::vector<Segment> segments;
  int64_t K = 0, N = 0;  // input features, output rows
  bool rounded = false;  // some segment takes integer dot products: x rounded once for all of them
  bool biased = false;  // and some of those adds a bias to its values (Q8_0): sums of each level needed
  bool split = false;  // some segment is BF16, and every BF16 segment has a multiple of 16 rows (tdpbf16ps)
};

// the product of segments (format, rows, row_bytes and w given; start is set) of K input features
Product make_product(std::vector<Product::Segment> segments, int64_t K);

// A product's input rows (R of K values, ldx apart), prepared once for all its output rows: their sums
// per group (formats with a min and no integer dot products) and their rounding (formats with them). `prompt`: the
// rows feed a prompt's tokens, whose products may trade exactness for speed (logits within 1e-2 of the float32 run:
// AVX2's Q4_K products on 16-bit inputs, prefill_inputs_16bit); else each product is exact up to float32 rounding
struct ProductInput {
  const float* x;
  int64_t ldx, R;
  std::vector<std::vector<float>> xsums;  // per segment
  RoundedX rx;
  int64_t split_rows = 0;  // the first rows split into bfloat16 parts for BF16 segments (split_bf16), or none
  Written<uint16_t> parts;
};

ProductInput product_input(const Product& p, const float* xp, int64_t ldx, int64_t R, bool prompt = false);

// output rows n0..n1 of y (R, N), each segment's rows read where they are stored
void product_rows(const Product& p, const ProductInput& in, int64_t n0, int64_t n1, float* yp);

// output rows per parallel task: enough that a task streams a few kB of weights
int64_t product_grain(const Product& p);

// the output rows each of `threads` threads claims at a time, in turn until none is left (whole tiles, ~8 pieces a
// thread, at least product_grain): a thread that runs slower (a VM's busier core) takes fewer
int64_t product_piece(const Product& p, int64_t threads);

// y (R, N) = x (R, K, rows ldx apart) times the product's weight, output rows in parallel (prompt: product_input's)
void product_into(const Product& p, const float* xp, int64_t ldx, int64_t R, float* yp, bool prompt = false);

// whether products of prompt rows take 16-bit inputs on this CPU (AVX2 without AVX-512 VNNI) under the environment's
// KVGEN_PREFILL_INPUTS (unset or "int16": they do; "float32": they do not)
bool prefill_inputs_16bit();

// the formats whose products take integer dot products on this CPU (AVX-512 VNNI; AVX2: the 4-6-bit tiles and Q8_0),
// else none
std::vector<int64_t> integer_dot_formats();

// the instruction of those products: "vpdpbusd" (AVX-512 VNNI), "vpmaddubsw" (AVX2) or "" (none)
std::string integer_dot_instruction();

// the input rows from which every integer dot format's products take float32 panels (AVX2: panels2.h), or with a
// format's code, from which that format's do (Q6_K, Q8_0 and Q4_K from fewer: panel_rows_of); 0 where none does
int64_t panel_rows(int64_t format = 0);

// the formats whose products of 16 input rows or more take AMX's tile products (the integer dot formats' sums 16 x 16
// at a time; BF16 with the rows in three bfloat16 parts), else none
std::vector<int64_t> tile_formats();

// What a weight of a format holds (formats.cpp): each row K / block_values blocks of block_bytes (then a float32
// scale where row_scale), rows in tiles of tile_rows; F32's rows may also be a float32 tensor (floats)
struct FormatShape {
  int64_t block_values, block_bytes, tile_rows;
  bool row_scale, floats;
};

// false where this build has no kernel for the format
bool format_shape(int64_t format, FormatShape* shape);

// rows 0..N - 1 of a weight as float32 rows of K values, ld apart, exactly as gguf dequantizes them (rows in
// parallel)
void dequantize(int64_t format, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, float* out, int64_t ld);

// rows ids[0..n - 1] of a weight as float32 (n, K): an embedding lookup (a tiled row is decoded with its tile's 15
// others)
void embedding(int64_t format, const uint8_t* w, int64_t row_bytes, const int64_t* ids, int64_t n, int64_t K,
               float* out);

// rows (16 * tiles, row_bytes each, stride bytes apart) into tiles of 16 rows of a tiled format (2000 + the format
// in rows; kvgen.models.packed.tile_rows; formats.h's Tiled): per block, the 16 rows' head fields, then byte j of the
// 16 rows for each other byte j (4 at a time as Quads where AVX2's products read them: quad_runs); after the blocks,
// the 16 rows' extra bytes (int8's scales), one row after the other. Tiles in parallel; false for a format without
// tiles in this build, or rows of another length than whole blocks
bool tile_rows(int64_t format, const uint8_t* rows, int64_t stride, int64_t tiles, int64_t row_bytes, uint8_t* out);
// [first, end): the runs of a tile block of format stored 4 at a time as AVX2's Quads (formats.h's quad_runs); none
// where they all stay in row order
std::vector<int64_t> tile_quads(int64_t format);

}  // namespace kvgen
