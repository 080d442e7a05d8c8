// LR_CHECK / LR_CHECK_VALUE: TORCH_CHECK / TORCH_CHECK_VALUE whose message is built without std::ostringstream.
//
// Why: built by a toolchain that links a private, static libstdc++ (`ldd` lists none), every TORCH_CHECK whose
// message formats a value segfaulted, while a check with one literal message threw cleanly (.ci/criteo_op_probe.py
// tells which calls crash). TORCH_CHECK formats its arguments through c10::str, i.e. a std::ostringstream of that
// private runtime; with one std::string argument c10::str returns it untouched. Linked with -static-libstdc++ on
// a healthy toolchain, the old messages lost their values ("got " for "got 1": .ci/static-libstdcxx). So the
// message is assembled from std::to_string and std::string alone, and only when the check fails (the macro
// evaluates it in that branch).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <type_traits>

namespace lightning_rec {

inline void append(std::string& s, const char* piece) { s += piece; }
inline void append(std::string& s, const std::string& piece) { s += piece; }
inline void append(std::string& s, char piece) { s += piece; }
inline void append(std::string& s, at::ScalarType type) { s += c10::toString(type); }
inline void append(std::string& s, at::IntArrayRef sizes) {
  s += '[';
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  s += ']';
}
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, char>, int> = 0>
inline void append(std::string& s, T value) {
  s += std::to_string(value);
}

template <typename... Pieces>
std::string message(const Pieces&... pieces) {
  std::string s;
  (append(s, pieces), ...);
  return s;
}

}  // namespace lightning_rec

#define LR_CHECK(cond, ...) TORCH_CHECK(cond, ::lightning_rec::message(__VA_ARGS__))
#define LR_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::lightning_rec::message(__VA_ARGS__))
