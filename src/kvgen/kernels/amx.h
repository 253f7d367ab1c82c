// Products on Intel's tile unit (AMX), where the CPU has it and Linux grants it: the integer dot formats' sums 16
// input rows by 16 weight rows at a time (matmul_tiles_amx: the same sums as vpdpbusd, the same bits), and BF16
// weights by AMX's bfloat16 products (matmul_bf16_amx). Included by dot.cpp, which routes products of 16 rows or
// more here.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel.h"
#include "tiles.h"

namespace kvgen {

#if defined(KVGEN_AMX)
// whether this process may use the tile registers (Linux hands them out on request: ARCH_REQ_XCOMP_PERM);
// KVGEN_DISABLE_AMX=1 keeps the vpdpbusd products
inline bool amx_permitted() {
  static const bool permitted = [] {
    const char* off = std::getenv("KVGEN_DISABLE_AMX");
    if (off != nullptr && *off != '\0' && std::strcmp(off, "0") != 0) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}

// the input rows that take AMX's tile products: all but R % 16 (none of fewer than 16)
inline int64_t amx_rows(int64_t R) { return R >= 16 && amx_permitted() ? R / 16 * 16 : 0; }

// ---- The same integer sums on AMX (Intel's tile unit): one tdpbsud takes a group's values of 16 input rows (a
// tile of their levels, signed) times the same values of 16 weight rows (the group's u, unsigned: the rows of
// the tile operand as dot_groups lays them out) into 16 x 16 int32 sums, where vpdpbusd takes one input row.
// The sums leave the tile unit per group (each group has its own scales) and go through add_group (tiles.h) as
// vpdpbusd's do: the products' bits are matmul_tiles_dot's.

// whether T's products of 16 rows or more take the tile unit: not Q6_K's (its groups of 16 values give a tile
// instruction half the work for the same read-back, and at 512 rows ran at 142-221 GFLOP/s against 263-295 for
// dequantize + oneDNN, 158-184 with vpdpbusd)
template <class T>
constexpr bool takes_tile_unit() { return has_dot<T>() && !std::is_same_v<T, Q6_Kx16>; }

// loads the tile unit's configuration (palette 1): tile i holds tiles[i] = (rows, bytes a row)
inline void amx_configure(std::initializer_list<std::pair<uint8_t, uint16_t>> tiles) {
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
#else
inline int64_t amx_rows(int64_t) { return 0; }
#endif

#if defined(KVGEN_AMX_BF16)
// ---- BF16 weights times 16 input rows or more on AMX (tdpbf16ps): the rows split exactly into three bfloat16
// parts, x = x1 + x2 + x3 (8 significant bits each: x1 rounded to bfloat16, x2 the rest rounded, x3 what remains;
// values below ~2^-110 lose their last parts), each product of a weight with a part exact in float32 and summed
// in the tile unit's float32 accumulators: W @ x up to float32 rounding order, as the float32 matmul. Per 32 values
// a 16 x 16 output tile takes 3 instructions and keeps its sums in the tile unit over all K.

// the rows' three parts: (3, R, K) bfloat16 bits, part p of row r at parts + (p R + r) K
inline Written<uint16_t> split_bf16(const float* x, int64_t ldx, int64_t R, int64_t K) {
  Written<uint16_t> parts(3 * R * K);
  parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
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
inline void matmul_bf16_amx(const uint16_t* parts, int64_t R, const uint8_t* w, int64_t rb, int64_t t0, int64_t t1,
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

}  // namespace kvgen
