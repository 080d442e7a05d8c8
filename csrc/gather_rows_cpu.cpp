// gather_rows: gradient accumulation's buffer of the rows a fused kernel's lookups touched
// (lightning_rec/lookup.py FusedKernel.add_row_gradients), one micro-batch at a time.
//
// Per table: the rows held so far keep their slots, rows seen for the first time are appended in
// position order, and every id's gradient (scale * gradient row, scale = per-id weight / bag length)
// is added to its row's slot in position order, with the same arithmetic as the fused backward
// (embedding_cpu.cpp), so k micro-batches gathered sum each row as one batch of them does. One hash
// of the held rows and the new ids per table, one pass over the ids: no sort, no per-id gradient
// tensor. Parallel over tables.
//
//   rows_T[t]    [U_t] int64      rows held for table t (empty: none)
//   grads_T[t]   [U_t, D_t] f32   their summed gradients
//   feature_table [F], D_offsets [F + 1], indices [N], offsets [F * B + 1]: as tbe_forward (ops.cpp)
//   pooling_mode  0 sum, 1 mean, 2 none (grad_output [N, D]: one row per id)
//   grad_output   [B, total_D] (pooled) or [N, D] f32, read through its strides
//   returns       (rows_T', grads_T'): a table no id named keeps its tensors
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "check_message.h"

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace lightning_rec {
namespace {

struct Ids {
  const int64_t* feature_table;
  const int64_t* D_offsets;
  const int64_t* indices;
  const int64_t* offsets;
  const float* weights;  // nullptr: unweighted
  const float* grad;
  int64_t row_stride, col_stride, F, B;
  int64_t mode;
};

// Calls fn(p, j, f) for every id p of table t, features in feature order, bags j in order.
template <typename Fn>
void for_ids(const Ids& a, int64_t t, Fn&& fn) {
  for (int64_t f = 0; f < a.F; ++f) {
    if (a.feature_table[f] != t) continue;
    for (int64_t j = f * a.B; j < (f + 1) * a.B; ++j)
      for (int64_t p = a.offsets[j], pe = a.offsets[j + 1]; p < pe; ++p) fn(p, j, f);
  }
}

std::tuple<at::Tensor, at::Tensor> gather_table(const Ids& a, int64_t t, const at::Tensor& held_rows,
                                                const at::Tensor& held_grads) {
  int64_t n = 0;
  for (int64_t f = 0; f < a.F; ++f)
    if (a.feature_table[f] == t) n += a.offsets[(f + 1) * a.B] - a.offsets[f * a.B];
  if (n == 0) return {held_rows, held_grads};
  const int64_t U = held_rows.numel(), D = held_grads.size(1);
  const int64_t* held = held_rows.data_ptr<int64_t>();
  struct Slot {
    int64_t row;  // -1: empty
    int64_t slot;
  };
  int bits = 4;
  while ((int64_t(1) << bits) < 2 * (U + n)) ++bits;
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  std::vector<Slot> table(size_t(1) << bits, Slot{-1, -1});
  auto find = [&](int64_t row) -> Slot& {
    uint64_t h = (static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull) >> (64 - bits);
    while (table[h].row != row && table[h].row != -1) h = (h + 1) & mask;
    return table[h];
  };
  for (int64_t i = 0; i < U; ++i) find(held[i]) = Slot{held[i], i};
  std::vector<int64_t> fresh;  // rows named for the first time, in position order
  std::vector<int64_t> slot_of(n);
  int64_t k = 0;
  for_ids(a, t, [&](int64_t p, int64_t, int64_t) {
    Slot& s = find(a.indices[p]);
    if (s.row == -1) {
      s = Slot{a.indices[p], U + static_cast<int64_t>(fresh.size())};
      fresh.push_back(a.indices[p]);
    }
    slot_of[k++] = s.slot;
  });
  const int64_t U2 = U + static_cast<int64_t>(fresh.size());
  at::Tensor rows = at::empty({U2}, held_rows.options());
  at::Tensor grads = at::empty({U2, D}, held_grads.options());
  int64_t* r = rows.data_ptr<int64_t>();
  float* acc = grads.data_ptr<float>();
  if (U) {
    std::memcpy(r, held, sizeof(int64_t) * U);
    std::memcpy(acc, held_grads.data_ptr<float>(), sizeof(float) * U * D);
  }
  if (!fresh.empty()) std::memcpy(r + U, fresh.data(), sizeof(int64_t) * fresh.size());
  std::memset(acc + U * D, 0, sizeof(float) * (U2 - U) * D);
  k = 0;
  for_ids(a, t, [&](int64_t p, int64_t j, int64_t f) {
    float* __restrict__ g = acc + slot_of[k++] * D;
    const float* __restrict__ go = a.mode == 2 ? a.grad + p * a.row_stride
                                               : a.grad + (j - f * a.B) * a.row_stride + a.D_offsets[f] * a.col_stride;
    float scale = a.weights ? a.weights[p] : 1.0f;
    if (a.mode == 1) scale /= static_cast<float>(a.offsets[j + 1] - a.offsets[j]);
    for (int64_t d = 0; d < D; ++d) g[d] += scale * go[d * a.col_stride];
  });
  return {rows, grads};
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> gather_rows_cpu(
    at::TensorList rows_T, at::TensorList grads_T, const at::Tensor& feature_table, const at::Tensor& D_offsets,
    const at::Tensor& indices, const at::Tensor& offsets, const c10::optional<at::Tensor>& per_sample_weights,
    int64_t pooling_mode, const at::Tensor& grad_output) {
  const int64_t T = static_cast<int64_t>(rows_T.size()), F = feature_table.numel();
  LR_CHECK(static_cast<int64_t>(grads_T.size()) == T, "lightning_rec::gather_rows: rows and grads lists differ");
  LR_CHECK_VALUE(pooling_mode >= 0 && pooling_mode <= 2, "lightning_rec::gather_rows: pooling_mode must be 0, 1 or 2");
  for (const at::Tensor* m : {&feature_table, &D_offsets, &indices, &offsets})
    LR_CHECK(m->device().is_cpu() && m->scalar_type() == at::kLong && m->dim() == 1 && m->is_contiguous(),
             "lightning_rec::gather_rows: metadata, ids and offsets must be contiguous 1-D int64 CPU tensors");
  LR_CHECK(F > 0 && D_offsets.numel() == F + 1 && (offsets.numel() - 1) % F == 0,
           "lightning_rec::gather_rows: offsets must have F * B + 1 entries");
  LR_CHECK(grad_output.device().is_cpu() && grad_output.scalar_type() == at::kFloat && grad_output.dim() == 2,
           "lightning_rec::gather_rows: grad_output must be a 2-D float32 CPU tensor");
  for (int64_t t = 0; t < T; ++t)
    LR_CHECK(rows_T[t].scalar_type() == at::kLong && rows_T[t].is_contiguous() &&
                 grads_T[t].scalar_type() == at::kFloat && grads_T[t].dim() == 2 && grads_T[t].is_contiguous() &&
                 grads_T[t].size(0) == rows_T[t].numel(),
             "lightning_rec::gather_rows: held rows must be int64 [U] and their gradients float32 [U, D]");
  at::Tensor w;
  if (per_sample_weights.has_value()) {
    w = per_sample_weights->contiguous();
    LR_CHECK(w.scalar_type() == at::kFloat && w.numel() == indices.numel(),
             "lightning_rec::gather_rows: per_sample_weights must be float32 [N]");
  }
  Ids a{feature_table.data_ptr<int64_t>(), D_offsets.data_ptr<int64_t>(), indices.data_ptr<int64_t>(),
        offsets.data_ptr<int64_t>(), w.defined() ? w.data_ptr<float>() : nullptr, grad_output.data_ptr<float>(),
        grad_output.stride(0), grad_output.stride(1), F, (offsets.numel() - 1) / F, pooling_mode};
  std::vector<at::Tensor> rows(T), grads(T);
  at::parallel_for(0, T, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) std::tie(rows[t], grads[t]) = gather_table(a, t, rows_T[t], grads_T[t]);
  });
  return {rows, grads};
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_rec, CPU, m) {
  m.impl("gather_rows", &gather_rows_cpu);
}

}  // namespace lightning_rec
