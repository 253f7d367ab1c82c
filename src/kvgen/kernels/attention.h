// Attention over dense and paged keys and values (attention.cpp): a plan of the work, worked out from the shapes
// and the mask before any key is read, then the plan's items on the pool's threads.
//
// Example (ops.cpp's kvgen::attention): q (B, H, T, D), k and v (B, Hkv, S, D), out (B, T, H, D)
//     const AttentionPlan plan = plan_attention(B, T, Hkv, H / Hkv, S, mask, mask_rows);
//     attend(plan, AttentionArgs{q, k, v, <their strides>, mask, T, S, H, H / Hkv, D, scale, softcap, out});
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "kv_rows.h"

namespace kvgen {

constexpr int64_t TILE = 16;  // keys a tile: the mask's, the plan's and the kernels' unit

// consecutive query positions t0 .. t0 + n - 1 of mask row-set mrow, and the tiles any of them
// allows: 2 * tile + (1 where every key of the tile is allowed for every one of them)
struct RowBlock {
  int64_t mrow, t0, n;
  std::vector<int32_t> tiles;
};

struct AttentionArgs {
  const float* q;
  const void *k, *v;                           // stored as kv says (kv_rows.h); read a 16-key tile at a time
  int64_t q0, q1, q2, k0, k1, k2, v0, v1, v2;  // strides of batch, head, position (k, v: in stored elements)
  const uint8_t* mask;                         // (MB, T, S) or null: all allowed
  int64_t T, S, H, G, D;
  float scale, cap;
  float* out;  // (B, T, H, D)
  KvFormat kv = KvFormat::F32;
};

// a few query rows' scores are taken CHUNK tiles at a time: one softmax pass (max, exp, rescaling of
// the values so far) per 64 keys instead of per 16
constexpr int64_t CHUNK = 4;

// one thread's buffers for row blocks of at most `rows` (padded) query rows; left uninitialised
struct Scratch {
  std::unique_ptr<float[]> buffer;
  float *qt, *sc, *m, *l, *alpha, *acc, *ktail, *vtail;
  Scratch(int64_t rows, int64_t D) : buffer(new float[rows * (2 * D + CHUNK * TILE + 3) + 2 * TILE * D]) {
    qt = buffer.get(), sc = qt + rows * D, m = sc + CHUNK * TILE * rows, l = m + rows, alpha = l + rows,
    acc = alpha + rows;
    ktail = acc + rows * D, vtail = ktail + TILE * D;
  }
};

// The work of one attention call, worked out before any key is read: which tiles each block of
// query rows attends to, and the items (a key head of a row block, over a range of its tiles)
// handed to the threads. It depends on the shapes, the mask and the thread count only, so a decode
// step's layers that attend over as many keys without a mask share one.
struct AttentionPlan {
  struct Item {
    int64_t b, g, blk, c0, c1, split, part, cost;
  };
  struct Split {
    int64_t b, g, blk, part0, parts;
  };
  std::vector<RowBlock> blocks;
  std::vector<Item> items;
  std::vector<Split> splits;
  std::vector<int64_t> order;  // items, costliest first
  int64_t nparts = 0, RMAX = 0, threads = 0;  // RMAX: query rows of the largest row block, padded
};

// B batch rows of T query positions, H heads in Hkv groups of G, S keys; mp: bool (MB, T, S) or null
AttentionPlan plan_attention(int64_t B, int64_t T, int64_t Hkv, int64_t G, int64_t S, const uint8_t* mp,
                             int64_t MB);

// Attention calls as planned, one at a time (start), into args.out (B, T, H, D): the threads take the items
// costliest first (work), and the last part of a split item to finish merges them. Its buffers are sized once for
// the plans it takes (a decode stack's layers: an allocation a layer was ~2 us of its first thread's time).
class AttentionRun {
 public:
  // for the plans first .. last - 1, of heads of D values
  AttentionRun(const AttentionPlan* first, const AttentionPlan* last, int64_t D) {
    size_t parts = 0, splits = 0;
    for (const AttentionPlan* plan = first; plan != last; ++plan) {
      parts = std::max<size_t>(parts, plan->nparts * plan->RMAX * (D + 2));
      splits = std::max(splits, plan->splits.size());
    }
    parts_.resize(parts);
    pending_.reset(new std::atomic<int64_t>[splits]);
  }

  // the next call (before any thread works on it)
  void start(const AttentionPlan& plan, const AttentionArgs& args) {
    plan_ = &plan, args_ = args, slot_ = plan.RMAX * (args.D + 2);
    next_.store(0, std::memory_order_relaxed);
    for (size_t i = 0; i < plan.splits.size(); ++i) pending_[i].store(plan.splits[i].parts, std::memory_order_relaxed);
  }

  // items until none is left (w: this thread's scratch, for plan.RMAX rows)
  void work(Scratch& w);

 private:
  // a split item's partial states (max, sum, values per query row) merged into the output
  void merge(const AttentionPlan::Split& sp, float* acc);

  const AttentionPlan* plan_ = nullptr;
  AttentionArgs args_{};
  int64_t slot_ = 0;
  std::vector<float> parts_;
  std::unique_ptr<std::atomic<int64_t>[]> pending_;
  std::atomic<int64_t> next_{0};
};

// attends as planned, into args.out (B, T, H, D), in one parallel region (each region can wait a time
// slice for a thread on a busy host)
void attend(const AttentionPlan& plan, const AttentionArgs& args);

}  // namespace kvgen
