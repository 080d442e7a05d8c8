// check_batch: one pass over a jagged batch that says whether a kernel may read it, without throwing.
//
// Every batch that reaches a table-batched kernel (ours or fbgemm's) is checked here first: offsets
// start at 0, never decrease and end at the number of ids; every id is in [0, rows of its feature's
// table); every per-id weight is finite. The answer is a small int64 tensor that Python turns into
// an error naming the feature and table. Nothing is thrown for bad data: a C++ exception that
// crosses into Python is the one path that differs between torch builds, compilers and thread
// counts, and a bad batch is ordinary user input, not a broken invariant.
//
//   rows_F     [F]          rows of the table each feature reads (-1: read by no table, not checked)
//   indices    [N]          ids (int32 or int64), feature-major as in a KJT
//   offsets    [F * B + 1]  bag boundaries (int32 or int64)
//   weights    [N] or None  per-id weights (any floating type)
//   returns    [5] int64    {code, position, value, feature, count}
//
//   code 0 ok | 1 offsets[0] != 0 (value) | 2 offsets decrease after `position` (value = offsets[position + 1])
//        3 offsets end at `value`, not N (count = N) | 4 id `value` at `position` of `feature` out of range (count bad ids)
//        5 weight at `position` of `feature` is NaN or infinite (count) | 6 offsets length is not F * B + 1
#include <torch/extension.h>

#include "check_message.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

