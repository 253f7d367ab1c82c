// The decoder layers of layer.h: one decode step's layers as one parallel region, its phases apart by a spinning
// barrier, around the products of dot.h and the attention of attention.h.
#include "layer.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "attention.h"
#include "parallel.h"
#include "simd.h"

namespace kvgen {
namespace {

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

// y[i] = x[i] + y[i] over n values: y becomes x + y, as ATen adds them
void add_into(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] + y[i];
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

}  // namespace

// rows of D values: y = rms_norm(x) * (w + offset), rows in parallel (y may be x)
void rms_rows(const float* x, const float* w, int64_t rows, int64_t D, double eps, double offset, float* y) {
  parallel_for(0, rows, std::max<int64_t>(1, 16384 / D), [&](int64_t r0, int64_t r1) {  // ~64 kB a task
    for (int64_t r = r0; r < r1; ++r) rms_row(x + r * D, w, D, eps, y + r * D, (float)offset);
  });
}

// The heads of a fused q/k/v product's rows: layer.h
void rotate_heads(const float* src, const float* bias, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                  const float* cp, const float* sp, const float* qn, const float* kn, double head_eps, double offset,
                  Heads q, Heads k, Heads v, int64_t h0, int64_t h1) {
  const int64_t runs = D / 16, half = runs / 2, width = (H + 2 * Hkv) * D;
  // rows in parallel (a prefill's; a decode step's few rows stay on this thread)
  parallel_for(0, B * T, std::max<int64_t>(1, 4096 / width), [&](int64_t r0, int64_t r1) {
    std::vector<float> normed(D), biased(D);
    for (int64_t bt = r0; bt < r1; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      const float *row = src + bt * width, *cr = cp + bt * D, *sr = sp + bt * D;
      for (int64_t h = h0; h < h1; ++h) {
        const float* in = row + h * D;
        float* out = h < H ? q.p + b * q.s0 + h * q.s1 + t * q.s2
                   : h < H + Hkv ? k.p + b * k.s0 + (h - H) * k.s1 + t * k.s2
                                 : v.p + b * v.s0 + (h - H - Hkv) * v.s1 + t * v.s2;
        if (bias != nullptr) {  // the product rounded, then its bias added (as y + bias after the product)
          for (int64_t j = 0; j < runs; ++j) {
            const vf s = loadf(in + 16 * j) + loadf(bias + h * D + 16 * j);
            std::memcpy(biased.data() + 16 * j, &s, 64);
          }
          in = biased.data();
        }
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

// act(g) * u of gate_up = [g, u] (R rows of 2 I) -> (R, I), as a gated MLP computes it: act 0 SiLU, 1
// GELU (tanh), a vector register at a time (vexp / vtanh: a few ulp, as ATen's vectorised ones; the C
// library's one value at a time cost a decode step ~10 us a layer for SmolLM2, ~40 us for Gemma 3's
// tanh), rows in parallel (a prefill: ATen's gelu and mul of two strided halves took ~2 ms a layer).
// In vn, the register's width: on AVX2 GCC turns the selects of vexp / vtanh over 16 lanes (two
// registers) into one lane at a time and passes them through memory: 1.12 -> 0.16 ms for 256 rows of
// SmolLM2 (AMD EPYC Zen 3, 2 threads)
void gated_rows(const float* g, int64_t R, int64_t I, int64_t act, float* mp) {
  auto activate = [act](vn gv) {
    if (act == 0) return gv / (1.0f + vexp(-gv));
    const vn inner = 0.7978845608028654f * (gv + 0.044715f * (gv * gv * gv));  // ATen's tanh GELU
    return 0.5f * gv * (1.0f + vtanh(inner));
  };
  parallel_for(0, R, std::max<int64_t>(1, 8192 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *gr = g + r * 2 * I, *ur = gr + I;
      float* out = mp + r * I;
      int64_t j = 0;
      for (; j + LN <= I; j += LN) {
        const vn a = activate(vload<vn>(gr + j));  // a product apart from the one by u: act(g) rounded first
        vstore(out + j, a * vload<vn>(ur + j));
      }
      for (; j < I; ++j) {
        float a = activate(vn{} + gr[j])[0];
        asm("" : "+x"(a));  // rounded before the product, as act(g) * u
        out[j] = a * ur[j];
      }
    }
  });
}

int64_t mlp_scratch_floats(const MlpWeights& w, int64_t R) { return R * (2 * w.hidden + 3 * w.I); }

void decoder_mlp(const MlpWeights& w, const float* x, const float* attn, int64_t R, float* scratch, float* out,
                 bool prompt) {
  float *const h = scratch, *const normed = h + R * w.hidden, *const gu = normed + R * w.hidden;
  mlp_rows(w, x, attn, R, {h, gu, out, h, normed, gu + 2 * R * w.I}, out,
           [&](const Product& p, const float* in, int64_t ldx, float* y) { product_into(p, in, ldx, R, y, prompt); },
           [] {});
}

// rows shared by the threads: q/k/v (width), q and attention (H D), o and down (hidden), gate/up (2 I), the new
// keys and values before they are stored (2 Hkv D); each thread's own: x, normed and h (hidden), act(g) * u (I)
int64_t decoder_layers_scratch(const Stack& w, int64_t R, int64_t threads) {
  const int64_t width = (w.H + 2 * w.Hkv) * w.D;
  return R * (width + 2 * w.H * w.D + 2 * w.hidden + 2 * w.I + 2 * w.Hkv * w.D) + threads * R * (3 * w.hidden + w.I);
}

namespace {

// The new keys (or values) of heads g0 .. g1 - 1, rotated into fresh (B, Hkv, T, D), stored in their slots of a
// layer's buffer (base: slot 0 of batch row 0, head 0; strides s0, s1, s2 in stored elements): slots[t], or the
// last T of start .. end - 1. kv_encode, as kvgen::kv_store_ (the per-layer path's cache update): the same bits.
void store_new(const LayerSlots& c, void* base, int64_t s0, int64_t s1, int64_t s2, const float* fresh, int64_t B,
               int64_t Hkv, int64_t T, int64_t D, int64_t g0, int64_t g1) {
  const int64_t esz = kv_element_bytes(c.kv);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = c.slots ? c.slots[t] : c.end - T + t;
        kv_encode(c.kv, fresh + ((b * Hkv + g) * T + t) * D, D,
                  static_cast<char*>(base) + (b * s0 + g * s1 + slot * s2) * esz);
      }
}

}  // namespace

// The same functions as decoder_mlp and the ops of the modules, in the same order, so the paths give the same bits;
// here on raw rows in one scratch allocation, with one attention plan for the layers that attend over as many slots
// without a mask (the ops' ATen calls, allocations and plans were ~25 us a layer, a sixth of a SmolLM2 step on 2
// cores).
void decoder_layers(const Stack& w, const float* x0, int64_t B, int64_t T, const std::vector<const float*>& cos,
                    const std::vector<const float*>& sin, const std::vector<LayerSlots>& layers, int64_t threads,
                    float* scratch, float* out) {
  const size_t L = w.layers.size();
  const int64_t H = w.H, Hkv = w.Hkv, D = w.D, hidden = w.hidden, R = B * T;
  // every layer's attention plan, before the first layer
  std::vector<AttentionPlan> plans;  // the masked layers', then one per slot count of the others
  plans.reserve(L);
  std::vector<const AttentionPlan*> plan_of(L);
  std::vector<std::pair<int64_t, const AttentionPlan*>> by_slots;
  int64_t RMAX = 1;
  for (size_t i = 0; i < L; ++i) {
    const LayerSlots& c = layers[i];
    const int64_t S = c.end - c.start;
    const auto it = std::find_if(by_slots.begin(), by_slots.end(), [&](const auto& p) { return p.first == S; });
    if (!c.mask && it != by_slots.end()) {
      plan_of[i] = it->second;
      continue;
    }
    plan_of[i] = &plans.emplace_back(plan_attention(B, T, Hkv, H / Hkv, S, c.mask, c.mask ? c.mask_rows : 1));
    if (!c.mask) by_slots.emplace_back(S, plan_of[i]);
    RMAX = std::max(RMAX, plans.back().RMAX);
  }
  const int64_t width = (H + 2 * Hkv) * D, I = w.I, own = R * (3 * hidden + I);
  float* const qkv = scratch;
  float *const q = qkv + R * width, *const attn = q + R * H * D, *const o = attn + R * H * D;
  float *const down = o + R * hidden, *const gu = down + R * hidden, *const fresh = gu + R * 2 * I;
  SpinBarrier barrier;
  // each product's next unclaimed row (4 products a layer), for its threads to take pieces of in turn
  std::vector<std::atomic<int64_t>> claimed(4 * L);
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
      float* const x = fresh + 2 * R * Hkv * D + t * own;
      float *const xn = x + R * hidden, *const h = xn + R * hidden, *const m = h + R * hidden;
      std::memcpy(x, x0, R * hidden * sizeof(float));
      Scratch scratch_rows(RMAX, D);
      // pieces of rows 0 .. N - 1 taken in turn until none is left (product_piece). Split evenly in advance, the
      // other thread of a 2-core Zen 3 VM waited 14% of a Qwen2.5-0.5B decode step at the barriers
      int64_t products = 0;
      auto product = [&](const Product& p, const float* in, int64_t ldx, float* y) {
        const ProductInput rows = product_input(p, in, ldx, R);
        std::atomic<int64_t>& next = claimed[products++];
        const int64_t piece = product_piece(p, n);
        for (int64_t n0; (n0 = next.fetch_add(piece, std::memory_order_relaxed)) < p.N;)
          product_rows(p, rows, n0, std::min(p.N, n0 + piece), y);
      };
      for (size_t i = 0; i < L; ++i) {
        const StackLayer& l = w.layers[i];
        const LayerSlots& c = layers[i];
        const int64_t S = c.end - c.start, esz = kv_element_bytes(c.kv);
        const char *kp = static_cast<const char*>(c.keys) + c.start * c.k2 * esz,
                   *vp = static_cast<const char*>(c.values) + c.start * c.v2 * esz;
        rms_rows(x, l.input_norm, R, hidden, w.eps, w.offset, xn);
        product(l.qkv, xn, hidden, qkv);
        if (t == 0)  // (the last layer's run ended before its o product)
          run.start(*plan_of[i], AttentionArgs{q, kp, vp, H * T * D, T * D, D, c.k0, c.k1, c.k2, c.v0, c.v1, c.v2,
                                               c.mask, T, S, H, H / Hkv, D, (float)l.scale, (float)l.softcap, attn,
                                               c.kv});
        barrier.wait(n);
        const int64_t heads = H + 2 * Hkv, per = (heads + n - 1) / n, h0 = std::min(heads, t * per),
                      h1 = std::min(heads, (t + 1) * per);
        // float32 slots in a row: the new keys and values rotated straight into them; else into fresh, then this
        // thread's key and value heads stored
        const bool in_place = c.kv == KvFormat::F32 && !c.slots;
        float* const fv = fresh + R * Hkv * D;
        const Heads kh = in_place ? Heads{static_cast<float*>(c.keys) + (c.end - T) * c.k2, c.k0, c.k1, c.k2}
                                  : Heads{fresh, Hkv * T * D, T * D, D};
        const Heads vh = in_place ? Heads{static_cast<float*>(c.values) + (c.end - T) * c.v2, c.v0, c.v1, c.v2}
                                  : Heads{fv, Hkv * T * D, T * D, D};
        rotate_heads(qkv, l.qkv_bias, B, T, H, Hkv, D, cos[c.table], sin[c.table], l.q_norm, l.k_norm, w.head_eps,
                     w.offset, {q, H * T * D, T * D, D}, kh, vh, h0, h1);
        if (!in_place) {
          auto heads_of = [&](int64_t first) {  // this thread's heads among first .. first + Hkv - 1, from 0
            return std::make_pair(std::clamp(h0 - first, (int64_t)0, Hkv), std::clamp(h1 - first, (int64_t)0, Hkv));
          };
          const auto [k0, k1] = heads_of(H);
          const auto [v0, v1] = heads_of(H + Hkv);
          store_new(c, c.keys, c.k0, c.k1, c.k2, fresh, B, Hkv, T, D, k0, k1);
          store_new(c, c.values, c.v0, c.v1, c.v2, fv, B, Hkv, T, D, v0, v1);
        }
        barrier.wait(n);
        run.work(scratch_rows);
        barrier.wait(n);
        mlp_rows(l.mlp, x, attn, R, {o, gu, down, h, xn, m}, x, product, [&] { barrier.wait(n); });
      }
      if (t == 0) std::memcpy(out, x, R * hidden * sizeof(float));
    }
  }
}

}  // namespace kvgen
