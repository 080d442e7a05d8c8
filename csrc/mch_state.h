// A managed-collision table group's state tensors, handed to C++ once (lightning_rec/managed_collision/mch.py's
// TableGroup): a step's call then passes one object instead of 11 tensors a table, each converted on every call.
#pragma once

#include <torch/custom_class.h>

#include <cstdint>
#include <vector>

namespace lightning_rec {

struct MchState : torch::CustomClassHolder {
  std::vector<at::Tensor> tensors;  // 11 a table, in mch_cpu.cpp's order (checked when made)
  std::vector<int64_t> min_counts;  // a table's lookups before a new id takes a row
  MchState(std::vector<at::Tensor> t, std::vector<int64_t> m);
};

}  // namespace lightning_rec