namespace lightning_rec {
namespace {

constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

// Records the smallest position seen by any thread, so the answer does not depend on threads.
void keep_first(std::atomic<int64_t>& first, int64_t p) {
  int64_t cur = first.load();
  while (p < cur && !first.compare_exchange_weak(cur, p)) {}
}

// Features per task so that each task reads at least ~64k ids: a batch of a few hundred thousand ids
// is one or a few tasks (a parallel region costs more than the pass), a large one spreads out.
int64_t feature_grain(int64_t F, int64_t N) {
  return std::max<int64_t>(1, (F * (int64_t(1) << 16) + std::max<int64_t>(N, 1) - 1) / std::max<int64_t>(N, 1));
}

// For every feature some table reads (rows_F[f] >= 0), counts the positions of its bag range where
// `bad(f, p)` holds and keeps the first. A branch-free count (vectorises); the slow path runs only
// for a feature that has a bad position.
template <typename offset_t, typename Bad>
void scan_features(const int64_t* rows_F, const offset_t* offsets, int64_t F, int64_t B, Bad bad,
                   std::atomic<int64_t>& first, std::atomic<int64_t>& count) {
  const int64_t N = offsets[F * B];
  at::parallel_for(0, F, feature_grain(F, N), [&](int64_t fb, int64_t fe) {
    for (int64_t f = fb; f < fe; ++f) {
      if (rows_F[f] < 0) continue;  // a feature no table reads: its ids and weights reach no kernel
      const int64_t pb = offsets[f * B], pe = offsets[(f + 1) * B];
      int64_t n = 0;
      for (int64_t p = pb; p < pe; ++p) n += bad(f, p);
      if (n == 0) continue;
      count += n;
      for (int64_t p = pb; p < pe; ++p) {
        if (bad(f, p)) {
          keep_first(first, p);
          break;
        }
      }
    }
  });
}

template <typename offset_t>
int64_t feature_of(const offset_t* offsets, int64_t n_off, int64_t B, int64_t p) {
  // The last bag that starts at or before p and is non-empty holds p.
  const offset_t* it = std::upper_bound(offsets, offsets + n_off, static_cast<offset_t>(p));
  const int64_t bag = (it - offsets) - 1;
  return B > 0 ? bag / B : 0;
}

at::Tensor check_batch_cpu(const at::Tensor& rows_F, const at::Tensor& indices, const at::Tensor& offsets,
                           const c10::optional<at::Tensor>& weights) {
  LR_CHECK(rows_F.device().is_cpu() && indices.device().is_cpu() && offsets.device().is_cpu(),
           "lightning_rec::check_batch runs on CPU tensors");
  LR_CHECK(rows_F.scalar_type() == at::kLong && rows_F.dim() == 1, "lightning_rec::check_batch: rows_F must be int64 [F]");
  // checked here, not left to AT_DISPATCH's own error: its message is formatted by c10::str (check_message.h)
  auto is_index = [](at::ScalarType t) { return t == at::kInt || t == at::kLong; };
  LR_CHECK(is_index(indices.scalar_type()) && is_index(offsets.scalar_type()),
           "lightning_rec::check_batch: indices and offsets must be int32 or int64, got ", indices.scalar_type(),
           " and ", offsets.scalar_type());
  if (weights.has_value()) {
    const at::ScalarType t = weights->scalar_type();
    LR_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16,
             "lightning_rec::check_batch: weights must be floating point, got ", t);
  }
  const at::Tensor rows = rows_F.contiguous();
  const at::Tensor ids = indices.contiguous();
  const at::Tensor offs = offsets.contiguous();
  const int64_t F = rows.numel(), N = ids.numel(), n_off = offs.numel();
  at::Tensor out = at::zeros({5}, at::TensorOptions().dtype(at::kLong));
  int64_t* r = out.data_ptr<int64_t>();
  if (n_off < 1 || F == 0 || (n_off - 1) % F != 0) {
    r[0] = 6;
    r[2] = n_off;
    return out;
  }
  const int64_t B = (n_off - 1) / F;
  AT_DISPATCH_INDEX_TYPES(offs.scalar_type(), "check_batch_offsets", [&] {
    using offset_t = index_t;
    const offset_t* o = offs.data_ptr<offset_t>();
    if (o[0] != 0) {
      r[0] = 1;
      r[2] = o[0];
      return;
    }
    std::atomic<int64_t> first{kNone};
    at::parallel_for(0, n_off - 1, 1 << 16, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        if (o[j + 1] < o[j]) {
          keep_first(first, j);
          return;
        }
      }
    });
    if (first.load() != kNone) {
      r[0] = 2;
      r[1] = first.load();
      r[2] = o[first.load() + 1];
      r[3] = B > 0 ? first.load() / B : 0;
      return;
    }
    if (o[n_off - 1] != N) {
      r[0] = 3;
      r[2] = o[n_off - 1];
      r[4] = N;
      return;
    }
    std::atomic<int64_t> bad{kNone}, count{0};
    AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "check_batch_ids", [&] {
      const int64_t* rows_p = rows.data_ptr<int64_t>();
      const index_t* ids_p = ids.data_ptr<index_t>();
      auto out_of_range = [&](int64_t f, int64_t p) {  // negative ids are huge as uint64
        return static_cast<uint64_t>(static_cast<int64_t>(ids_p[p])) >= static_cast<uint64_t>(rows_p[f]);
      };
      scan_features(rows_p, o, F, B, out_of_range, bad, count);
      if (bad.load() != kNone) {
        r[0] = 4;
        r[1] = bad.load();
        r[2] = static_cast<int64_t>(ids.data_ptr<index_t>()[bad.load()]);
        r[3] = feature_of(o, n_off, B, bad.load());
        r[4] = count.load();
      }
    });
    if (r[0] != 0 || !weights.has_value()) return;
    const at::Tensor w = weights->contiguous();
    if (w.numel() != N) return;  // sizes are checked in Python, where the KJT is built
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "check_batch_weights", [&] {
      const scalar_t* w_p = w.data_ptr<scalar_t>();
      auto not_finite = [&](int64_t, int64_t p) { return !std::isfinite(static_cast<float>(w_p[p])); };
      scan_features(rows.data_ptr<int64_t>(), o, F, B, not_finite, bad, count);
    });
    if (bad.load() != kNone) {
      r[0] = 5;
      r[1] = bad.load();
      r[3] = feature_of(o, n_off, B, bad.load());
      r[4] = count.load();
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_rec, CPU, m) {
  m.impl("check_batch", &check_batch_cpu);
}

}  // namespace lightning_rec
