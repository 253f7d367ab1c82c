// The torch ops (torch.ops.kvgen.*), registered with torch's dispatcher: the only file that knows torch's
// tensors. Each op checks its tensors, takes their data apart into the plain arguments of dot.h, attention.h
// and layer.h, and allocates what it returns. Built for this CPU and loaded by kvgen/kernels/__init__.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "attention.h"
#include "dot.h"
#include "kv_rows.h"
#include "layer.h"
#include "parallel.h"
#include "sampling.h"
#include "ssm.h"

namespace kvgen {
namespace {

// a weight segment in `format` for K input features, checked: rows of blocks (a tiled format's rows contiguous, a
// multiple of its tile); F32's rows may also be a float32 (N, K) tensor (a float model's own weight, read in place),
// whose bytes they are
Product::Segment segment(const at::Tensor& w, int64_t format, int64_t K) {
  FormatShape shape;
  TORCH_CHECK(format_shape(format, &shape), "kvgen: no kernel for weight format ", format);
  const int64_t tile = shape.tile_rows;
  TORCH_CHECK(tile == 1 || (w.size(0) % tile == 0 && w.is_contiguous()), "kvgen: a weight in tiles of ", tile,
              " rows must be contiguous with a multiple of ", tile, " rows");
  const bool floats = shape.floats && w.scalar_type() == at::kFloat;
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kByte || floats) && w.stride(1) == 1,
              "kvgen: weight must be 2-D uint8 rows", shape.floats ? " or float32 rows" : "");
  TORCH_CHECK(K % shape.block_values == 0, "kvgen: input features ", K, " are not a multiple of the block size ",
              shape.block_values);
  TORCH_CHECK(w.size(1) * w.element_size() == K / shape.block_values * shape.block_bytes + (shape.row_scale ? 4 : 0),
              "kvgen: weight rows hold ", w.size(1) * w.element_size(), " bytes, not what ", K, " input features need");
  return {format, 0, w.size(0), w.stride(0) * w.element_size(), static_cast<const uint8_t*>(w.const_data_ptr())};
}

// the product of the row segments ws[i] (each in formats[i]) of K input features; held (if given) takes the tensors
Product product_of(at::TensorList ws, at::IntArrayRef formats, int64_t K, std::vector<at::Tensor>* held = nullptr) {
  TORCH_CHECK(ws.size() == formats.size() && !ws.empty(), "kvgen: one format per weight segment");
  std::vector<Product::Segment> segments;
  for (size_t i = 0; i < ws.size(); ++i) {
    segments.push_back(segment(ws[i], formats[i], K));
    if (held) held->push_back(ws[i]);
  }
  return make_product(std::move(segments), K);
}

// x (R, K) float32 rows times the row segments ws[i] (each in formats[i]) -> (R, sum of their rows); prompt: the rows
// feed a prompt's tokens (dot.h's product_input)
at::Tensor qmatmul_op(const at::Tensor& x, at::TensorList ws, at::IntArrayRef formats, bool prompt) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "kvgen: x must be (rows, K) float32");
  const Product p = product_of(ws, formats, x.size(1));
  at::Tensor y = at::empty({x.size(0), p.N}, x.options());
  product_into(p, x.data_ptr<float>(), x.stride(0), x.size(0), y.data_ptr<float>(), prompt);
  return y;
}

// out (N, K) float32 rows (may be a row slice of a bigger buffer)
void dequantize_op(at::Tensor out, const at::Tensor& w, int64_t format) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1, "kvgen: out must be (N, K) float32");
  TORCH_CHECK(out.size(0) == w.size(0), "kvgen: out has ", out.size(0), " rows, the weight ", w.size(0));
  const Product::Segment seg = segment(w, format, out.size(1));
  dequantize(format, seg.w, seg.row_bytes, seg.rows, out.size(1), out.data_ptr<float>(), out.stride(0));
}

// a weight's rows (N, row bytes) uint8 into out (the same shape, contiguous) in tiles of 16 rows of format (2000 + the
// format in rows)
void tile_rows_op(at::Tensor out, const at::Tensor& rows, int64_t format) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kByte && rows.stride(1) == 1 && rows.size(0) % 16 == 0,
              "kvgen: tile_rows takes (16 * tiles, row bytes) uint8 rows");
  TORCH_CHECK(out.sizes() == rows.sizes() && out.scalar_type() == at::kByte && out.is_contiguous(),
              "kvgen: tile_rows writes a contiguous uint8 tensor of the rows' shape");
  TORCH_CHECK(tile_rows(format, rows.const_data_ptr<uint8_t>(), rows.stride(0), rows.size(0) / 16, rows.size(1),
                        out.data_ptr<uint8_t>()),
              "kvgen: tile_rows: format ", format, " has no tiles in this build, or rows of ", rows.size(1),
              " bytes are not whole blocks of it");
}

