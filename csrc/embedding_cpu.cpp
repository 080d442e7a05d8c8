// Fused table-batched embedding on CPU: pooled lookup, and a backward that applies the optimizer
// to the touched rows directly (no embedding gradient is materialised).
//
// Backward, in three steps:
//   1. key every id by (global row, position) and radix-sort the keys (stable, parallel);
//   2. for each unique row, sum its gradient over its positions in position order
//      (so the result does not depend on the number of threads);
//   3. apply the optimizer to that row. Steps 2-3 run in parallel over unique rows.
// Schemas are in ops.cpp; layout of the arguments is described there.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
  TORCH_CHECK(t.device().is_cpu(), "lightning_rec: ", name, " must be on CPU");
  TORCH_CHECK(t.scalar_type() == at::kLong, "lightning_rec: ", name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "lightning_rec: ", name, " must be 1-D and contiguous");
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
  TORCH_CHECK_VALUE(pooling_mode == 0 || pooling_mode == 1, "lightning_rec: pooling_mode must be 0 (sum) or 1 (mean)");
  Layout L{};
  L.T = table_dims.numel();
  L.F = feature_table.numel();
  TORCH_CHECK(weights_offsets.numel() == L.T && row_offsets.numel() == L.T + 1, "lightning_rec: table metadata sizes disagree");
  TORCH_CHECK(D_offsets.numel() == L.F + 1 && L.F > 0, "lightning_rec: feature metadata sizes disagree");
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
    TORCH_CHECK(L.feature_table[f] >= 0 && L.feature_table[f] < L.T, "lightning_rec: feature_table[", f, "] out of range");
    TORCH_CHECK(L.D_offsets[f + 1] - L.D_offsets[f] == L.table_dims[L.feature_table[f]], "lightning_rec: D_offsets disagree with table_dims");
  }
  TORCH_CHECK(L.row_offsets[L.T] < (int64_t(1) << 31) && L.N < (int64_t(1) << 31),
              "lightning_rec: more than 2^31 rows or ids in one TBE");

  const int64_t n_off = offsets.numel();
  TORCH_CHECK_VALUE(n_off >= 1 && (n_off - 1) % L.F == 0, "lightning_rec: offsets has ", n_off,
                    " entries; expected F * B + 1 with F = ", L.F, " features");
  L.B = (n_off - 1) / L.F;
  TORCH_CHECK_VALUE(L.offsets[0] == 0 && L.offsets[n_off - 1] == L.N, "lightning_rec: offsets must start at 0 and end at the number of ids (",
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
    TORCH_CHECK_VALUE(false, "lightning_rec: offsets must be non-decreasing, but offsets[", j + 1, "] = ", L.offsets[j + 1],
                      " < offsets[", j, "] = ", L.offsets[j], " (feature #", j / std::max<int64_t>(L.B, 1), ")");
  }

  L.per_sample_weights = nullptr;
  if (per_sample_weights.has_value()) {
    const auto& w = *per_sample_weights;
    TORCH_CHECK_VALUE(w.scalar_type() == at::kFloat && w.dim() == 1 && w.is_contiguous(),
                      "lightning_rec: per_sample_weights must be a contiguous 1-D float32 tensor");
    TORCH_CHECK_VALUE(w.numel() == L.N, "lightning_rec: per_sample_weights has ", w.numel(), " entries but there are ", L.N, " ids");
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
    TORCH_CHECK_VALUE(false, "lightning_rec: id ", L.indices[p], " at position ", p, " (feature #", f, ", sample ", bag % L.B,
                      ") is out of range for table #", t, " with ", L.row_offsets[t + 1] - L.row_offsets[t], " rows");
  }
  return L;
}

