// Fused table-batched embedding on CPU: pooled lookup, and a backward that applies the optimizer
// to the touched rows directly (no embedding gradient is materialised).
//
// Both walk the bags sample-major (sample b, then feature f), so that the [B, total_D] output and
// gradient are written / read in memory order, and prefetch the rows a few ids ahead (rows are
// scattered over hundreds of MB: the kernels are bound by memory latency, not arithmetic).
// Backward, in two steps:
//   1. per table, hash the ids to find the rows named more than once (chained in position order);
//   2. update every touched row once: a row named once from its one gradient row, a repeated row
//      from its gradient summed over its ids in position order (so that the result does not depend
//      on the number of threads), at its first id.
// Schemas are in ops.cpp; layout of the arguments is described there.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "check_message.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
// An asm statement, not __builtin_prefetch: GCC 12 dropped the builtin from the update loop.
#define LR_PREFETCH(p) asm volatile("prefetcht0 %0" : : "m"(*reinterpret_cast<const char*>(p)))
#else
#define LR_PREFETCH(p) __builtin_prefetch(p)
#endif
#ifdef LR_PROFILE
#include <chrono>
#include <cstdio>
#define LR_TICK(name) do { auto _n = std::chrono::steady_clock::now(); std::fprintf(stderr, "%s %.3f ms\n", name, std::chrono::duration<double, std::milli>(_n - _t0).count()); _t0 = _n; } while (0)
#define LR_T0 auto _t0 = std::chrono::steady_clock::now()
#else
#define LR_TICK(name)
#define LR_T0
#endif

namespace lightning_rec {
namespace {

enum Optimizer : int64_t { kSGD = 0, kAdagrad = 1, kRowwiseAdagrad = 2, kAdam = 3, kPartialRowwiseAdam = 4 };

// Everything the kernels read about the table/feature layout, as raw pointers.
struct Layout {
  const int64_t* weights_offsets;
  const int64_t* row_offsets;
  const int64_t* table_dims;
  const int64_t* feature_table;
  const int64_t* D_offsets;
  const int64_t* indices;
  const int64_t* offsets;
  const float* per_sample_weights;  // nullptr when unweighted
  int64_t T, F, B, N, total_D, max_D;
  bool mean;
};

void check_meta(const at::Tensor& t, const char* name) {
  LR_CHECK(t.device().is_cpu(), "lightning_rec: ", name, " must be on CPU");
  LR_CHECK(t.scalar_type() == at::kLong, "lightning_rec: ", name, " must be int64, got ", t.scalar_type());
  LR_CHECK(t.dim() == 1 && t.is_contiguous(), "lightning_rec: ", name, " must be 1-D and contiguous");
}

// Validates the batch (dtypes, offsets, ids) and fills a Layout. Every check happens here, before
// any output or weight is written, so a bad batch changes nothing.
Layout make_layout(
    const at::Tensor& weights_offsets,
    const at::Tensor& row_offsets,
    const at::Tensor& table_dims,
    const at::Tensor& feature_table,
    const at::Tensor& D_offsets,
    const at::Tensor& indices,
    const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights,
    int64_t pooling_mode) {
  check_meta(weights_offsets, "weights_offsets");
  check_meta(row_offsets, "row_offsets");
  check_meta(table_dims, "table_dims");
  check_meta(feature_table, "feature_table");
  check_meta(D_offsets, "D_offsets");
  check_meta(indices, "indices");
  check_meta(offsets, "offsets");
  LR_CHECK_VALUE(pooling_mode == 0 || pooling_mode == 1, "lightning_rec: pooling_mode must be 0 (sum) or 1 (mean)");
  Layout L{};
  L.T = table_dims.numel();
  L.F = feature_table.numel();
  LR_CHECK(weights_offsets.numel() == L.T && row_offsets.numel() == L.T + 1, "lightning_rec: table metadata sizes disagree");
  LR_CHECK(D_offsets.numel() == L.F + 1 && L.F > 0, "lightning_rec: feature metadata sizes disagree");
  L.weights_offsets = weights_offsets.data_ptr<int64_t>();
  L.row_offsets = row_offsets.data_ptr<int64_t>();
  L.table_dims = table_dims.data_ptr<int64_t>();
  L.feature_table = feature_table.data_ptr<int64_t>();
  L.D_offsets = D_offsets.data_ptr<int64_t>();
  L.indices = indices.data_ptr<int64_t>();
  L.offsets = offsets.data_ptr<int64_t>();
  L.N = indices.numel();
  L.total_D = L.D_offsets[L.F];
  L.max_D = 0;
  for (int64_t t = 0; t < L.T; ++t) L.max_D = std::max(L.max_D, L.table_dims[t]);
  L.mean = pooling_mode == 1;
  for (int64_t f = 0; f < L.F; ++f) {
    LR_CHECK(L.feature_table[f] >= 0 && L.feature_table[f] < L.T, "lightning_rec: feature_table[", f, "] out of range");
    LR_CHECK(L.D_offsets[f + 1] - L.D_offsets[f] == L.table_dims[L.feature_table[f]], "lightning_rec: D_offsets disagree with table_dims");
  }
  LR_CHECK(L.row_offsets[L.T] < (int64_t(1) << 31) && L.N < (int64_t(1) << 31),
           "lightning_rec: more than 2^31 rows or ids in one TBE");

  const int64_t n_off = offsets.numel();
  LR_CHECK_VALUE(n_off >= 1 && (n_off - 1) % L.F == 0, "lightning_rec: offsets has ", n_off,
                 " entries; expected F * B + 1 with F = ", L.F, " features");
  L.B = (n_off - 1) / L.F;
  LR_CHECK_VALUE(L.offsets[0] == 0 && L.offsets[n_off - 1] == L.N, "lightning_rec: offsets must start at 0 and end at the number of ids (",
                 L.N, "), got ", L.offsets[0], " and ", L.offsets[n_off - 1]);
  std::atomic<int64_t> bad_bag{std::numeric_limits<int64_t>::max()};
  at::parallel_for(0, n_off - 1, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      if (L.offsets[j + 1] < L.offsets[j]) {
        int64_t cur = bad_bag.load();
        while (j < cur && !bad_bag.compare_exchange_weak(cur, j)) {}
        return;
      }
    }
  });
  if (bad_bag.load() != std::numeric_limits<int64_t>::max()) {
    const int64_t j = bad_bag.load();
    LR_CHECK_VALUE(false, "lightning_rec: offsets must be non-decreasing, but offsets[", j + 1, "] = ", L.offsets[j + 1],
                   " < offsets[", j, "] = ", L.offsets[j], " (feature #", j / std::max<int64_t>(L.B, 1), ")");
  }

