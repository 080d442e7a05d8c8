// A managed-collision table group's state tensors, handed to C++ once (lightning_rec/managed_collision/mch.py's
// TableGroup): a step's call then passes one object instead of 12 tensors a table, each converted on every call.
#pragma once

#include <torch/custom_class.h>

#include <cstdint>
#include <vector>

namespace lightning_rec {

struct MchState : torch::CustomClassHolder {
  std::vector<at::Tensor> tensors;  // 12 a table, in mch_cpu.cpp's order (checked when made)
  std::vector<int64_t> min_counts;  // a table's lookups before a new id takes a row
  std::vector<int64_t> intervals;   // training steps between two eviction runs
  std::vector<int64_t> policies;    // 1 lfu, 2 lru, 3 distance-lfu of decay 1; 0: scored outside (mch_evict)
  std::vector<void*> data;          // the tensors' data pointers, read once (the tensors are held: they stay valid)
  MchState(std::vector<at::Tensor> t, std::vector<int64_t> m, std::vector<int64_t> i, std::vector<int64_t> p);
};

}  // namespace lightning_rec
