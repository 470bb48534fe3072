// Shapes in the kernels' error messages ("[2, 3]"), shared by every op's checks.
//
// (A crash on the device once blamed on streaming sizes() into TORCH_CHECK was the build's:
// a compiler that links a static copy of libstdc++ makes any message that formats a number
// crash the process. engine/kernels/toolchain.py keeps such compilers out of the build.)
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
