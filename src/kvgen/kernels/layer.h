// Decoder layers (Llama family, Qwen3, Gemma 2/3) on stored-precision weights (layer.cpp): the dense parts of a
// decode step's layer, and a whole step's stack of layers as one call. Each computes what the eager modules compute
// (rms_norm, the products and float32 element-wise steps in the same order, each product rounded before its sum),
// so the paths agree up to the last bit of the activation's exp / tanh.
//
// Example (ops.cpp's kvgen::decoder_mlp): out (R, hidden) = the MLP half of a layer over x and attn
//     std::vector<float> scratch(mlp_scratch_floats(w, R));
//     decoder_mlp(w, x, attn, R, scratch.data(), out);
#pragma once

#include <cstdint>
#include <vector>

#include "dot.h"
#include "kv_rows.h"

namespace kvgen {

// rows of D values: y = rms_norm(x) * (w + offset), rows in parallel (y may be x)
void rms_rows(const float* x, const float* w, int64_t rows, int64_t D, double eps, double offset, float* y);

// Where a layer's queries, keys and values go: (B, heads, T, D) rows at p + b * s0 + h * s1 + t * s2.
struct Heads {
  float* p;
  int64_t s0, s1, s2;
};

// The heads of a fused q/k/v product's rows (B * T rows of (H + 2 Hkv) D values): the product's bias ((H + 2 Hkv)
// D values, Qwen2's; or null) added, optional RMSNorm of each query / key head (Qwen3, Gemma 3), rotary on the query
// and key heads (cos/sin (B * T, D), sin's first half negated: rotated = x * cos + roll(x, D / 2) * sin, as
// kvgen.rope.apply_rotary), written to q, k and v; heads h0 .. h1 - 1 of the product's H + 2 Hkv.
void rotate_heads(const float* src, const float* bias, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                  const float* cp, const float* sp, const float* qn, const float* kn, double head_eps, double offset,
                  Heads q, Heads k, Heads v, int64_t h0, int64_t h1);

// act(g) * u of gate_up = [g, u] (R rows of 2 I) -> (R, I): act 0 SiLU, 1 GELU (tanh)
void gated_rows(const float* g, int64_t R, int64_t I, int64_t act, float* mp);

// The weights of a decoder layer's MLP half (kvgen::decoder_mlp): the o, gate/up and down products and
// the norms (post_attention and post_feedforward: Gemma's sandwich norms, else null).
struct MlpWeights {
  Product o, gate_up, down;
  const float *post_attention, *pre_feedforward, *post_feedforward;
  int64_t hidden, I, act;
  double eps, offset;
};

// the floats of scratch decoder_mlp takes for R rows
int64_t mlp_scratch_floats(const MlpWeights& w, int64_t R);

// h = x + post_attention(attn @ o^T); out = h + post_feedforward((act(g) * u) @ down^T) with
// [g, u] = pre_feedforward(h) @ gate_up^T. act: 0 SiLU, 1 GELU (tanh). The post norms are Gemma's
// sandwich norms (absent for Llama); every norm scales by weight + offset (Gemma: 1). x and out (R, hidden),
// attn (R, o's input features). prompt: the rows feed a prompt's tokens (dot.h's product_input)
void decoder_mlp(const MlpWeights& w, const float* x, const float* attn, int64_t R, float* scratch, float* out,
                 bool prompt = false);

// A decode stack's weights, registered once (kvgen::decoder_stack) and named by an id in each step's
// kvgen::decoder_layers, rather than the ~300 tensors of SmolLM2's 30 layers converted from Python
// lists and checked at every call.
struct StackLayer {
  const float *input_norm, *q_norm, *k_norm, *qkv_bias;  // (qkv_bias: null where the product has none)
  Product qkv;
  MlpWeights mlp;
  double scale, softcap;
};

struct Stack {
  std::vector<StackLayer> layers;
  int64_t H, Hkv, D, hidden, I;  // I: the largest intermediate size
  double eps, head_eps, offset;
};

// A layer's cache in one step: slots start .. end - 1 of keys / values (B, Hkv, slots, W, stored as kv says:
// kv_rows.h; strides k0, k1, k2 and v0, v1, v2 in stored elements); the step's new tokens go into the last T of them,
// or, where slots is set (B = 1), into slots[0 .. T - 1] (a paged pool's, placed by the caller); mask: bool
// (mask_rows = B or 1, T, end - start), or null (every slot allowed); table: the rotary table the layer takes
struct LayerSlots {
  void *keys, *values;
  int64_t k0, k1, k2, v0, v1, v2, start, end;
  const uint8_t* mask;
  int64_t mask_rows, table;
  KvFormat kv;
  const int64_t* slots;
};

// the floats of scratch decoder_layers takes for R = B * T rows on `threads` threads
int64_t decoder_layers_scratch(const Stack& w, int64_t R, int64_t threads);

// A whole decode step's layers as one call, on `threads` threads: for each layer, rms_norm -> the fused q/k/v
// product (+ its bias) -> head norms and rotary (cos[table], sin[table]: (B, T, D)), its new keys and values stored
// in its slots (LayerSlots), attention over the slots, then decoder_mlp's work. x and out (B, T, hidden).
void decoder_layers(const Stack& w, const float* x, int64_t B, int64_t T, const std::vector<const float*>& cos,
                    const std::vector<const float*>& sin, const std::vector<LayerSlots>& layers, int64_t threads,
                    float* scratch, float* out);

}  // namespace kvgen
