// prev_tokens_shift_inplace: the repetition window of the decode step, on the device.
//
// Contract (strict, checked by the Python wrapper and again here):
//   prev         int32 [bs, W, cw]  contiguous, modified in place
//   next_tokens  int32 [bs, cw]     contiguous
// For every (b, c): prev[b, 0:W-1, c] = prev[b, 1:W, c]; prev[b, W-1, c] = next_tokens[b, c].
// A silent reshape or dtype promotion here corrupts the window and sounds like a worse
// model (speaker drift), so nothing is converted: wrong inputs fail loudly.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "check.cuh"

namespace {

__global__ void prev_tokens_shift_kernel(int32_t* __restrict__ prev,
                                         const int32_t* __restrict__ next_tokens, int64_t bs,
                                         int64_t window, int64_t cw) {
  // One thread per (b, c) column; the window is short (10..16), walked sequentially.
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= bs * cw) return;
  const int64_t b = i / cw;
  const int64_t c = i % cw;
  int32_t* col = prev + b * window * cw + c;
  for (int64_t w = 0; w + 1 < window; ++w) col[w * cw] = col[(w + 1) * cw];
  col[(window - 1) * cw] = next_tokens[b * cw + c];
}

}  // namespace

void prev_tokens_shift_inplace(torch::Tensor prev, torch::Tensor next_tokens) {
  TORCH_CHECK(prev.is_cuda() && next_tokens.is_cuda(), "prev_tokens_shift_inplace: CUDA tensors expected");
  TORCH_CHECK(prev.device() == next_tokens.device(), "prev_tokens_shift_inplace: tensors on different devices");
  TORCH_CHECK(prev.scalar_type() == at::kInt, "prev must be int32, got ", prev.scalar_type());
  TORCH_CHECK(next_tokens.scalar_type() == at::kInt, "next_tokens must be int32, got ", next_tokens.scalar_type());
  TORCH_CHECK(prev.dim() == 3, "prev must be [bs, W, cw], got ", rtvoice::dims(prev));
  TORCH_CHECK(next_tokens.dim() == 2, "next_tokens must be [bs, cw], got ", rtvoice::dims(next_tokens));
  TORCH_CHECK(prev.size(0) == next_tokens.size(0) && prev.size(2) == next_tokens.size(1),
              "shape mismatch: prev ", rtvoice::dims(prev), " vs next_tokens ", rtvoice::dims(next_tokens));
  TORCH_CHECK(prev.is_contiguous() && next_tokens.is_contiguous(), "inputs must be contiguous");
  const int64_t bs = prev.size(0), window = prev.size(1), cw = prev.size(2);
  if (bs == 0 || window == 0 || cw == 0) return;
  const c10::cuda::CUDAGuard guard(prev.device());
  const int threads = 128;
  const int64_t blocks = (bs * cw + threads - 1) / threads;
  prev_tokens_shift_kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      prev.data_ptr<int32_t>(), next_tokens.data_ptr<int32_t>(), bs, window, cw);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
