// Schemas of every torch.ops.lightning_rec.* operator, registered once here (the managed-collision ones in
// mch_cpu.cpp, with their state class). Kernels live in
// *_cpu.cpp (and *_cuda.cu when built with CUDA); fake kernels and autograd are registered in Python
// (lightning_rec/native_embedding.py; the interaction ops' in lightning_rec/models/fused_interaction.py).
#include <torch/extension.h>

// Table-batched embedding (TBE) layout shared by both ops, the same as fbgemm's:
//   weights          [sum_t rows_t * D_t]  all tables, flat, table t at weights_offsets[t]
//   row_offsets      [T + 1]  cumulative rows; row-wise optimizer state of table t starts there
//   table_dims       [T]      D_t
//   feature_table    [F]      table of each feature
//   D_offsets        [F + 1]  output column of each feature
//   indices          [N]      ids, int64
//   offsets          [F * B + 1]  bag boundaries, feature-major (feature 0's B bags, then feature 1's)
//   pooling_mode     0 = sum, 1 = mean
//   total_D          D_offsets[F], the output width (an argument so that fake kernels know it)
// optimizer: 0 sgd, 1 adagrad, 2 rowwise_adagrad, 3 adam, 4 partial_rowwise_adam.
// momentum1 / momentum2 / step are the optimizer state (empty when the optimizer has none); the
// forward takes them only so that its autograd formula can hand them to the update.
TORCH_LIBRARY(lightning_rec, m) {
  m.def(
      "tbe_forward(Tensor placeholder, Tensor weights, Tensor weights_offsets, Tensor row_offsets, "
      "Tensor table_dims, Tensor feature_table, Tensor D_offsets, Tensor indices, Tensor offsets, "
      "Tensor? per_sample_weights, int pooling_mode, int total_D, Tensor momentum1, Tensor momentum2, Tensor step, "
      "int optimizer, float lr, float eps, float beta1, float beta2, float weight_decay) -> Tensor");
  m.def(
      "tbe_backward_update(Tensor(a!) weights, Tensor(b!) momentum1, Tensor(c!) momentum2, "
      "Tensor(d!) step, Tensor weights_offsets, Tensor row_offsets, Tensor table_dims, "
      "Tensor feature_table, Tensor D_offsets, Tensor indices, Tensor offsets, "
      "Tensor? per_sample_weights, int pooling_mode, Tensor grad_output, int optimizer, float lr, "
      "float eps, float beta1, float beta2, float weight_decay) -> ()");
  // Gradient accumulation's buffer of touched rows, one micro-batch added (gather_rows_cpu.cpp):
  // per table, held rows keep their slots, new rows are appended, each id's gradient summed in position order.
  m.def(
      "gather_rows(Tensor[] rows, Tensor[] grads, Tensor feature_table, Tensor D_offsets, Tensor indices, "
      "Tensor offsets, Tensor? per_sample_weights, int pooling_mode, Tensor grad_output) -> (Tensor[], Tensor[])");
  // The managed-collision ops (mch_profile_remap, mch_evict, mch_owner_of) and their state class are registered in
  // mch_cpu.cpp: the class must be known before the schemas and kernels that name it, which one file orders.
  // Same-host barrier over int64 counters in shared memory (shm_barrier.cpp): -1 when all arrived,
  // else 2 * peer + (1 if the peer's process is gone, 0 on timeout).
  m.def("shm_barrier(Tensor[] arrive, int rank, int k, int[] pids, float timeout_s) -> int");
  // Whether a jagged batch may reach a kernel (batch_check_cpu.cpp): never throws for bad data;
  // returns {code, position, value, feature, count} (code 0: ok).
  m.def("check_batch(Tensor rows_F, Tensor indices, Tensor offsets, Tensor? weights) -> Tensor");
  // DLRM's dot interaction (interaction_cpu.cpp): dense [B, D] and sparse [B, F, D] -> [B, D + (F+1)F/2], only
  // the pairs computed, and its backward.
  m.def("dot_interaction(Tensor dense, Tensor sparse) -> Tensor");
  m.def("dot_interaction_backward(Tensor grad, Tensor dense, Tensor sparse) -> (Tensor, Tensor)");
  // Criteo text -> (label [N], dense [N, 13], sparse [N, 26], status [N]), one row per line of `buf`
  // (criteo_parse_cpu.cpp). hash_mode: 0 raw 32-bit hashes, 1 reserved id 0 + modulo, 2 modulo.
  // label_columns (fields; label_field -1): several labels, label [N, C] float64 of their numbers.
  m.def(
      "parse_criteo(Tensor buf, int separator, int num_fields, int label_field, int[] dense_fields, "
      "int[] sparse_fields, int[] num_embeddings, int hash_mode, bool log_dense, int[] label_columns=[]) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

// Importing lightning_rec._C runs the registrations above; the module itself exports nothing.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