inline float load(float v) { return v; }
inline float load(at::Half v) { return static_cast<float>(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(at::Half* p, float v) { *p = static_cast<at::Half>(v); }

template <typename scalar_t>
void forward_kernel(const scalar_t* W, const Layout& L, float* out) {
  at::parallel_for(0, L.F * L.B, 64, [&](int64_t begin, int64_t end) {
    // Ids of consecutive bags are consecutive: prefetch the row of the id kAhead positions on
    // (all its cache lines) while it belongs to the same feature, so the misses overlap.
    constexpr int64_t kAhead = 8;
    int64_t f = begin / L.B;
    int64_t t = L.feature_table[f];
    int64_t D = L.table_dims[t];
    const scalar_t* table = W + L.weights_offsets[t];
    int64_t feature_end = L.offsets[(f + 1) * L.B];
    const int64_t row_bytes_max = L.max_D * static_cast<int64_t>(sizeof(scalar_t));
    auto prefetch_row = [&](const scalar_t* r) {
      for (int64_t c = 0; c < row_bytes_max && c < D * static_cast<int64_t>(sizeof(scalar_t)); c += 64)
        LR_PREFETCH(reinterpret_cast<const char*>(r) + c);
    };
    for (int64_t p = L.offsets[begin], e = std::min(feature_end, L.offsets[begin] + kAhead); p < e; ++p)
      prefetch_row(table + L.indices[p] * D);
    for (int64_t j = begin; j < end; ++j) {
      const int64_t fj = j / L.B, b = j - fj * L.B;
      if (fj != f) {
        f = fj;
        t = L.feature_table[f];
        D = L.table_dims[t];
        table = W + L.weights_offsets[t];
        feature_end = L.offsets[(f + 1) * L.B];
        for (int64_t p = L.offsets[j], e = std::min(feature_end, L.offsets[j] + kAhead); p < e; ++p)
          prefetch_row(table + L.indices[p] * D);
      }
      float* __restrict__ o = out + b * L.total_D + L.D_offsets[f];
      const int64_t pb = L.offsets[j], pe = L.offsets[j + 1];
      std::memset(o, 0, sizeof(float) * D);
      for (int64_t p = pb; p < pe; ++p) {
        if (p + kAhead < feature_end) prefetch_row(table + L.indices[p + kAhead] * D);
        const scalar_t* __restrict__ row = table + L.indices[p] * D;
        if (L.per_sample_weights) {
          const float w = L.per_sample_weights[p];
          for (int64_t d = 0; d < D; ++d) o[d] += w * load(row[d]);
        } else {
          for (int64_t d = 0; d < D; ++d) o[d] += load(row[d]);
        }
      }
      if (L.mean && pe > pb) {
        const float s = 1.0f / static_cast<float>(pe - pb);
        for (int64_t d = 0; d < D; ++d) o[d] *= s;
      }
    }
  });
}

// Stable LSD radix sort of `keys` on bits [32, 32 + nbits); the low 32 bits (the position) ride
// along, so equal rows stay in position order. Parallel over fixed chunks of the input.
void radix_sort_high(std::vector<uint64_t>& keys, std::vector<uint64_t>& tmp, int nbits) {
  const int64_t N = static_cast<int64_t>(keys.size());
  if (N <= 1 || nbits <= 0) return;
  const int passes = (nbits + 10) / 11;
  const int digit_bits = (nbits + passes - 1) / passes;
  const int64_t buckets = int64_t(1) << digit_bits;
  const int64_t nchunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / 8192));
  const int64_t chunk = (N + nchunks - 1) / nchunks;
  std::vector<int64_t> hist(nchunks * buckets);
  tmp.resize(N);
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 32 + pass * digit_bits;
    const uint64_t mask = buckets - 1;
    std::fill(hist.begin(), hist.end(), 0);
    at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        int64_t* h = hist.data() + c * buckets;
        for (int64_t i = c * chunk, e = std::min(N, (c + 1) * chunk); i < e; ++i) ++h[(keys[i] >> shift) & mask];
      }
    });
    int64_t run = 0;
    for (int64_t d = 0; d < buckets; ++d) {
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t n = hist[c * buckets + d];
        hist[c * buckets + d] = run;
        run += n;
      }
    }
    at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        int64_t* h = hist.data() + c * buckets;
        for (int64_t i = c * chunk, e = std::min(N, (c + 1) * chunk); i < e; ++i) tmp[h[(keys[i] >> shift) & mask]++] = keys[i];
      }
    });
    keys.swap(tmp);
  }
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
      float sq = 0.0f;
      for (int64_t d = 0; d < D; ++d) sq += g[d] * g[d];
      const float s = *m1 + sq / static_cast<float>(D);
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
      float sq = 0.0f;
      for (int64_t d = 0; d < D; ++d) sq += g[d] * g[d];
      const float v = b2 * *m2 + (1.0f - b2) * sq / static_cast<float>(D);
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

