// snake: the codec decoder's activation, y = x + sin(alpha_c x)^2 / (alpha_c + 1e-9), in one
// pass over the data.
//
// Unfused, torch runs it as five elementwise kernels, three of them broadcasting alpha over
// [B, C, T] on torch's non-vectorised path: at 64 streams x 8 frames they were ~23 ms of a
// 52 ms codec tick. This kernel reads x once and writes y once, computing in float32.
//
// Contract (checked by the Python wrapper engine/kernels.py and again here):
//   x      [B, C, T]  bf16/fp16/fp32, last dim contiguous (stride 1), any batch/channel strides
//   alpha  [C]        same dtype, contiguous
//   out    [B, C, T]  same dtype, last dim contiguous, any batch/channel strides: it may be a
//                     slice of a wider buffer, e.g. the new-sample part of a causal conv's
//                     [tail | new] input, which saves the concatenation's copy
// float32 math in the reference's order (reciprocal, then multiply, then add; no fused
// multiply-add), so float32 results equal torch's; bf16/fp16 round once instead of per op.

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

namespace {

template <typename T>
__device__ __forceinline__ float snake1(T xv, float a, float inv) {
  const float x = static_cast<float>(xv);
  const float s = sinf(__fmul_rn(a, x));
  return __fadd_rn(x, __fmul_rn(inv, __fmul_rn(s, s)));
}

// One thread per V consecutive elements of a row (V = 1, 2 or 16 bytes' worth); rows are the
// B*C (batch, channel) pairs, each T long.
template <typename T, int V>
__global__ void snake_kernel(const T* __restrict__ x, int64_t x_sb, int64_t x_sc,
                             const T* __restrict__ alpha, T* __restrict__ out, int64_t o_sb,
                             int64_t o_sc, int64_t rows, int64_t C, int64_t T_len) {
  struct alignas(sizeof(T) * V) Pack { T v[V]; };
  const int64_t per_row = T_len / V;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= per_row * rows) return;
  const int64_t row = i / per_row, t = (i % per_row) * V;
  const int64_t b = row / C, c = row % C;
  const float a = static_cast<float>(alpha[c]);
  const float inv = 1.f / (a + 1e-9f);
  const Pack in = *reinterpret_cast<const Pack*>(x + b * x_sb + c * x_sc + t);
  Pack y;
#pragma unroll
  for (int e = 0; e < V; ++e) y.v[e] = static_cast<T>(snake1(in.v[e], a, inv));
  *reinterpret_cast<Pack*>(out + b * o_sb + c * o_sc + t) = y;
}

template <typename T>
bool fits(const torch::Tensor& t, int v) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % (v * sizeof(T)) == 0 &&
         t.stride(0) % v == 0 && t.stride(1) % v == 0;
}

template <typename T>
void launch(const torch::Tensor& x, const torch::Tensor& alpha, torch::Tensor& out) {
  const int64_t B = x.size(0), C = x.size(1), T_len = x.size(2);
  constexpr int kWide = 16 / sizeof(T);
  int v = 1;
  for (int cand : {kWide, 2}) {
    if (T_len % cand == 0 && fits<T>(x, cand) && fits<T>(out, cand)) {
      v = cand;
      break;
    }
  }
  const int threads = 256;
  const int64_t n = B * C * (T_len / v);  // threads needed
  TORCH_CHECK(n / threads < (1ll << 31), "snake: tensor too large (", x.sizes(), ")");
  const unsigned grid = static_cast<unsigned>((n + threads - 1) / threads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (v == kWide) {
    snake_kernel<T, kWide><<<grid, threads, 0, stream>>>(
        x.data_ptr<T>(), x.stride(0), x.stride(1), alpha.data_ptr<T>(), out.data_ptr<T>(),
        out.stride(0), out.stride(1), B * C, C, T_len);
  } else if (v == 2) {
    snake_kernel<T, 2><<<grid, threads, 0, stream>>>(
        x.data_ptr<T>(), x.stride(0), x.stride(1), alpha.data_ptr<T>(), out.data_ptr<T>(),
        out.stride(0), out.stride(1), B * C, C, T_len);
  } else {
    snake_kernel<T, 1><<<grid, threads, 0, stream>>>(
        x.data_ptr<T>(), x.stride(0), x.stride(1), alpha.data_ptr<T>(), out.data_ptr<T>(),
        out.stride(0), out.stride(1), B * C, C, T_len);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void snake(torch::Tensor x, torch::Tensor alpha, torch::Tensor out) {
  TORCH_CHECK(x.is_cuda() && alpha.is_cuda() && out.is_cuda(), "snake: CUDA tensors expected");
  TORCH_CHECK(x.device() == alpha.device() && x.device() == out.device(),
              "snake: tensors on different devices");
  TORCH_CHECK(x.dim() == 3 && out.dim() == 3, "snake: x and out must be [B, C, T], got ",
              x.sizes(), " and ", out.sizes());
  TORCH_CHECK(x.sizes() == out.sizes(), "snake: out ", out.sizes(), " must match x ", x.sizes());
  TORCH_CHECK(alpha.dim() == 1 && alpha.size(0) == x.size(1) && alpha.is_contiguous(),
              "snake: alpha must be contiguous [C] with C = ", x.size(1), ", got ", alpha.sizes());
  TORCH_CHECK(x.scalar_type() == alpha.scalar_type() && x.scalar_type() == out.scalar_type(),
              "snake: x, alpha and out must share a dtype");
  TORCH_CHECK(x.numel() == 0 || (x.stride(2) == 1 && out.stride(2) == 1),
              "snake: the last dimension of x and out must be contiguous");
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  switch (x.scalar_type()) {
    case at::kFloat: launch<float>(x, alpha, out); break;
    case at::kBFloat16: launch<at::BFloat16>(x, alpha, out); break;
    case at::kHalf: launch<at::Half>(x, alpha, out); break;
    default: TORCH_CHECK(false, "snake: dtype ", x.scalar_type(), " is not supported");
  }
}