// rows ids of a packed (N, K) weight as float32 (n, K): an embedding lookup in one op
at::Tensor embedding_op(const at::Tensor& w, const at::Tensor& ids, int64_t K, int64_t format) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "kvgen: embedding ids must be 1-D int64");
  const at::Tensor idc = ids.contiguous();
  const int64_t n = idc.size(0), N = w.size(0);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < N, "kvgen: token id ", ip[i], " is outside the embedding table's ", N,
                      " rows");
  at::Tensor out = at::empty({n, K}, w.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const Product::Segment seg = segment(w, format, K);
  embedding(format, seg.w, seg.row_bytes, ip, n, K, op);
  return out;
}

// x (rows, D) float32 contiguous -> x / sqrt(mean(x^2) + eps) * (weight + offset), one pass per row
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous() && x.size(-1) == weight.numel(), "kvgen: rms_norm takes contiguous float32");
  const int64_t D = weight.numel(), rows = x.numel() / D;
  at::Tensor y = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  rms_rows(xp, wp, rows, D, eps, offset, yp);
  return y;
}

// how keys and values of dtype t are stored (int8: Q8 rows, kv_rows.h)
KvFormat kv_format(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return KvFormat::F32;
    case at::kHalf: return KvFormat::F16;
    case at::kBFloat16: return KvFormat::BF16;
    case at::kChar: return KvFormat::Q8;
    default:
      TORCH_CHECK(false, "kvgen: keys and values are stored as float32, float16, bfloat16 or int8 rows, not ", t);
  }
}

// stored elements of a row of D values in format f (Q8 rows take D a multiple of 32)
int64_t kv_row_width(KvFormat f, int64_t D) {
  TORCH_CHECK(f != KvFormat::Q8 || D % 32 == 0, "kvgen: int8 keys and values take a scale per 32 values, not rows of ",
              D);
  return kv_row_elements(f, D);
}

// q (B, H, T, D), k and v (B, Hkv, S, D), mask: bool (B or 1, 1, T, S) or none -> (B, H, T, D) as a view of (B, T,
// H, D) storage, so the caller's transpose + flatten is free (attention.cpp says what it computes)
at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                        double scale, double softcap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat,
              "kvgen: attention takes 4-D tensors, the queries float32");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  const KvFormat kv = kv_format(k.scalar_type());
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "kvgen: attention's keys and values are stored alike, not as ",
              k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK(D % 16 == 0 && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && H % Hkv == 0,
              "kvgen: attention needs a head size that is a multiple of 16 and contiguous heads");
  const int64_t width = kv_row_width(kv, D);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && k.size(3) == width &&
              v.size(3) == width, "kvgen: attention's keys and values must be (B, Hkv, S, ", width, ")",
              kv == KvFormat::Q8 ? " (int8 rows: D codes and D / 32 float32 scales)" : "");
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
  const AttentionArgs args{q.data_ptr<float>(), k.data_ptr(), v.data_ptr(),
                           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                           v.stride(0), v.stride(1), v.stride(2), mp, T, S, H, H / Hkv, D, (float)scale, (float)softcap,
                           out.data_ptr<float>(), kv};
  attend(plan, args);
  return out.transpose(1, 2);
}

// buffer (B, H, slots, W), stored as its dtype says (kv_format), x (B, H, T, D) float32, index (T,) int64:
// buffer[:, :, index[t]] = x[:, :, t]'s stored rows (buffer.index_copy_(2, index, kvgen.cache.precision.encode(x))
// in one pass, the same bits for finite values)
void kv_store_op(at::Tensor& buffer, const at::Tensor& index, const at::Tensor& x) {
  TORCH_CHECK(buffer.dim() == 4 && x.dim() == 4 && x.scalar_type() == at::kFloat && x.size(0) == buffer.size(0) &&
              x.size(1) == buffer.size(1) && buffer.stride(3) == 1 && x.stride(3) == 1,
              "kvgen: kv_store_ takes a (B, H, slots, W) buffer and float32 (B, H, T, D) rows, the last dims contiguous");
  const KvFormat f = kv_format(buffer.scalar_type());
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), slots = buffer.size(2);
  const int64_t width = kv_row_width(f, D);
  TORCH_CHECK(buffer.size(3) == width, "kvgen: kv_store_: ", buffer.scalar_type(), " rows of ", D, " values are ",
              width, " wide, not ", buffer.size(3));
  const at::Tensor idx = index.contiguous();
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 1 && idx.size(0) == T,
              "kvgen: kv_store_ takes one int64 slot per position (", T, ")");
  const int64_t* slot = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(0 <= slot[t] && slot[t] < slots, "kvgen: kv_store_: slot ", slot[t], " is outside the buffer's ", slots);
  const int64_t esz = kv_element_bytes(f);
  char* out = static_cast<char*>(buffer.data_ptr());
  const float* in = x.data_ptr<float>();
  parallel_for(0, B * H * T, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (H * T), h = r / T % H, t = r % T;
      kv_encode(f, in + b * x.stride(0) + h * x.stride(1) + t * x.stride(2), D,
                out + (b * buffer.stride(0) + h * buffer.stride(1) + slot[t] * buffer.stride(2)) * esz);
    }
  });
}

