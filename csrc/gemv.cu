// gemv: y = x @ W^T for the few rows of a decode step (M <= 16), bf16 in and out, float32
// accumulation. At these shapes a linear layer is a stream over its weights; this kernel
// reads each weight once with 16-byte loads, keeps x in shared memory per block, and needs
// no split-K reduction kernel.
//
// Contract (checked by engine/kernels.py and again here):
//   x  [M, K] bfloat16, rows may be strided (row stride and base 16-byte aligned), M <= 16
//   W  [N, K] bfloat16, contiguous, 16-byte aligned
//   y  [M, N] bfloat16, contiguous
//   K % 8 == 0
// Each warp owns R consecutive output columns n (rows of W) and walks K in steps of 256
// (8 elements per lane); lanes are reduced with shuffles at the end.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

#include <cstdint>

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 1024;  // K elements of x staged in shared memory at a time

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <int MM, int R>  // MM: rows of x the kernel is built for (>= M); R: columns per warp
__global__ void __launch_bounds__(kThreads) gemv_kernel(
    const __nv_bfloat16* __restrict__ x, int64_t x_rs, const __nv_bfloat16* __restrict__ w,
    __nv_bfloat16* __restrict__ y, int M, int N, int K) {
  __shared__ __align__(16) __nv_bfloat16 xs[MM * kTile];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * kWarps + warp) * R;

  float acc[R][MM];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MM; ++m) acc[r][m] = 0.f;

  for (int k0 = 0; k0 < K; k0 += kTile) {
    const int tile = min(kTile, K - k0);
    const int vecs = tile / 8;
    __syncthreads();  // the previous tile is no longer read
    for (int i = threadIdx.x; i < M * vecs; i += kThreads) {
      const int m = i / vecs, c = i % vecs;
      reinterpret_cast<uint4*>(xs + m * kTile)[c] =
          *reinterpret_cast<const uint4*>(x + m * x_rs + k0 + c * 8);
    }
    __syncthreads();
#pragma unroll 2
    for (int kk = lane * 8; kk < tile; kk += 256) {
      uint4 wv[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int n = n0 + r;
        wv[r] = n < N ? __ldg(reinterpret_cast<const uint4*>(w + static_cast<int64_t>(n) * K +
                                                            k0 + kk))
                      : make_uint4(0, 0, 0, 0);
      }
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) unpack8(wv[r], wf[r]);
#pragma unroll
      for (int m = 0; m < MM; ++m) {
        if (m < M) {
          float xf[8];
          unpack8(reinterpret_cast<const uint4*>(xs + m * kTile)[kk / 8], xf);
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][m] += wf[r][e] * xf[e];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < MM; ++m) {
      float v = acc[r][m];
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
      if (lane == 0 && m < M && n0 + r < N)
        y[static_cast<int64_t>(m) * N + n0 + r] = __float2bfloat16(v);
    }
  }
}

template <int MM>
void launch_m(int R, dim3 grid, cudaStream_t s, const torch::Tensor& x, const torch::Tensor& w,
              torch::Tensor& y, int M, int N, int K) {
  const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const __nv_bfloat16*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<__nv_bfloat16*>(y.data_ptr<at::BFloat16>());
  switch (R) {
    case 1: gemv_kernel<MM, 1><<<grid, kThreads, 0, s>>>(xp, x.stride(0), wp, yp, M, N, K); break;
    case 2: gemv_kernel<MM, 2><<<grid, kThreads, 0, s>>>(xp, x.stride(0), wp, yp, M, N, K); break;
    default: gemv_kernel<MM, 4><<<grid, kThreads, 0, s>>>(xp, x.stride(0), wp, yp, M, N, K); break;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void gemv(torch::Tensor x, torch::Tensor w, torch::Tensor y) {
  TORCH_CHECK(x.is_cuda() && w.device() == x.device() && y.device() == x.device(),
              "gemv: CUDA tensors on one device expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                  y.scalar_type() == at::kBFloat16,
              "gemv: bfloat16 tensors expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && y.dim() == 2, "gemv: x [M, K], W [N, K], y [M, N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && y.size(0) == M && y.size(1) == N, "gemv: shapes do not agree: x ",
              x.sizes(), ", W ", w.sizes(), ", y ", y.sizes());
  TORCH_CHECK(M >= 1 && M <= 16 && K % 8 == 0, "gemv: needs 1 <= M <= 16 and K % 8 == 0");
  TORCH_CHECK(N >= 1, "gemv: W has no rows");
  TORCH_CHECK(w.is_contiguous() && y.is_contiguous() && x.stride(1) == 1 &&
                  (M == 1 || (x.stride(0) * 2) % 16 == 0) && aligned16(x.data_ptr()) &&
                  aligned16(w.data_ptr()),
              "gemv: W and y contiguous, x rows contiguous, 16-byte aligned");
  const c10::cuda::CUDAGuard guard(x.device());
  // columns per warp: as many as keep at least ~2 blocks per SM in flight
  const int R = N >= 8 * 4 * 264 ? 4 : (N >= 8 * 2 * 264 ? 2 : 1);
  const dim3 grid((N + kWarps * R - 1) / (kWarps * R));
  auto s = c10::cuda::getCurrentCUDAStream();
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  if (M <= 1) launch_m<1>(R, grid, s, x, w, y, m, n, k);
  else if (M <= 2) launch_m<2>(R, grid, s, x, w, y, m, n, k);
  else if (M <= 4) launch_m<4>(R, grid, s, x, w, y, m, n, k);
  else if (M <= 8) launch_m<8>(R, grid, s, x, w, y, m, n, k);
  else launch_m<16>(R, grid, s, x, w, y, m, n, k);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
