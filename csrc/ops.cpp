// The one registration file for rtvoice's CUDA kernels: every op is declared here under the
// `rtvoice_kernels` namespace and implemented for CUDA in its own .cu file.
#include <torch/extension.h>
#include <torch/library.h>

void prev_tokens_shift_inplace(torch::Tensor prev, torch::Tensor next_tokens);

TORCH_LIBRARY(rtvoice_kernels, m) {
  m.def("prev_tokens_shift_inplace(Tensor(a!) prev, Tensor next_tokens) -> ()");
}

TORCH_LIBRARY_IMPL(rtvoice_kernels, CUDA, m) {
  m.impl("prev_tokens_shift_inplace", &prev_tokens_shift_inplace);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