const float* data_or_null(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

// rms_norm(x) -> one fused q/k/v product (+ its bias: Qwen2) -> optional RMSNorm of each query / key head (Qwen3,
// Gemma 3) -> rotary on the query and key heads. x (B, T, hidden); cos/sin (B, T, D) with sin's first
// half negated (rotated = x * cos + roll(x, D / 2) * sin, as kvgen.rope.apply_rotary). Returns q (B,
// H, T, D), k and v (B, Hkv, T, D), contiguous.
std::vector<at::Tensor> decoder_attention_inputs_op(const at::Tensor& x, const at::Tensor& norm, double eps,
                                                    at::TensorList ws, at::IntArrayRef formats, const at::Tensor& cos,
                                                    const at::Tensor& sin, int64_t H, int64_t Hkv,
                                                    const c10::optional<at::Tensor>& q_norm,
                                                    const c10::optional<at::Tensor>& k_norm, double head_eps,
                                                    double offset, const c10::optional<at::Tensor>& bias,
                                                    bool prompt) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
              cos.size(1) == x.size(1) && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "kvgen: decoder_attention_inputs takes x (B, T, hidden) and float32 cos/sin (B, T, D)");
  const int64_t B = x.size(0), T = x.size(1), D = cos.size(2), R = B * T;
  TORCH_CHECK(D % 32 == 0, "kvgen: decoder_attention_inputs needs a head size that is a multiple of 32, not ", D);
  for (const auto* n : {&q_norm, &k_norm})
    TORCH_CHECK(!n->has_value() || ((*n)->numel() == D && (*n)->is_contiguous() && (*n)->scalar_type() == at::kFloat),
                "kvgen: a head norm holds D float32 weights");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == (H + 2 * Hkv) * D && bias->is_contiguous() &&
                                    bias->scalar_type() == at::kFloat),
              "kvgen: the q/k/v product's bias holds its (", H, " + 2 * ", Hkv, ") * ", D, " features' float32 values");
  const at::Tensor normed = rms_norm_op(x.contiguous(), norm, eps, offset).view({R, x.size(2)});  // (R, hidden)
  const at::Tensor qkv = qmatmul_op(normed, ws, formats, prompt);  // (R, (H + 2 Hkv) D)
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "kvgen: the q/k/v product has ", qkv.size(1), " features, not (",
              H, " + 2 * ", Hkv, ") * ", D);
  const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
  at::Tensor q = at::empty({B, H, T, D}, x.options()), k = at::empty({B, Hkv, T, D}, x.options()),
             v = at::empty({B, Hkv, T, D}, x.options());
  rotate_heads(qkv.data_ptr<float>(), data_or_null(bias), B, T, H, Hkv, D, c.data_ptr<float>(), sn.data_ptr<float>(),
               data_or_null(q_norm), data_or_null(k_norm), head_eps, offset, {q.data_ptr<float>(), H * T * D, T * D, D},
               {k.data_ptr<float>(), Hkv * T * D, T * D, D}, {v.data_ptr<float>(), Hkv * T * D, T * D, D}, 0,
               H + 2 * Hkv);
  return {q, k, v};
}