template <typename scalar_t>
void backward_update_kernel(scalar_t* W, float* M1, float* M2, const Layout& L, const float* grad, const OptimArgs& a) {
  const int64_t N = L.N;
  if (N == 0) return;
  LR_T0;
  // 1. keys = (global row << 32) | position; bag_of[position] = bag.
  std::vector<uint64_t> keys(N), tmp;
  std::vector<int32_t> bag_of(N);
  at::parallel_for(0, L.F * L.B, 256, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t f = j / L.B;
      const uint64_t base = static_cast<uint64_t>(L.row_offsets[L.feature_table[f]]);
      for (int64_t p = L.offsets[j], pe = L.offsets[j + 1]; p < pe; ++p) {
        keys[p] = ((base + static_cast<uint64_t>(L.indices[p])) << 32) | static_cast<uint64_t>(p);
        bag_of[p] = static_cast<int32_t>(j);
      }
    }
  });
  const uint64_t total_rows = static_cast<uint64_t>(L.row_offsets[L.T]);
  int nbits = 0;
  while ((uint64_t(1) << nbits) < total_rows) ++nbits;
  LR_TICK("keys");
  radix_sort_high(keys, tmp, nbits);
  LR_TICK("sort");

  // 2. segment starts: positions i where the row changes (plus N as the end).
  const int64_t nchunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / 8192));
  const int64_t chunk = (N + nchunks - 1) / nchunks;
  std::vector<int64_t> counts(nchunks + 1, 0);
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      int64_t n = 0;
      for (int64_t i = c * chunk, e = std::min(N, (c + 1) * chunk); i < e; ++i)
        n += (i == 0 || (keys[i] >> 32) != (keys[i - 1] >> 32));
      counts[c + 1] = n;
    }
  });
  for (int64_t c = 0; c < nchunks; ++c) counts[c + 1] += counts[c];
  const int64_t U = counts[nchunks];
  std::vector<int32_t> seg(U + 1);
  seg[U] = static_cast<int32_t>(N);
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      int64_t k = counts[c];
      for (int64_t i = c * chunk, e = std::min(N, (c + 1) * chunk); i < e; ++i)
        if (i == 0 || (keys[i] >> 32) != (keys[i - 1] >> 32)) seg[k++] = static_cast<int32_t>(i);
    }
  });

  LR_TICK("segments");
  // 3. per unique row: sum the gradient in position order, then update.
  at::parallel_for(0, U, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> gbuf(L.max_D);
    float* __restrict__ g = gbuf.data();
    // Rows are scattered over hundreds of MB: fetch the rows a few segments ahead (all their
    // cache lines, the state and the gradient rows) so that the misses overlap.
    constexpr int64_t kAhead = 8;
    auto prefetch_segment = [&](int64_t v) {
      const int64_t s = seg[v], e = seg[v + 1];
      const int64_t p0 = static_cast<int64_t>(keys[s] & 0xffffffffu);
      const int64_t t = L.feature_table[bag_of[p0] / L.B];
      const int64_t D = L.table_dims[t];
      const int64_t woff = L.weights_offsets[t] + L.indices[p0] * D;
      const char* wp = reinterpret_cast<const char*>(W + woff);
      for (int64_t c = 0; c < D * static_cast<int64_t>(sizeof(scalar_t)); c += 64) LR_PREFETCH(wp + c);
      if (a.optimizer == kRowwiseAdagrad) LR_PREFETCH(M1 + L.row_offsets[t] + L.indices[p0]);
      if (a.optimizer == kAdagrad || a.optimizer == kAdam || a.optimizer == kPartialRowwiseAdam) {
        for (int64_t c = 0; c < D * 4; c += 64) LR_PREFETCH(reinterpret_cast<const char*>(M1 + woff) + c);
      }
      if (a.optimizer == kAdam) {
        for (int64_t c = 0; c < D * 4; c += 64) LR_PREFETCH(reinterpret_cast<const char*>(M2 + woff) + c);
      }
      if (a.optimizer == kPartialRowwiseAdam) LR_PREFETCH(M2 + L.row_offsets[t] + L.indices[p0]);
      for (int64_t i = s; i < e && i < s + 4; ++i) {
        const int64_t p = static_cast<int64_t>(keys[i] & 0xffffffffu);
        const int64_t j = bag_of[p];
        const int64_t f = j / L.B, b = j - f * L.B;
        const char* gp = reinterpret_cast<const char*>(grad + b * L.total_D + L.D_offsets[f]);
        for (int64_t c = 0; c < D * 4; c += 64) LR_PREFETCH(gp + c);
      }
    };
    for (int64_t u = begin; u < std::min(end, begin + kAhead); ++u) prefetch_segment(u);
    for (int64_t u = begin; u < end; ++u) {
      if (u + kAhead < end) prefetch_segment(u + kAhead);
      const int64_t s = seg[u], e = seg[u + 1];
      const int64_t p0 = static_cast<int64_t>(keys[s] & 0xffffffffu);
      const int64_t t = L.feature_table[bag_of[p0] / L.B];
      const int64_t D = L.table_dims[t];
      const int64_t row = L.indices[p0];
      std::memset(g, 0, sizeof(float) * D);
      for (int64_t i = s; i < e; ++i) {
        const int64_t p = static_cast<int64_t>(keys[i] & 0xffffffffu);
        const int64_t j = bag_of[p];
        const int64_t f = j / L.B, b = j - f * L.B;
        float scale = L.per_sample_weights ? L.per_sample_weights[p] : 1.0f;
        if (L.mean) scale /= static_cast<float>(L.offsets[j + 1] - L.offsets[j]);
        const float* __restrict__ go = grad + b * L.total_D + L.D_offsets[f];
        for (int64_t d = 0; d < D; ++d) g[d] += scale * go[d];
      }
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
  });
  LR_TICK("update");
}

