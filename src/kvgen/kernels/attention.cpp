// kvgen::attention(q, k, v, mask?, scale, softcap): q (B, H, T, D), k and v (B, Hkv, S, D) (any
// strides, the last dim contiguous, D a multiple of 16, H a multiple of Hkv: the G = H / Hkv query
// heads of a group share one key head; k and v stored as float32, float16, bfloat16 or Q8 rows of
// kv_rows.h, each tile of them turned into float32 in the thread's scratch where it is not float32, but
// for a few rows' whole float16 tiles, turned into float32 in registers as they are read),
// mask: bool (B or 1, 1, T, S), True where allowed, or none (all allowed). softcap > 0: scores become
// tanh(s / softcap) * softcap. The output is (B, T, H, D). A query row that allows no key gets zeros (SDPA
// gives NaN there); callers never use such rows.
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
//     A few rows' float16 keys and values are read in place, vcvtph2ps a vector as loaded: through the
//     thread's scratch, a 16-sequence decode step of SmolLM2 (float16 pool, 576 keys a sequence, 30
//     layers) spent a third of its attention waiting on the conversion's loads (AMD EPYC Zen 3, from
//     memory: 1.28x faster at 1 thread, 1.33x at 2; benchmarks/kernels_ab.py --attention 16,576)
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "parallel.h"
#include "simd.h"