// act(g) * u of gate_up = [g, u] (..., 2 I) -> (..., I), as a gated MLP computes it: act 0 SiLU, 1 GELU (tanh)
at::Tensor gated_activation_op(const at::Tensor& gate_up, int64_t act) {
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

// The weights of a decoder layer's MLP half, checked (held, if given, takes their tensors)
MlpWeights mlp_weights(at::TensorList o, at::IntArrayRef o_formats, const c10::optional<at::Tensor>& post_attention,
                       const at::Tensor& pre_feedforward, const c10::optional<at::Tensor>& post_feedforward,
                       at::TensorList gate_up, at::IntArrayRef gate_up_formats, at::TensorList down,
                       at::IntArrayRef down_formats, int64_t act, int64_t attn_width, int64_t hidden, double eps,
                       double offset, std::vector<at::Tensor>* held = nullptr) {
  TORCH_CHECK(act == 0 || act == 1, "kvgen: decoder_mlp's activation is 0 (SiLU) or 1 (GELU, tanh), not ", act);
  for (const at::Tensor* n : {&pre_feedforward, post_attention ? &*post_attention : nullptr,
                              post_feedforward ? &*post_feedforward : nullptr})
    TORCH_CHECK(!n || (n->numel() == hidden && n->is_contiguous() && n->scalar_type() == at::kFloat),
                "kvgen: decoder_mlp's norms hold hidden = ", hidden, " float32 weights");
  MlpWeights w{product_of(o, o_formats, attn_width, held), product_of(gate_up, gate_up_formats, hidden, held), {},
               data_or_null(post_attention), pre_feedforward.data_ptr<float>(), data_or_null(post_feedforward),
               hidden, 0, act, eps, offset};
  TORCH_CHECK(w.o.N == hidden, "kvgen: o has ", w.o.N, " rows, the hidden size is ", hidden);
  TORCH_CHECK(w.gate_up.N % 2 == 0, "kvgen: gate/up has an odd number of rows (", w.gate_up.N, ")");
  w.I = w.gate_up.N / 2;
  w.down = product_of(down, down_formats, w.I, held);
  TORCH_CHECK(w.down.N == hidden, "kvgen: down has ", w.down.N, " rows, the hidden size is ", hidden);
  return w;
}

// decoder_mlp's scratch of n floats: the calling thread's last one while it is large enough, at most 4x n and at
// most 256 MB, so that the layers of one forward share it (a smaller call, such as the next decode step, lets a
// prefill's go). Fresh at every layer, a 512-token prefill's (58 MB on Llama 3.2 1B, above glibc's mmap threshold)
// was mapped and page-faulted in anew each time, ~4% of the prefill in the kernel: sharing it made prefills of 512
// tokens 1.03-1.17x faster (Llama 3.2 1B, Qwen2.5-0.5B and 1.5B, 1 and 2 threads, AMD EPYC Zen 3, one process)
at::Tensor mlp_scratch(int64_t n) {
  constexpr int64_t KEPT_MAX = 64 << 20;  // floats
  thread_local at::Tensor kept;
  if (kept.defined() && kept.numel() >= n && kept.numel() <= 4 * n) return kept;
  kept = at::Tensor();  // (the old one freed before the new one is taken)
  at::Tensor scratch = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  if (n <= KEPT_MAX) kept = scratch;
  return scratch;
}

// h = x + post_attention(attn @ o^T); out = h + post_feedforward((act(g) * u) @ down^T) with
// [g, u] = pre_feedforward(h) @ gate_up^T. act: 0 SiLU, 1 GELU (tanh). The post norms are Gemma's
// sandwich norms (absent for Llama); every norm scales by weight + offset (Gemma: 1). x (B, T,
// hidden) and attn (B, T, H * D).
at::Tensor decoder_mlp_op(const at::Tensor& x, const at::Tensor& attn, at::TensorList o, at::IntArrayRef o_formats,
                          const c10::optional<at::Tensor>& post_attention, const at::Tensor& pre_feedforward,
                          const c10::optional<at::Tensor>& post_feedforward, double eps, at::TensorList gate_up,
                          at::IntArrayRef gate_up_formats, at::TensorList down, at::IntArrayRef down_formats, int64_t act,
                          double offset, bool prompt) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && attn.scalar_type() == at::kFloat && attn.dim() >= 1 &&
              attn.numel() == x.size(0) * x.size(1) * attn.size(-1),
              "kvgen: decoder_mlp takes x (B, T, hidden) and attn (B, T, features) float32");
  const int64_t R = x.size(0) * x.size(1), hidden = x.size(2);
  const MlpWeights w = mlp_weights(o, o_formats, post_attention, pre_feedforward, post_feedforward, gate_up,
                                   gate_up_formats, down, down_formats, act, attn.size(-1), hidden, eps, offset);
  const at::Tensor xc = x.contiguous(), ac = attn.contiguous();
  const at::Tensor scratch = mlp_scratch(mlp_scratch_floats(w, R)), out = at::empty(x.sizes(), x.options());
  decoder_mlp(w, xc.data_ptr<float>(), ac.data_ptr<float>(), R, scratch.data_ptr<float>(), out.data_ptr<float>(),
              prompt);
  return out;
}

// A registered decode stack, and every tensor its pointers read with the storage it had and where its data was: a
// tensor whose data is set anew (``param.data = ...``, ``module.to(...)``) keeps its object, so the stack must look
// at the data
struct Registered {
  Stack stack;
  std::vector<std::tuple<at::Tensor, c10::Storage, const void*>> held;

