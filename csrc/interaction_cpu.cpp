// DLRM's dot interaction in one pass (lightning_rec/models/fused_interaction.py
// registers its fake kernels and autograd; the composed ops they replace are in lightning_rec/models/dlrm.py).
//
// Legend: B batch, F sparse features, N = F + 1 vectors (dense first), D dim, P = N (N - 1) / 2 pairs.
//
//   dot_interaction(dense [B, D], sparse [B, F, D]) -> out [B, D + P]
//     out[b, :D] = dense[b];  out[b, D + p(i, j)] = <v_i, v_j> for i < j, pairs row-major (torch.triu_indices(N, N, 1))
//     Only the P pairs are computed: no [B, N, N] product, no gather, no concatenation.
//   dot_interaction_backward(grad [B, D + P], dense, sparse) -> (grad_dense [B, D], grad_sparse [B, F, D])
//     grad_v_i = sum_{j != i} grad(i, j) v_j (+ grad[b, :D] for the dense vector), one output row at a time.
// float32 and float64; inputs are read contiguous (a strided input is copied once).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "check_message.h"

#include <cstdint>
#include <algorithm>
#include <tuple>
#include <vector>

namespace lightning_rec {
namespace {

// Lanes of independent partial sums: the compiler turns them into vector registers (a single running sum would
// be a serial chain it may not reorder).
constexpr int64_t kLanes = 16;

template <typename T>
inline T dot(const T* __restrict__ a, const T* __restrict__ b, int64_t D) {
  T acc[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) acc[k] += a[d + k] * b[d + k];
  for (int64_t k = 0; d + k < D; ++k) acc[k] += a[d + k] * b[d + k];
  T s = 0;
  for (int64_t k = 0; k < kLanes; ++k) s += acc[k];
  return s;
}

template <typename T>
inline void axpy(T s, const T* __restrict__ x, T* __restrict__ y, int64_t D) {
  for (int64_t d = 0; d < D; ++d) y[d] += s * x[d];
}

// Samples per parallel task: a sample is ~N^2 D / 2 multiply-adds, so a few suffice to pay for a task.
int64_t sample_grain(int64_t N, int64_t D) {
  const int64_t work = N * N * D;
  return work >= (1 << 16) ? 1 : (1 << 16) / work + 1;
}

void check_dot_inputs(const at::Tensor& dense, const at::Tensor& sparse, const char* op) {
  LR_CHECK(dense.device().is_cpu() && sparse.device().is_cpu(), "lightning_rec::", op, ": CPU tensors only");
  LR_CHECK(dense.dim() == 2 && sparse.dim() == 3 && sparse.size(0) == dense.size(0) && sparse.size(2) == dense.size(1),
           "lightning_rec::", op, ": dense must be [B, D] and sparse [B, F, D], got ", dense.sizes(), " and ",
           sparse.sizes());
  LR_CHECK(dense.scalar_type() == sparse.scalar_type() &&
               (dense.scalar_type() == at::kFloat || dense.scalar_type() == at::kDouble),
           "lightning_rec::", op, ": dense and sparse must both be float32 or both float64");
}

// Row i of the N vectors of sample b: the dense vector, then the F sparse ones.
template <typename T>
inline const T* vec(const T* dense, const T* sparse, int64_t b, int64_t i, int64_t F, int64_t D) {
  return i == 0 ? dense + b * D : sparse + (b * F + i - 1) * D;
}

at::Tensor dot_interaction_cpu(const at::Tensor& dense_in, const at::Tensor& sparse_in) {
  check_dot_inputs(dense_in, sparse_in, "dot_interaction");
  const at::Tensor dense = dense_in.contiguous(), sparse = sparse_in.contiguous();
  const int64_t B = dense.size(0), D = dense.size(1), F = sparse.size(1), N = F + 1, P = N * (N - 1) / 2;
  at::Tensor out = at::empty({B, D + P}, dense.options());
  AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "dot_interaction", [&] {
    const scalar_t* d_ptr = dense.data_ptr<scalar_t>();
    const scalar_t* s_ptr = sparse.data_ptr<scalar_t>();
    scalar_t* o_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, B, sample_grain(N, D), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        scalar_t* o = o_ptr + b * (D + P);
        for (int64_t d = 0; d < D; ++d) o[d] = d_ptr[b * D + d];
        scalar_t* pair = o + D;
        for (int64_t i = 0; i < N; ++i) {
          const scalar_t* vi = vec(d_ptr, s_ptr, b, i, F, D);
          for (int64_t j = i + 1; j < N; ++j) *pair++ = dot(vi, vec(d_ptr, s_ptr, b, j, F, D), D);
        }
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> dot_interaction_backward_cpu(const at::Tensor& grad_in, const at::Tensor& dense_in,
                                                                const at::Tensor& sparse_in) {
  check_dot_inputs(dense_in, sparse_in, "dot_interaction_backward");
  const at::Tensor dense = dense_in.contiguous(), sparse = sparse_in.contiguous();
  const int64_t B = dense.size(0), D = dense.size(1), F = sparse.size(1), N = F + 1, P = N * (N - 1) / 2;
  LR_CHECK(grad_in.dim() == 2 && grad_in.size(0) == B && grad_in.size(1) == D + P &&
               grad_in.scalar_type() == dense.scalar_type() && grad_in.device().is_cpu(),
           "lightning_rec::dot_interaction_backward: grad must be [B, D + P] of the inputs' dtype, got ",
           grad_in.sizes());
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor grad_dense = at::empty_like(dense), grad_sparse = at::empty_like(sparse);
  AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "dot_interaction_backward", [&] {
    const scalar_t* d_ptr = dense.data_ptr<scalar_t>();
    const scalar_t* s_ptr = sparse.data_ptr<scalar_t>();
    const scalar_t* g_ptr = grad.data_ptr<scalar_t>();
    scalar_t* gd_ptr = grad_dense.data_ptr<scalar_t>();
    scalar_t* gs_ptr = grad_sparse.data_ptr<scalar_t>();
    at::parallel_for(0, B, sample_grain(N, D), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t* g = g_ptr + b * (D + P);
        const scalar_t* gp = g + D;
        for (int64_t i = 0; i < N; ++i) {
          scalar_t* out = i == 0 ? gd_ptr + b * D : gs_ptr + (b * F + i - 1) * D;
          for (int64_t d = 0; d < D; ++d) out[d] = i == 0 ? g[d] : scalar_t(0);
          // pair (j, i) for j < i sits at p(j, i) = j N - j (j + 1) / 2 + i - j - 1; pairs (i, j > i) follow p(i, i + 1)
          for (int64_t j = 0; j < i; ++j)
            axpy(gp[j * N - j * (j + 1) / 2 + i - j - 1], vec(d_ptr, s_ptr, b, j, F, D), out, D);
          const scalar_t* row = gp + i * N - i * (i + 1) / 2;
          for (int64_t j = i + 1; j < N; ++j) axpy(row[j - i - 1], vec(d_ptr, s_ptr, b, j, F, D), out, D);
        }
      }
    });
  });
  return {grad_dense, grad_sparse};
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_rec, CPU, m) {
  m.impl("dot_interaction", &dot_interaction_cpu);
  m.impl("dot_interaction_backward", &dot_interaction_backward_cpu);
}

}  // namespace lightning_rec
