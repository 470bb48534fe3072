// Shapes in the kernels' error messages ("[2, 3]"), shared by every op's checks.
//
// Streaming an IntArrayRef into TORCH_CHECK's message (`<< t.sizes()`) crashed the process
// (SIGSEGV) instead of raising, in this extension built by nvcc against torch 2.11 on the
// H200 (2026-12-05: checks that print only names and dtypes raised as they should), so the
// messages print shapes through this string instead.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstddef>
#include <string>

namespace rtvoice {

inline std::string dims(c10::IntArrayRef a) {
  std::string s = "[";
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(a[i]);
  }
  return s + "]";
}

inline std::string dims(const at::Tensor& t) { return dims(t.sizes()); }

}  // namespace rtvoice