  void hold(const at::Tensor& t) { held.emplace_back(t, t.storage(), t.const_data_ptr()); }
  // whether a held tensor's data moved since registration (its old storage is kept alive: no dangling pointer)
  bool moved() const {
    for (const auto& [t, storage, data] : held)
      if (t.const_data_ptr() != data) return true;
    return false;
  }
};

std::mutex g_stacks_mutex;
std::unordered_map<int64_t, std::shared_ptr<const Registered>> g_stacks;
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
int64_t decoder_stack_op(at::ArrayRef<double> scales, at::ArrayRef<double> softcaps, at::TensorList input_norms,
                         const c10::List<c10::optional<at::Tensor>>& q_norms,
                         const c10::List<c10::optional<at::Tensor>>& k_norms, at::TensorList qkv,
                         at::IntArrayRef qkv_formats, at::IntArrayRef qkv_counts, at::TensorList o,
                         at::IntArrayRef o_formats, at::IntArrayRef o_counts,
                         const c10::List<c10::optional<at::Tensor>>& post_attention,
                         at::TensorList pre_feedforward, const c10::List<c10::optional<at::Tensor>>& post_feedforward,
                         at::TensorList gate_up, at::IntArrayRef gate_up_formats, at::IntArrayRef gate_up_counts,
                         at::TensorList down, at::IntArrayRef down_formats, at::IntArrayRef down_counts, int64_t H,
                         int64_t Hkv, double eps, double head_eps, double offset, int64_t act,
                         const c10::List<c10::optional<at::Tensor>>& qkv_biases) {
  const size_t L = input_norms.size();
  for (size_t n : {scales.size(), softcaps.size(), q_norms.size(), k_norms.size(), qkv_counts.size(), qkv_biases.size(),
                   o_counts.size(), post_attention.size(), pre_feedforward.size(), post_feedforward.size(),
                   gate_up_counts.size(), down_counts.size()})
    TORCH_CHECK(n == L, "kvgen: decoder_stack takes one entry per layer in every per-layer list (", L, " layers)");
  TORCH_CHECK(L > 0 && H > 0 && Hkv > 0 && H % Hkv == 0, "kvgen: decoder_stack takes at least one layer, and ",
              "query heads (", H, ") in groups of the key heads (", Hkv, ")");
  const std::vector<int64_t> qkv_first = firsts(qkv, qkv_formats, qkv_counts, "q/k/v"),
                             o_first = firsts(o, o_formats, o_counts, "o"),
                             gate_up_first = firsts(gate_up, gate_up_formats, gate_up_counts, "gate/up"),
                             down_first = firsts(down, down_formats, down_counts, "down");
  auto registered = std::make_shared<Registered>();
  Stack* const w = &registered->stack;
  const int64_t hidden = input_norms[0].numel();
  *w = Stack{{}, H, Hkv, 0, hidden, 0, eps, head_eps, offset};
  std::vector<at::Tensor> held;  // the products' tensors
  auto slice = [](auto list, const std::vector<int64_t>& first, size_t i) {
    return list.slice(first[i], first[i + 1] - first[i]);
  };
  auto floats = [&](const c10::optional<at::Tensor>& t, int64_t n, const char* what) -> const float* {  // held
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->numel() == n && t->is_contiguous() && t->scalar_type() == at::kFloat, "kvgen: decoder_stack's ",
                what, " holds ", n, " contiguous float32 values");
    registered->hold(*t);
    return t->data_ptr<float>();
  };
  for (size_t i = 0; i < L; ++i) {
    Product p = product_of(slice(qkv, qkv_first, i), slice(qkv_formats, qkv_first, i), hidden, &held);
    const int64_t D = p.N / (H + 2 * Hkv);
    TORCH_CHECK(D % 32 == 0 && D > 0 && p.N == (H + 2 * Hkv) * D && (i == 0 || D == w->D),
                "kvgen: decoder_stack's q/k/v products have (H + 2 Hkv) D rows, D the same multiple of 32 in every "
                "layer; layer ", i, " has ", p.N);
    w->D = D;
    const float* input = floats(input_norms[i], hidden, "input norm");
    const float* bias = floats(qkv_biases.get(i), p.N, "q/k/v bias");
    const float *qn = floats(q_norms.get(i), D, "query head norm"), *kn = floats(k_norms.get(i), D, "key head norm");
    MlpWeights mlp = mlp_weights(slice(o, o_first, i), slice(o_formats, o_first, i), post_attention.get(i),
                                 pre_feedforward[i], post_feedforward.get(i), slice(gate_up, gate_up_first, i),
                                 slice(gate_up_formats, gate_up_first, i), slice(down, down_first, i),
                                 slice(down_formats, down_first, i), act, H * D, hidden, eps, offset, &held);
    for (const c10::optional<at::Tensor>& t : {post_attention.get(i), c10::optional<at::Tensor>(pre_feedforward[i]),
                                               post_feedforward.get(i)})
      if (t.has_value()) registered->hold(*t);
    w->I = std::max(w->I, mlp.I);
    w->layers.push_back({input, qn, kn, bias, std::move(p), std::move(mlp), scales[i], softcaps[i]});
  }
  for (const at::Tensor& t : held) registered->hold(t);
  std::lock_guard<std::mutex> lock(g_stacks_mutex);
  g_stacks.emplace(g_next_stack, std::move(registered));
  return g_next_stack++;
}