void check_weights(const at::Tensor& weights, const Layout& L) {
  TORCH_CHECK(weights.device().is_cpu() && weights.dim() == 1 && weights.is_contiguous(),
              "lightning_rec: weights must be a contiguous 1-D CPU tensor");
  TORCH_CHECK(weights.scalar_type() == at::kFloat || weights.scalar_type() == at::kHalf,
              "lightning_rec: weights must be float32 or float16, got ", weights.scalar_type());
  int64_t need = 0;
  for (int64_t t = 0; t < L.T; ++t)
    need = std::max(need, L.weights_offsets[t] + (L.row_offsets[t + 1] - L.row_offsets[t]) * L.table_dims[t]);
  TORCH_CHECK(weights.numel() >= need, "lightning_rec: weights has ", weights.numel(), " elements, layout needs ", need);
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
  TORCH_CHECK(total_D == L.total_D, "lightning_rec: total_D = ", total_D, " but D_offsets ends at ", L.total_D);
  at::Tensor out = at::empty({L.B, L.total_D}, weights.options().dtype(at::kFloat));
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
  const Layout L = make_layout(weights_offsets, row_offsets, table_dims, feature_table, D_offsets, indices, offsets,
                               per_sample_weights, pooling_mode);
  check_weights(weights, L);
  TORCH_CHECK_VALUE(optimizer >= kSGD && optimizer <= kPartialRowwiseAdam, "lightning_rec: unknown optimizer id ", optimizer);
  TORCH_CHECK(grad_output.dim() == 2 && grad_output.size(0) == L.B && grad_output.size(1) == L.total_D,
              "lightning_rec: grad_output must be [B, total_D] = [", L.B, ", ", L.total_D, "], got ", grad_output.sizes());
  const at::Tensor grad = grad_output.to(at::kFloat).contiguous();
  const int64_t total_rows = L.row_offsets[L.T];
  auto state = [&](const at::Tensor& m, const char* name, bool rowwise) -> float* {
    TORCH_CHECK(m.scalar_type() == at::kFloat && m.is_contiguous() && m.device().is_cpu(),
                "lightning_rec: ", name, " must be a contiguous float32 CPU tensor");
    TORCH_CHECK(m.numel() >= (rowwise ? total_rows : weights.numel()), "lightning_rec: ", name, " is too small for the optimizer");
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
    TORCH_CHECK(step.scalar_type() == at::kLong && step.numel() == 1, "lightning_rec: step must be a one-element int64 tensor");
    int64_t* s = step.data_ptr<int64_t>();
    *s += 1;  // the update of this batch is step s (1-based), as in torch.optim.Adam
    a.bias_correction1 = static_cast<float>(1.0 - std::pow(beta1, static_cast<double>(*s)));
    a.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(*s))));
  }
  if (weights.scalar_type() == at::kFloat) {
    backward_update_kernel<float>(weights.data_ptr<float>(), M1, M2, L, grad.data_ptr<float>(), a);
  } else {
    backward_update_kernel<at::Half>(weights.data_ptr<at::Half>(), M1, M2, L, grad.data_ptr<float>(), a);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_rec, CPU, m) {
  m.impl("tbe_forward", &tbe_forward_cpu);
  m.impl("tbe_backward_update", &tbe_backward_update_cpu);
}

}  // namespace lightning_rec