  L.per_sample_weights = nullptr;
  if (per_sample_weights.has_value()) {
    const auto& w = *per_sample_weights;
    LR_CHECK_VALUE(w.scalar_type() == at::kFloat && w.dim() == 1 && w.is_contiguous(),
                   "lightning_rec: per_sample_weights must be a contiguous 1-D float32 tensor");
    LR_CHECK_VALUE(w.numel() == L.N, "lightning_rec: per_sample_weights has ", w.numel(), " entries but there are ", L.N, " ids");
    L.per_sample_weights = w.data_ptr<float>();
  }

  // Ids: the smallest bad position is reported, so the message does not depend on threads.
  std::atomic<int64_t> bad_pos{std::numeric_limits<int64_t>::max()};
  at::parallel_for(0, L.F, 1, [&](int64_t fb, int64_t fe) {
    for (int64_t f = fb; f < fe; ++f) {
      const int64_t t = L.feature_table[f];
      const int64_t rows = L.row_offsets[t + 1] - L.row_offsets[t];
      const int64_t pb = L.offsets[f * L.B], pe = L.offsets[(f + 1) * L.B];
      bool bad = false;
      for (int64_t p = pb; p < pe; ++p) bad |= static_cast<uint64_t>(L.indices[p]) >= static_cast<uint64_t>(rows);
      if (!bad) continue;
      for (int64_t p = pb; p < pe; ++p) {
        if (static_cast<uint64_t>(L.indices[p]) >= static_cast<uint64_t>(rows)) {
          int64_t cur = bad_pos.load();
          while (p < cur && !bad_pos.compare_exchange_weak(cur, p)) {}
          break;
        }
      }
    }
  });
  if (bad_pos.load() != std::numeric_limits<int64_t>::max()) {
    const int64_t p = bad_pos.load();
    const int64_t bag = std::upper_bound(L.offsets, L.offsets + n_off, p) - L.offsets - 1;
    const int64_t f = bag / L.B;
    const int64_t t = L.feature_table[f];
    LR_CHECK_VALUE(false, "lightning_rec: id ", L.indices[p], " at position ", p, " (feature #", f, ", sample ", bag % L.B,
                   ") is out of range for table #", t, " with ", L.row_offsets[t + 1] - L.row_offsets[t], " rows");
  }
  return L;
}