// forgets a registered stack (its tensors are released once no step runs it)
void decoder_stack_free_op(int64_t id) {
  std::lock_guard<std::mutex> lock(g_stacks_mutex);
  g_stacks.erase(id);
}

// A whole decode step's layers as one op, so that the step pays one op call instead of a few Python
// calls per layer: for each layer i of registered stack `stack`, what decoder_attention_inputs_op
// computes (rotary tables cos[tables[i]], sin[tables[i]]), its new keys and values stored (as the
// buffers' dtype says: kv_format) in the last T of slots starts[i] .. ends[i] - 1 of keys[i] / values[i]
// (B, Hkv, slots, W: the cache's buffers, room already made for them), or where new_slots[i] (T,) says
// (B = 1: a paged pool's slots); attention of the queries over those slots with masks[i] (B
// or 1, 1, T, ends[i] - starts[i]); what decoder_mlp computes. The same functions as those ops, in
// the same order, so the two paths give the same bits; here on raw rows in one scratch allocation,
// with every check made before the first layer, and one attention plan for the layers that attend
// over as many slots without a mask (the ops' ATen calls, allocations and plans were ~25 us a layer,
// a sixth of a SmolLM2 step on 2 cores). Returns an empty tensor, having done nothing, where a registered
// tensor's data has moved since kvgen::decoder_stack (the caller registers the weights anew).
at::Tensor decoder_layers_op(const at::Tensor& x0, at::TensorList cos, at::TensorList sin, at::IntArrayRef tables,
                             at::TensorList keys, at::TensorList values, at::IntArrayRef starts, at::IntArrayRef ends,
                             const c10::List<c10::optional<at::Tensor>>& masks,
                             const c10::List<c10::optional<at::Tensor>>& new_slots, int64_t stack) {
  std::shared_ptr<const Registered> found;
  {
    std::lock_guard<std::mutex> lock(g_stacks_mutex);
    const auto it = g_stacks.find(stack);
    TORCH_CHECK(it != g_stacks.end(), "kvgen: decoder_layers: no registered stack ", stack,
                " (register the weights with kvgen::decoder_stack, and keep them until the last step)");
    found = it->second;
  }
  if (found->moved()) return at::empty({0}, x0.options());  // nothing done: the caller registers the weights anew
  const Stack& w = found->stack;
  const size_t L = w.layers.size();
  const int64_t H = w.H, Hkv = w.Hkv, D = w.D, hidden = w.hidden;
  for (size_t n : {tables.size(), keys.size(), values.size(), starts.size(), ends.size(), masks.size(),
                   new_slots.size()})
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
  std::vector<at::Tensor> ms(L), placed(L);
  std::vector<const uint8_t*> mps(L);  // each layer's mask (B or 1, T, slots), or null: every slot allowed
  for (size_t i = 0; i < L; ++i) {
    TORCH_CHECK(0 <= tables[i] && tables[i] < (int64_t)cos.size(), "kvgen: decoder_layers' layer ", i,
                " takes rotary table ", tables[i], " of ", cos.size());
    const KvFormat kv = kv_format(keys[i].scalar_type());
    const int64_t width = kv_row_width(kv, D);
    for (const at::Tensor* buffer : {&keys[i], &values[i]})
      TORCH_CHECK(buffer->dim() == 4 && buffer->scalar_type() == keys[i].scalar_type() && buffer->size(0) == B &&
                  buffer->size(1) == Hkv && buffer->size(3) == width && buffer->stride(3) == 1 && 0 <= starts[i] &&
                  starts[i] + T <= ends[i] && ends[i] <= buffer->size(2), "kvgen: decoder_layers' keys and values of ",
                  "layer ", i, " must be (B, Hkv, slots, ", width, ") buffers of one dtype with contiguous heads ",
                  "holding slots ", starts[i], " .. ", ends[i], " - 1, at least T = ", T, " of them");
    const c10::optional<at::Tensor> slots = new_slots.get(i);
    if (slots.has_value() && slots->defined()) {
      placed[i] = slots->contiguous();
      TORCH_CHECK(B == 1 && placed[i].scalar_type() == at::kLong && placed[i].dim() == 1 && placed[i].size(0) == T,
                  "kvgen: decoder_layers' new slots of layer ", i, " are one int64 slot per new token (", T,
                  "), of a batch of one row");
      const int64_t* slot = placed[i].data_ptr<int64_t>();
      for (int64_t t = 0; t < T; ++t)
        TORCH_CHECK(starts[i] <= slot[t] && slot[t] < ends[i], "kvgen: decoder_layers: layer ", i, "'s new slot ",
                    slot[t], " is outside the slots it attends to, ", starts[i], " .. ", ends[i], " - 1");
    }
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
  std::vector<const float*> cps, sps;
  for (size_t j = 0; j < cos.size(); ++j) {
    cps.push_back(cs[j].data_ptr<float>());
    sps.push_back(ss[j].data_ptr<float>());
  }
  std::vector<LayerSlots> slots;
  for (size_t i = 0; i < L; ++i) {
    const at::Tensor &k = keys[i], &v = values[i];
    slots.push_back({k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                     v.stride(2), starts[i], ends[i], mps[i], mps[i] ? ms[i].size(0) : 1, tables[i],
                     kv_format(k.scalar_type()), placed[i].defined() ? placed[i].data_ptr<int64_t>() : nullptr});
  }
  const int64_t threads = at::get_num_threads();
  at::Tensor scratch = at::empty({decoder_layers_scratch(w, R, threads)}, x0.options()),
             out = at::empty(x0.sizes(), x0.options());
  const at::Tensor xc = x0.contiguous();
  decoder_layers(w, xc.data_ptr<float>(), B, T, cps, sps, slots, threads, scratch.data_ptr<float>(),
                 out.data_ptr<float>());
  return out;
}

// logits (R, V) or (V,) float32, each row contiguous; allowed (R, W) or (W,) int32 words of bits, 32 W >= V
void mask_refused_op(at::Tensor& logits, const at::Tensor& allowed) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() >= 1 && logits.dim() <= 2 && logits.stride(-1) == 1,
              "kvgen: mask_refused_ takes float32 logits (rows, V) or (V,), each row contiguous");
  TORCH_CHECK(allowed.scalar_type() == at::kInt && allowed.dim() == logits.dim() && allowed.is_contiguous() &&
              (logits.dim() == 1 || allowed.size(0) == logits.size(0)),
              "kvgen: mask_refused_ takes a contiguous int32 bitmask with a row of words per row of logits");
  const int64_t V = logits.size(-1), W = allowed.size(-1), R = logits.dim() == 2 ? logits.size(0) : 1;
  TORCH_CHECK(W * 32 >= V, "kvgen: the bitmask's ", W, " words hold fewer than the ", V, " tokens of the logits");
  float* rows = logits.data_ptr<float>();
  const int64_t stride = logits.dim() == 2 ? logits.stride(0) : 0;
  const auto* words = reinterpret_cast<const uint32_t*>(allowed.const_data_ptr<int32_t>());
  for (int64_t r = 0; r < R; ++r) mask_refused(rows + r * stride, V, words + r * W);
}