namespace kvgen {
namespace {

inline bool has_zero_byte(uint64_t x) { return ((x - 0x0101010101010101ull) & ~x & 0x8080808080808080ull) != 0; }

// a vector of keys or values as float32, read where they are stored: float32, or float16 bits turned into float32
// in the register (F16C; kv_decode's conversion without it)
template <class KV>
inline vn load_kv(const KV* p) {
  if constexpr (std::is_same_v<KV, float>) {
    return vload<vn>(p);
  } else {
#if defined(__AVX512F__)
    return (vn)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
    return (vn)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    float f[LN];
    kv_decode(KvFormat::F16, p, LN, f);
    return vload<vn>(f);
#endif
  }
}

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
template <int RR, class KV>
__attribute__((noinline)) void tile_scores_dot(const float* q, int64_t D, const KV* k, int64_t ks, float* sc,
                                               int64_t ss, std::type_identity_t<const KV*> ahead) {
  for (int64_t s0 = 0; s0 < TILE; s0 += 4) {
    vn acc[RR][4] = {};
    const KV* kk = k + s0 * ks;
    for (int64_t d = 0; d < D; d += LN) {
      vn x[4];
      for (int i = 0; i < 4; ++i) {
        if (ahead) __builtin_prefetch(ahead + (s0 + i) * ks + d, 0, 2);
        x[i] = load_kv(kk + i * ks + d);
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
template <int RR, int W = DC, class KV>
void tile_values_by(float* acc, int64_t D, const float* p, int64_t ps, int64_t pi, const float* alpha,
                    const KV* v, int64_t vs, std::type_identity_t<const KV*> ahead) {
  for (int64_t d = 0; d < D; d += W * LN) {
    vn x[RR][W];
    for (int i = 0; i < RR; ++i)
      for (int c = 0; c < W; ++c) x[i][c] = alpha ? vload<vn>(acc + i * D + d + c * LN) * alpha[i]
                                                 : vload<vn>(acc + i * D + d + c * LN);
    for (int64_t s = 0; s < TILE; ++s) {
      vn y[W];
      for (int c = 0; ahead && c < W; ++c) __builtin_prefetch(ahead + s * vs + d + c * LN, 0, 2);
      for (int c = 0; c < W; ++c) {
        y[c] = load_kv(v + s * vs + d + c * LN);
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

template <int RR, class KV>
__attribute__((noinline)) void tile_values(float* acc, int64_t D, const float* p, int64_t ps, int64_t pi,
                                           const float* alpha, const KV* v, int64_t vs,
                                           std::type_identity_t<const KV*> ahead) {
#if defined(__AVX512F__)
  if (D % 32 == 0) return tile_values_by<RR, 2>(acc, D, p, ps, pi, alpha, v, vs, ahead);
#endif
  tile_values_by<RR, DC>(acc, D, p, ps, pi, alpha, v, vs, ahead);
}

// tile_values for R consecutive query rows (6 at a time, then the rest), acc R x D, p[s, i] at p + s * ps + i * pi
template <class KV>
inline void values_rows(int64_t R, float* acc, int64_t D, const float* p, int64_t ps, int64_t pi, const float* alpha,
                        const KV* v, int64_t vs, std::type_identity_t<const KV*> ahead) {
  int64_t r = 0;
  for (; r + 6 <= R; r += 6)
    tile_values<6>(acc + r * D, D, p + r * pi, ps, pi, alpha ? alpha + r : nullptr, v, vs, r ? nullptr : ahead);
  float* ar = acc + r * D;
  const float *pr = p + r * pi, *al = alpha ? alpha + r : nullptr;
  const KV* va = r ? nullptr : ahead;
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
  const int64_t esz = kv_element_bytes(a.kv), row_bytes = kv_row_elements(a.kv, D) * esz;
  const char* kb = static_cast<const char*>(a.k) + (b * a.k0 + g * a.k1) * esz;  // this key head's rows, as stored
  const char* vb_ = static_cast<const char*>(a.v) + (b * a.v0 + g * a.v1) * esz;
  const bool direct = a.kv == KvFormat::F32;  // whole tiles read in place
  const bool half = a.kv == KvFormat::F16;  // few rows: whole tiles read in place, turned into float32 by load_kv
  const uint8_t* mrows = a.mask ? a.mask + (blk.mrow * a.T + blk.t0) * S : nullptr;
  auto prefetch = [&](int64_t c) {  // a tile's stored keys and values, while the one before is computed
    const int64_t s0 = (int64_t)(blk.tiles[c] >> 1) * TILE;
    for (int64_t s = s0; s < std::min(s0 + TILE, S); ++s)
      for (int64_t o = 0; o < row_bytes; o += 64) {
        __builtin_prefetch(kb + s * a.k2 * esz + o);
        __builtin_prefetch(vb_ + s * a.v2 * esz + o);
      }
  };
  constexpr int64_t AHEAD = 2;  // few rows: tiles prefetched ahead
  // keys or values s0 .. s0 + 15 of a head's stored rows (stride stored elements apart) as float32 rows, rs apart:
  // in place where they are float32 and the tile is whole, else turned into float32 in buf (TILE x D; rows past
  // S zero)
  auto tile_of = [&](const char* base, int64_t stride, int64_t s0, float* buf, int64_t& rs) -> const float* {
    if (direct && s0 + TILE <= S) {
      rs = stride;
      return reinterpret_cast<const float*>(base) + s0 * stride;
    }
    const int64_t n = std::min(TILE, S - s0);
    for (int64_t s = 0; s < n; ++s) kv_decode(a.kv, base + (s0 + s) * stride * esz, D, buf + s * D);
    std::fill(buf + n * D, buf + TILE * D, 0.0f);
    rs = D;
    return buf;
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
      const float* vaheads[CHUNK];
      int64_t vstarts[CHUNK];
      for (int64_t j = 0; j < count; ++j) {
        const int64_t c = cc + j, s0 = (int64_t)(blk.tiles[c] >> 1) * TILE;
        const float* kahead = nullptr;  // a whole float32 tile AHEAD on (a cut last tile is not)
        vaheads[j] = nullptr;
        if (c + AHEAD < c1) {
          const int64_t sa = (int64_t)(blk.tiles[c + AHEAD] >> 1) * TILE;
          if (!direct)
            prefetch(c + AHEAD);  // (stored rows: in a burst)
          else if (sa + TILE <= S)
            kahead = reinterpret_cast<const float*>(kb) + sa * a.k2,
            vaheads[j] = reinterpret_cast<const float*>(vb_) + sa * a.v2;
        }
        vstarts[j] = s0;
        float* scj = sc + j * TILE;
        auto scores = [&](const auto* kt, int64_t ks, const auto* kahead) {
          int64_t r = 0;
#if defined(__AVX512F__)  // 16 accumulators: each key vector loaded serves 4 rows (32 registers)
          for (; r + 4 <= R; r += 4) tile_scores_dot<4>(qt + r * D, D, kt, ks, scj + r * CT, CT, r ? nullptr : kahead);
#endif
          // 3 rows (grouped heads of 3, SmolLM2's) at once: AVX2's 16 registers hold the 12 sums and 4 keys, each key
          // vector read and converted once, not for 2 rows and again for 1 (30 layers of a 16-sequence decode step
          // on AMD EPYC Zen 3: 1.04-1.07x; kernels_ab.py --attention 16,576)
          if (R - r == 3) tile_scores_dot<3>(qt + r * D, D, kt, ks, scj + r * CT, CT, r ? nullptr : kahead), r += 3;
          for (; r + 2 <= R; r += 2) tile_scores_dot<2>(qt + r * D, D, kt, ks, scj + r * CT, CT, r ? nullptr : kahead);
          if (r < R) tile_scores_dot<1>(qt + r * D, D, kt, ks, scj + r * CT, CT, r ? nullptr : kahead);
        };
        if (half && s0 + TILE <= S) {
          scores(reinterpret_cast<const uint16_t*>(kb) + s0 * a.k2, a.k2, (const uint16_t*)nullptr);
        } else {
          int64_t ks;
          const float* kt = tile_of(kb, a.k2, s0, w.ktail, ks);
          scores(kt, ks, kahead);
        }
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
      for (int64_t j = 0; j < count; ++j) {  // the values so far rescaled once, with the chunk's first tile
        if (half && vstarts[j] + TILE <= S) {
          values_rows(R, acc, D, sc + j * TILE, 1, CT, j ? nullptr : alpha,
                      reinterpret_cast<const uint16_t*>(vb_) + vstarts[j] * a.v2, a.v2, nullptr);
          continue;
        }
        int64_t vs;
        const float* vt = tile_of(vb_, a.v2, vstarts[j], w.vtail, vs);
        values_rows(R, acc, D, sc + j * TILE, 1, CT, j ? nullptr : alpha, vt, vs, vaheads[j]);
      }
    }
  } else {
    // many rows: the rows in vector lanes, the next tile prefetched in a burst
    for (int64_t c = c0; c < c1; ++c) {
      if (c == c0) prefetch(c);
      if (c + 1 < c1) prefetch(c + 1);
      const int64_t s0 = (int64_t)(blk.tiles[c] >> 1) * TILE;
      int64_t ks, vs;
      const float *kt = tile_of(kb, a.k2, s0, w.ktail, ks), *vt = tile_of(vb_, a.v2, s0, w.vtail, vs);
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

}  // namespace

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
    parallel_for(0, MB * T, std::max<int64_t>(1, (1 << 20) / S), [&](int64_t i0, int64_t i1) {  // ~1 MB a task
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
  const int64_t threads = num_threads();
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

void AttentionRun::work(Scratch& w) {
  const int64_t nitems = plan_->items.size();
  for (int64_t i = next_++; i < nitems; i = next_++) {
    const AttentionPlan::Item& it = plan_->items[plan_->order[i]];
    float* part = it.part >= 0 ? parts_.data() + it.part * slot_ : nullptr;
    attend_tiles(args_, it.b, it.g, plan_->blocks[it.blk], it.c0, it.c1, w, part);
    if (it.split >= 0 && pending_[it.split].fetch_sub(1, std::memory_order_acq_rel) == 1)
      merge(plan_->splits[it.split], w.acc);
  }
}

void AttentionRun::merge(const AttentionPlan::Split& sp, float* acc) {
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

// attends as planned, into args.out (B, T, H, D), in one parallel region (each region can wait a time
// slice for a thread on a busy host)
void attend(const AttentionPlan& plan, const AttentionArgs& args) {
  AttentionRun run(&plan, &plan + 1, args.D);
  run.start(plan, args);
  parallel_for(0, std::min<int64_t>(plan.threads, plan.items.size()), 1, [&](int64_t, int64_t) {
    Scratch w(plan.RMAX, args.D);
    run.work(w);
  });
}

}  // namespace kvgen