inline float load(float v) { return v; }
inline float load(at::Half v) { return static_cast<float>(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(at::Half* p, float v) { *p = static_cast<at::Half>(v); }

// 16 floats as one value. GCC lowers the lane-wise arithmetic to whatever vector ISA the build
// targets (one AVX-512 register, two AVX2 ones, ...) with the same result in every lane, so the
// reductions below give the same bits on every x86 build.
typedef float v16f __attribute__((vector_size(64)));
inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

// sum_d g[d]^2 in a fixed order: 16 lane sums over d (d mod 16), then a fixed tree. Vectorised
// when D is a multiple of 16; a plain left-to-right sum otherwise.
inline float sum_squares(const float* __restrict__ g, int64_t D) {
  if (D % 16 != 0) {
    float s = 0.0f;
    for (int64_t d = 0; d < D; ++d) s += g[d] * g[d];
    return s;
  }
  v16f acc = {};
  for (int64_t d = 0; d < D; d += 16) {
    const v16f x = load16(g + d);
    acc += x * x;
  }
  float l[16];
  std::memcpy(l, &acc, sizeof(l));
  for (int w = 8; w >= 1; w /= 2)
    for (int k = 0; k < w; ++k) l[k] += l[k + w];
  return l[0];
}

// o = w * row for the first id of a bag, o += w * row for the others (as floats).
template <typename scalar_t>
inline void add_row(float* __restrict__ o, const scalar_t* __restrict__ row, int64_t D, float w, bool first) {
  if (first) {
    if (w == 1.0f) {
      for (int64_t d = 0; d < D; ++d) o[d] = load(row[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) o[d] = w * load(row[d]);
    }
  } else if (w == 1.0f) {
    for (int64_t d = 0; d < D; ++d) o[d] += load(row[d]);
  } else {
    for (int64_t d = 0; d < D; ++d) o[d] += w * load(row[d]);
  }
}

template <typename scalar_t>
inline void prefetch_row(const scalar_t* r, int64_t D) {
  const char* c = reinterpret_cast<const char*>(r);
  for (int64_t i = 0; i < D * static_cast<int64_t>(sizeof(scalar_t)); i += 64) LR_PREFETCH(c + i);
}

// Walks the ids of samples [b, b_end) sample-major: sample b, then feature f, then the ids of bag
// (f, b) in order; empty bags are skipped. Visiting bags sample-major writes (forward) and reads
// (backward) the [B, total_D] output / gradient in memory order.
struct IdCursor {
  const Layout& L;
  int64_t b, b_end, f, p, pe;
  IdCursor(const Layout& layout, int64_t b_begin, int64_t b_stop) : L(layout), b(b_begin), b_end(b_stop), f(-1), p(0), pe(0) {
    next_bag();
  }
  bool valid() const { return b < b_end; }
  void next_bag() {
    while (b < b_end) {
      if (++f == L.F) {
        f = 0;
        if (++b >= b_end) return;
      }
      const int64_t j = f * L.B + b;
      p = L.offsets[j];
      pe = L.offsets[j + 1];
      if (p < pe) return;
    }
  }
  void advance() {
    if (++p == pe) next_bag();
  }
};

// How far ahead (in ids) the rows are prefetched: enough misses in flight to hide DRAM latency.
constexpr int kAheadIds = 8;

template <typename scalar_t>
void forward_kernel(const scalar_t* W, const Layout& L, float* out) {
  // Samples are split into one contiguous chunk per thread; every bag is summed by one thread in
  // position order, so the output does not depend on the number of threads.
  at::parallel_for(0, L.B, 16, [&](int64_t b_begin, int64_t b_end) {
    IdCursor ahead(L, b_begin, b_end);
    auto prefetch_next = [&]() {
      if (!ahead.valid()) return;
      const int64_t t = L.feature_table[ahead.f];
      const int64_t D = L.table_dims[t];
      prefetch_row(W + L.weights_offsets[t] + L.indices[ahead.p] * D, D);
      ahead.advance();
    };
    for (int i = 0; i < kAheadIds; ++i) prefetch_next();
    for (int64_t b = b_begin; b < b_end; ++b) {
      float* orow = out + b * L.total_D;
      for (int64_t f = 0; f < L.F; ++f) {
        const int64_t t = L.feature_table[f];
        const int64_t D = L.table_dims[t];
        const scalar_t* table = W + L.weights_offsets[t];
        float* __restrict__ o = orow + L.D_offsets[f];
        const int64_t j = f * L.B + b, pb = L.offsets[j], pe = L.offsets[j + 1];
        if (pb == pe) {
          std::memset(o, 0, sizeof(float) * D);
          continue;
        }
        for (int64_t p = pb; p < pe; ++p) {
          prefetch_next();
          add_row(o, table + L.indices[p] * D, D, L.per_sample_weights ? L.per_sample_weights[p] : 1.0f, p == pb);
        }
        if (L.mean) {
          const float s = 1.0f / static_cast<float>(pe - pb);
          for (int64_t d = 0; d < D; ++d) o[d] *= s;
        }
      }
    }
  });
}

struct OptimArgs {
  int64_t optimizer;
  float lr, eps, beta1, beta2, weight_decay;
  float bias_correction1, bias_correction2_sqrt;  // Adam
};

// One row's update. g holds the row's summed gradient (D floats) and may be overwritten.
template <typename scalar_t>
inline void update_row(scalar_t* __restrict__ w, float* __restrict__ g, float* __restrict__ m1, float* __restrict__ m2,
                       int64_t D, const OptimArgs& a) {
  const float lr = a.lr, eps = a.eps, wd = a.weight_decay;
  if (wd != 0.0f) {
    // L2 weight decay, as torch.optim defines it: the gradient gains wd * w.
    for (int64_t d = 0; d < D; ++d) g[d] += wd * load(w[d]);
  }
  switch (a.optimizer) {
    case kSGD:
      for (int64_t d = 0; d < D; ++d) store(w + d, load(w[d]) - lr * g[d]);
      break;
    case kAdagrad:
      for (int64_t d = 0; d < D; ++d) {
        const float s = m1[d] + g[d] * g[d];
        m1[d] = s;
        store(w + d, load(w[d]) - lr * g[d] / (std::sqrt(s) + eps));
      }
      break;
    case kRowwiseAdagrad: {
      const float s = *m1 + sum_squares(g, D) / static_cast<float>(D);
      *m1 = s;
      const float mult = lr / (std::sqrt(s) + eps);
      for (int64_t d = 0; d < D; ++d) store(w + d, load(w[d]) - mult * g[d]);
      break;
    }
    case kAdam: {
      const float b1 = a.beta1, b2 = a.beta2, step = lr / a.bias_correction1, bc2 = a.bias_correction2_sqrt;
      for (int64_t d = 0; d < D; ++d) {
        const float m = b1 * m1[d] + (1.0f - b1) * g[d];
        const float v = b2 * m2[d] + (1.0f - b2) * g[d] * g[d];
        m1[d] = m;
        m2[d] = v;
        store(w + d, load(w[d]) - step * m / (std::sqrt(v) / bc2 + eps));
      }
      break;
    }
    case kPartialRowwiseAdam: {
      const float b1 = a.beta1, b2 = a.beta2, step = lr / a.bias_correction1;
      const float v = b2 * *m2 + (1.0f - b2) * sum_squares(g, D) / static_cast<float>(D);
      *m2 = v;
      const float denom = std::sqrt(v) / a.bias_correction2_sqrt + eps;
      const float mult = step / denom;
      for (int64_t d = 0; d < D; ++d) {
        const float m = b1 * m1[d] + (1.0f - b1) * g[d];
        m1[d] = m;
        store(w + d, load(w[d]) - mult * m);
      }
      break;
    }
    default:
      break;
  }
}

// The [B, total_D] gradient of the output, read through its strides.
struct GradView {
  const float* data;
  int64_t row_stride, col_stride;
  const float* row(int64_t b) const { return data + b * row_stride; }
};

// What the update needs to know about each id: is its row named by no other id of the batch, or
// is it the first (in position order) / a later id of a repeated row.
enum IdRole : uint8_t { kOnly = 0, kFirst = 1, kRepeat = 2 };

// Finds the repeated rows of each table with a hash of the table's ids, visited in position order.
// role[p] as above; for a repeated row, next[] chains its ids from the first on, in position order
// (-1 ends the chain); bag_of[p] is the bag of every id p. Parallel over tables.
void find_repeats(const Layout& L, uint8_t* role, int32_t* next, int32_t* bag_of) {
  // Features of each table, in feature order (a stable counting sort; F is small).
  std::vector<int64_t> first_feature(L.T + 1, 0), features(L.F);
  for (int64_t f = 0; f < L.F; ++f) ++first_feature[L.feature_table[f] + 1];
  for (int64_t t = 0; t < L.T; ++t) first_feature[t + 1] += first_feature[t];
  {
    std::vector<int64_t> fill(first_feature.begin(), first_feature.end() - 1);
    for (int64_t f = 0; f < L.F; ++f) features[fill[L.feature_table[f]]++] = f;
  }
  at::parallel_for(0, L.T, 1, [&](int64_t t_begin, int64_t t_end) {
    struct Slot {
      int32_t row, last;  // row (-1: empty) and the latest id that named it
    };
    thread_local std::vector<Slot> slots;  // kept between calls: no allocation (nor page faults) a step
    for (int64_t t = t_begin; t < t_end; ++t) {
      int64_t n = 0;
      for (int64_t k = first_feature[t]; k < first_feature[t + 1]; ++k) {
        const int64_t f = features[k];
        n += L.offsets[(f + 1) * L.B] - L.offsets[f * L.B];
      }
      if (n == 0) continue;
      int bits = 4;
      while ((int64_t(1) << bits) < 2 * n) ++bits;
      const uint32_t mask = (uint32_t(1) << bits) - 1;
      slots.assign(size_t(1) << bits, Slot{-1, -1});
      for (int64_t k = first_feature[t]; k < first_feature[t + 1]; ++k) {
        const int64_t f = features[k];
        for (int64_t j = f * L.B; j < (f + 1) * L.B; ++j) {
          for (int64_t p = L.offsets[j], pe = L.offsets[j + 1]; p < pe; ++p) {
            bag_of[p] = static_cast<int32_t>(j);
            const int32_t row = static_cast<int32_t>(L.indices[p]);
            uint32_t h = (static_cast<uint32_t>(row) * 0x9E3779B1u) >> (32 - bits);
            while (slots[h].row != row && slots[h].row != -1) h = (h + 1) & mask;
            Slot& s = slots[h];
            if (s.row == -1) {
              s = Slot{row, static_cast<int32_t>(p)};
              role[p] = kOnly;
            } else {
              if (role[s.last] == kOnly) role[s.last] = kFirst;
              next[s.last] = static_cast<int32_t>(p);
              next[p] = -1;
              role[p] = kRepeat;
              s.last = static_cast<int32_t>(p);
            }
          }
        }
      }
    }
  });
}

// Backward with the fused update. Every touched row is updated once, by the thread that owns the
// sample of its first id, with its gradient summed over its ids in position order: the result does
// not depend on the number of threads.
//   1. find the rows named more than once (per table, hashed);
//   2. walk the ids sample-major (the gradient is read in memory order); a row named once is
//      updated from its one gradient row, a repeated row from the sum over its chain, at its first id.
template <typename scalar_t>
void backward_update_kernel(scalar_t* W, float* M1, float* M2, const Layout& L, const GradView& grad, const OptimArgs& a) {
  const int64_t N = L.N;
  if (N == 0) return;
  LR_T0;
  // Scratch kept by the calling thread between calls (grown, never shrunk): a fresh ~10 bytes per id
  // a step would be mmapped and faulted in again each time.
  thread_local std::vector<uint8_t> role_buf;
  thread_local std::vector<int32_t> next_buf, bag_buf;
  if (role_buf.size() < static_cast<size_t>(N)) {
    role_buf.resize(N);
    next_buf.resize(N);
    bag_buf.resize(N);
  }
  uint8_t* const role = role_buf.data();
  int32_t* const next = next_buf.data();
  int32_t* const bag_of = bag_buf.data();
  find_repeats(L, role, next, bag_of);
  LR_TICK("repeats");

  const bool rowwise_m1 = a.optimizer == kRowwiseAdagrad;
  const bool elem_m1 = a.optimizer == kAdagrad || a.optimizer == kAdam || a.optimizer == kPartialRowwiseAdam;
  const bool elem_m2 = a.optimizer == kAdam;
  const bool rowwise_m2 = a.optimizer == kPartialRowwiseAdam;
  at::parallel_for(0, L.B, 16, [&](int64_t b_begin, int64_t b_end) {
    thread_local std::vector<float> gbuf;
    if (gbuf.size() < static_cast<size_t>(L.max_D)) gbuf.resize(L.max_D);
    float* __restrict__ g = gbuf.data();
    IdCursor ahead(L, b_begin, b_end);
    // Rows are scattered over hundreds of MB: fetch the row (all its cache lines) and its state
    // kAheadIds ids ahead, so that the misses overlap.
    auto prefetch_next = [&]() {
      if (!ahead.valid()) return;
      const int64_t t = L.feature_table[ahead.f];
      const int64_t D = L.table_dims[t];
      const int64_t row = L.indices[ahead.p];
      const int64_t woff = L.weights_offsets[t] + row * D;
      prefetch_row(W + woff, D);
      if (rowwise_m1) LR_PREFETCH(M1 + L.row_offsets[t] + row);
      if (elem_m1) prefetch_row(M1 + woff, D);
      if (elem_m2) prefetch_row(M2 + woff, D);
      if (rowwise_m2) LR_PREFETCH(M2 + L.row_offsets[t] + row);
      ahead.advance();
    };
    auto scale_of = [&](int64_t p, int64_t j) {
      float scale = L.per_sample_weights ? L.per_sample_weights[p] : 1.0f;
      if (L.mean) scale /= static_cast<float>(L.offsets[j + 1] - L.offsets[j]);
      return scale;
    };
    for (int i = 0; i < kAheadIds; ++i) prefetch_next();
    for (int64_t b = b_begin; b < b_end; ++b) {
      for (int64_t f = 0; f < L.F; ++f) {
        const int64_t t = L.feature_table[f];
        const int64_t D = L.table_dims[t];
        const int64_t j = f * L.B + b;
        for (int64_t p = L.offsets[j], pe = L.offsets[j + 1]; p < pe; ++p) {
          prefetch_next();
          const uint8_t r = role[p];
          if (r == kRepeat) continue;
          if (r == kOnly) {
            const float scale = scale_of(p, j);
            const float* __restrict__ go = grad.row(b) + L.D_offsets[f] * grad.col_stride;
            if (grad.col_stride == 1) {
              for (int64_t d = 0; d < D; ++d) g[d] = scale * go[d];
            } else {
              for (int64_t d = 0; d < D; ++d) g[d] = scale * go[d * grad.col_stride];
            }
          } else {
            std::memset(g, 0, sizeof(float) * D);
            for (int64_t q = p; q != -1; q = next[q]) {
              const int64_t jq = bag_of[q];
              const int64_t fq = jq / L.B, bq = jq - fq * L.B;
              const float scale = scale_of(q, jq);
              const float* __restrict__ go = grad.row(bq) + L.D_offsets[fq] * grad.col_stride;
              for (int64_t d = 0; d < D; ++d) g[d] += scale * go[d * grad.col_stride];
            }
          }
          const int64_t row = L.indices[p];
          const int64_t woff = L.weights_offsets[t] + row * D;
          const int64_t roff = L.row_offsets[t] + row;
          float* m1 = nullptr;
          float* m2 = nullptr;
          switch (a.optimizer) {
            case kAdagrad: m1 = M1 + woff; break;
            case kRowwiseAdagrad: m1 = M1 + roff; break;
            case kAdam: m1 = M1 + woff; m2 = M2 + woff; break;
            case kPartialRowwiseAdam: m1 = M1 + woff; m2 = M2 + roff; break;
            default: break;
          }
          update_row<scalar_t>(W + woff, g, m1, m2, D, a);
        }
      }
    }
  });
  LR_TICK("update");
}

void check_weights(const at::Tensor& weights, const Layout& L) {
  LR_CHECK(weights.device().is_cpu() && weights.dim() == 1 && weights.is_contiguous(),
           "lightning_rec: weights must be a contiguous 1-D CPU tensor");
  LR_CHECK(weights.scalar_type() == at::kFloat || weights.scalar_type() == at::kHalf,
           "lightning_rec: weights must be float32 or float16, got ", weights.scalar_type());
  int64_t need = 0;
  for (int64_t t = 0; t < L.T; ++t)
    need = std::max(need, L.weights_offsets[t] + (L.row_offsets[t + 1] - L.row_offsets[t]) * L.table_dims[t]);
  LR_CHECK(weights.numel() >= need, "lightning_rec: weights has ", weights.numel(), " elements, layout needs ", need);
}

// The forward output ([B, total_D] floats, 13.6 MB for 26 features x D 64 x B 2048) comes from a
// small per-thread pool of buffers, each reused once no tensor or view uses it any more. Freshly
// allocated, a buffer that size is mmapped by malloc and faults in page by page on every step
// (500-2000 page faults, 1-2 ms a step here, and much of the run-to-run variance). Every element
// of the output is written by the forward, so a reused buffer needs no clearing. The pool holds
// at most kOutputPool buffers (the least recently used one goes first), so its memory is bounded
// by the outputs a step keeps alive anyway.
constexpr size_t kOutputPool = 8;

at::Tensor pooled_output(int64_t B, int64_t total_D) {
  thread_local std::vector<c10::Storage> pool;  // least recently used first
  const size_t nbytes = static_cast<size_t>(B) * static_cast<size_t>(total_D) * sizeof(float);
  const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  c10::Storage storage;
  for (size_t i = pool.size(); i-- > 0;) {
    // use_count() == 1: only the pool holds the buffer, so no tensor can see it (counts only go
    // down while nothing else holds it).
    if (pool[i].nbytes() == nbytes && pool[i].use_count() == 1) {
      storage = std::move(pool[i]);
      pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  }
  if (!storage) {
    if (nbytes < (size_t(1) << 20)) return at::empty({B, total_D}, options);  // small: malloc reuses it
    storage = at::empty({static_cast<int64_t>(nbytes / sizeof(float))}, options).storage();
    if (pool.size() >= kOutputPool) pool.erase(pool.begin());
  }
  pool.push_back(storage);
  at::Tensor out = at::empty({0}, options);
  out.set_(storage, 0, {B, total_D}, {total_D, 1});
  return out;
}

at::Tensor tbe_forward_cpu(
    const at::Tensor& placeholder,
    const at::Tensor& weights,
    const at::Tensor& weights_offsets,
    const at::Tensor& row_offsets,
    const at::Tensor& table_dims,
    const at::Tensor& feature_table,
    const at::Tensor& D_offsets,
    const at::Tensor& indices,
    const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights,
    int64_t pooling_mode,
    int64_t total_D,
    const at::Tensor& momentum1,
    const at::Tensor& momentum2,
    const at::Tensor& step,
    int64_t optimizer,
    double lr,
    double eps,
    double beta1,
    double beta2,
    double weight_decay) {
  const Layout L = make_layout(weights_offsets, row_offsets, table_dims, feature_table, D_offsets, indices, offsets,
                               per_sample_weights, pooling_mode);
  check_weights(weights, L);
  LR_CHECK(total_D == L.total_D, "lightning_rec: total_D = ", total_D, " but D_offsets ends at ", L.total_D);
  at::Tensor out = pooled_output(L.B, L.total_D);
  if (weights.scalar_type() == at::kFloat) {
    forward_kernel<float>(weights.data_ptr<float>(), L, out.data_ptr<float>());
  } else {
    forward_kernel<at::Half>(weights.data_ptr<at::Half>(), L, out.data_ptr<float>());
  }
  return out;
}

void tbe_backward_update_cpu(
    const at::Tensor& weights,
    const at::Tensor& momentum1,
    const at::Tensor& momentum2,
    const at::Tensor& step,
    const at::Tensor& weights_offsets,
    const at::Tensor& row_offsets,
    const at::Tensor& table_dims,
    const at::Tensor& feature_table,
    const at::Tensor& D_offsets,
    const at::Tensor& indices,
    const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights,
    int64_t pooling_mode,
    const at::Tensor& grad_output,
    int64_t optimizer,
    double lr,
    double eps,
    double beta1,
    double beta2,
    double weight_decay) {
  LR_T0;
  const Layout L = make_layout(weights_offsets, row_offsets, table_dims, feature_table, D_offsets, indices, offsets,
                               per_sample_weights, pooling_mode);
  check_weights(weights, L);
  LR_TICK("layout");
  LR_CHECK_VALUE(optimizer >= kSGD && optimizer <= kPartialRowwiseAdam, "lightning_rec: unknown optimizer id ", optimizer);
  LR_CHECK(grad_output.dim() == 2 && grad_output.size(0) == L.B && grad_output.size(1) == L.total_D,
           "lightning_rec: grad_output must be [B, total_D] = [", L.B, ", ", L.total_D, "], got ", grad_output.sizes());
  // The gradient is read through its strides: a broadcast one (the gradient of out.sum()) or a
  // slice of a wider one is not copied.
  const at::Tensor grad = grad_output.to(at::kFloat);
  const GradView gv{grad.data_ptr<float>(), grad.stride(0), grad.stride(1)};
  LR_TICK("grad");
  const int64_t total_rows = L.row_offsets[L.T];
  auto state = [&](const at::Tensor& m, const char* name, bool rowwise) -> float* {
    LR_CHECK(m.scalar_type() == at::kFloat && m.is_contiguous() && m.device().is_cpu(),
             "lightning_rec: ", name, " must be a contiguous float32 CPU tensor");
    LR_CHECK(m.numel() >= (rowwise ? total_rows : weights.numel()), "lightning_rec: ", name, " is too small for the optimizer");
    return m.data_ptr<float>();
  };
  float* M1 = nullptr;
  float* M2 = nullptr;
  if (optimizer == kAdagrad || optimizer == kAdam || optimizer == kPartialRowwiseAdam) M1 = state(momentum1, "momentum1", false);
  if (optimizer == kRowwiseAdagrad) M1 = state(momentum1, "momentum1", true);
  if (optimizer == kAdam) M2 = state(momentum2, "momentum2", false);
  if (optimizer == kPartialRowwiseAdam) M2 = state(momentum2, "momentum2", true);

  OptimArgs a{optimizer, static_cast<float>(lr), static_cast<float>(eps), static_cast<float>(beta1),
              static_cast<float>(beta2), static_cast<float>(weight_decay), 1.0f, 1.0f};
  if (optimizer == kAdam || optimizer == kPartialRowwiseAdam) {
    LR_CHECK(step.scalar_type() == at::kLong && step.numel() == 1, "lightning_rec: step must be a one-element int64 tensor");
    int64_t* s = step.data_ptr<int64_t>();
    *s += 1;  // the update of this batch is step s (1-based), as in torch.optim.Adam
    a.bias_correction1 = static_cast<float>(1.0 - std::pow(beta1, static_cast<double>(*s)));
    a.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(*s))));
  }
  if (weights.scalar_type() == at::kFloat) {
    backward_update_kernel<float>(weights.data_ptr<float>(), M1, M2, L, gv, a);
  } else {
    backward_update_kernel<at::Half>(weights.data_ptr<at::Half>(), M1, M2, L, gv, a);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_rec, CPU, m) {
  m.impl("tbe_forward", &tbe_forward_cpu);
  m.impl("tbe_backward_update", &tbe_backward_update_cpu);
}

}  // namespace lightning_rec