// Mamba's selective scan over T tokens (ssm.h): state (B, D, N) before them, dt (after softplus) and x (B, T, D), A
// (D, N), B and C (B, T, N), float32 -> y (B, T, D) = C_t . h_t and the state after the last token (B, D, N)
std::tuple<at::Tensor, at::Tensor> selective_scan_op(const at::Tensor& state, const at::Tensor& dt, const at::Tensor& x,
                                                     const at::Tensor& A, const at::Tensor& B, const at::Tensor& C) {
  for (const at::Tensor* t : {&state, &dt, &x, &A, &B, &C})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "kvgen: selective_scan takes float32 tensors");
  TORCH_CHECK(dt.dim() == 3 && x.sizes() == dt.sizes(), "kvgen: selective_scan's dt and x are (batch, T, D) alike");
  const int64_t batch = dt.size(0), T = dt.size(1), D = dt.size(2);
  TORCH_CHECK(A.dim() == 2 && A.size(0) == D, "kvgen: selective_scan's A is (D, N), D = ", D);
  const int64_t N = A.size(1);
  TORCH_CHECK(state.dim() == 3 && state.size(0) == batch && state.size(1) == D && state.size(2) == N,
              "kvgen: selective_scan's state is (batch, D, N) = (", batch, ", ", D, ", ", N, ")");
  for (const at::Tensor* t : {&B, &C})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == batch && t->size(1) == T && t->size(2) == N,
                "kvgen: selective_scan's B and C are (batch, T, N) = (", batch, ", ", T, ", ", N, ")");
  at::Tensor h = state.clone(at::MemoryFormat::Contiguous), y = at::empty({batch, T, D}, dt.options());
  const at::Tensor dtc = dt.contiguous(), xc = x.contiguous(), Ac = A.contiguous(), Bc = B.contiguous(),
                   Cc = C.contiguous();
  selective_scan(h.data_ptr<float>(), dtc.data_ptr<float>(), xc.data_ptr<float>(), Ac.data_ptr<float>(),
                 Bc.data_ptr<float>(), Cc.data_ptr<float>(), batch, T, D, N, y.data_ptr<float>());
  return {y, h};
}

}  // namespace
}  // namespace kvgen

TORCH_LIBRARY(kvgen, m) {
  m.def("integer_dot_formats() -> int[]", kvgen::integer_dot_formats);
  m.def("tile_formats() -> int[]", kvgen::tile_formats);
  m.def("integer_dot_instruction() -> str", kvgen::integer_dot_instruction);
  m.def("panel_rows(int format=0) -> int", kvgen::panel_rows);
  m.def("qmatmul(Tensor x, Tensor[] ws, int[] formats, bool prompt=False) -> Tensor");
  m.def("dequantize_(Tensor(a!) out, Tensor w, int format) -> ()");
  m.def("tile_rows_(Tensor(a!) out, Tensor rows, int format) -> ()");
  m.def("tile_quads(int format) -> int[]", kvgen::tile_quads);
  m.def("embedding(Tensor w, Tensor ids, int k, int format) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset=0.0) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float softcap) -> Tensor");
  m.def("decoder_attention_inputs(Tensor x, Tensor norm, float eps, Tensor[] ws, int[] formats, Tensor cos, "
        "Tensor sin, int heads, int kv_heads, Tensor? q_norm, Tensor? k_norm, float head_eps, float offset, "
        "Tensor? bias=None, bool prompt=False) -> Tensor[]");
  m.def("decoder_mlp(Tensor x, Tensor attn, Tensor[] o, int[] o_formats, Tensor? post_attention, "
        "Tensor pre_feedforward, Tensor? post_feedforward, float eps, Tensor[] gate_up, int[] gate_up_formats, "
        "Tensor[] down, int[] down_formats, int act, float offset, bool prompt=False) -> Tensor");
  m.def("gated_activation(Tensor gate_up, int act) -> Tensor");
  m.def("mask_refused_(Tensor(a!) logits, Tensor allowed) -> ()");
  m.def("kv_store_(Tensor(a!) buffer, Tensor index, Tensor x) -> ()");
  m.def("selective_scan(Tensor state, Tensor dt, Tensor x, Tensor A, Tensor B, Tensor C) -> (Tensor, Tensor)");
  m.def("decoder_stack(float[] scales, float[] softcaps, Tensor[] input_norms, Tensor?[] q_norms, "
        "Tensor?[] k_norms, Tensor[] qkv, int[] qkv_formats, int[] qkv_counts, Tensor[] o, int[] o_formats, "
        "int[] o_counts, Tensor?[] post_attention, Tensor[] pre_feedforward, Tensor?[] post_feedforward, "
        "Tensor[] gate_up, int[] gate_up_formats, int[] gate_up_counts, Tensor[] down, int[] down_formats, "
        "int[] down_counts, int heads, int kv_heads, float eps, float head_eps, float offset, int act, "
        "Tensor?[] qkv_biases) -> int",
        kvgen::decoder_stack_op);
  m.def("decoder_stack_free(int stack) -> ()", kvgen::decoder_stack_free_op);
  m.def("decoder_layers(Tensor x, Tensor[] cos, Tensor[] sin, int[] tables, Tensor[] keys, Tensor[] values, "
        "int[] starts, int[] ends, Tensor?[] masks, Tensor?[] new_slots, int stack) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvgen, CPU, m) {
  m.impl("qmatmul", kvgen::qmatmul_op);
  m.impl("dequantize_", kvgen::dequantize_op);
  m.impl("tile_rows_", kvgen::tile_rows_op);
  m.impl("embedding", kvgen::embedding_op);
  m.impl("rms_norm", kvgen::rms_norm_op);
  m.impl("attention", kvgen::attention_op);
  m.impl("decoder_attention_inputs", kvgen::decoder_attention_inputs_op);
  m.impl("decoder_mlp", kvgen::decoder_mlp_op);
  m.impl("decoder_layers", kvgen::decoder_layers_op);
  m.impl("gated_activation", kvgen::gated_activation_op);
  m.impl("mask_refused_", kvgen::mask_refused_op);
  m.impl("kv_store_", kvgen::kv_store_op);
  m.impl("selective_scan", kvgen::selective_scan_op);
}
