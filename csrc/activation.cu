// The codec decoder's pointwise ops, one pass over the data each:
//
//   snake(x, alpha, bias?, out):      out = s + sin(alpha_c s)^2 / (alpha_c + 1e-9),
//                                     s = x + bias_c (bias optional: a conv's bias folded in)
//   bias_residual(x, y, bias, out):   out = x + (y + bias_c)  (a residual unit's output, its
//                                     last conv's bias folded in)
//   snake_cat(tail, x, alpha, bias?, out):
//                                     out = [tail | snake(x + bias)] along T: a streaming
//                                     causal conv's input, built in one pass
//
// Unfused, torch runs the Snake as five elementwise kernels, three of them broadcasting alpha
// over [B, C, T] on torch's non-vectorised path (~23 ms of a 52 ms codec tick at 64 streams x
// 8 frames on the H200), and adds every cuDNN conv's bias as one more broadcast pass. These
// read each input once and write once, computing in float32.
//
// Contract (checked by the Python wrappers in engine/kernels/activation.py and again here):
//   x, y, out   [B, C, T]  bf16/fp16/fp32, either channels-first with the last dim contiguous
//                          (stride 1; any batch/channel strides: out may be a slice of a wider
//                          buffer), or all channels-last (stored as [B, T, C]: the layout
//                          of the codec's NHWC convs; x and y may be slices along T, out dense)
//   tail        [B, C, P]  (snake_cat) same dtype; channels-first: last dim contiguous, out
//                          then a contiguous [B, C, P + T]; channels-last x: any strides, out
//                          then a dense channels-last [B, C, P + T]
//   alpha, bias [C]        same dtype, contiguous
// float32 math in the reference's order (x + bias; reciprocal, then multiply, then add; no
// fused multiply-add), so float32 results equal torch's; bf16/fp16 round once instead of per op.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "check.cuh"

namespace {

enum Op { kSnake = 0, kBiasResidual = 1 };

// float32: sinf, as torch computes it (bit-equal results); bf16/fp16: the hardware sine
// (__sinf: absolute error 2^-21.4 on [-pi, pi], growing slowly beyond: far below the 8- or
// 11-bit mantissa the result is rounded to; with sinf's range reduction the channels-last
// Snake kernels ran at under half the copy bandwidth on the H200)
template <typename T>
__device__ __forceinline__ float snake1(float x, float a, float inv) {
  float s;
  if constexpr (std::is_same_v<T, float>) {
    s = sinf(__fmul_rn(a, x));
  } else {
    s = __sinf(__fmul_rn(a, x));
  }
  return __fadd_rn(x, __fmul_rn(inv, __fmul_rn(s, s)));
}

// 1 / (alpha + 1e-9), correctly rounded (= the IEEE division, without its slow path)
__device__ __forceinline__ float snake_inv(float a) { return __frcp_rn(__fadd_rn(a, 1e-9f)); }

struct Rows {  // a [B, C, T] operand: base pointer and batch/channel strides (last dim stride 1)
  const void* p;
  int64_t sb, sc;
};

struct Rows3 {  // a [B, C, T] operand with any strides
  const void* p;
  int64_t sb, sc, st;
};

// One thread per V consecutive elements of a row (V = 1, 2 or 16 bytes' worth); rows are the
// B*C (batch, channel) pairs, each T long.
template <typename T, int V, int OP>
__global__ void pointwise_kernel(Rows x, Rows y, const T* __restrict__ alpha,
                                 const T* __restrict__ bias, T* __restrict__ out,
                                 int64_t o_sb, int64_t o_sc, int64_t rows, int64_t C,
                                 int64_t T_len) {
  struct alignas(sizeof(T) * V) Pack { T v[V]; };
  const int64_t per_row = T_len / V;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= per_row * rows) return;
  const int64_t row = i / per_row, t = (i % per_row) * V;
  const int64_t b = row / C, c = row % C;
  const float bc = bias != nullptr ? static_cast<float>(bias[c]) : 0.f;
  const Pack in = *reinterpret_cast<const Pack*>(static_cast<const T*>(x.p) + b * x.sb +
                                                 c * x.sc + t);
  Pack res;
  if constexpr (OP == kSnake) {
    const float a = static_cast<float>(alpha[c]);
    const float inv = snake_inv(a);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float s = static_cast<float>(in.v[e]);
      if (bias != nullptr) s = static_cast<float>(static_cast<T>(__fadd_rn(s, bc)));
      res.v[e] = static_cast<T>(snake1<T>(s, a, inv));
    }
  } else {
    const Pack yv = *reinterpret_cast<const Pack*>(static_cast<const T*>(y.p) + b * y.sb +
                                                   c * y.sc + t);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      // the reference rounds the conv output + bias to T before the residual add
      const float yb = static_cast<float>(static_cast<T>(__fadd_rn(static_cast<float>(yv.v[e]), bc)));
      res.v[e] = static_cast<T>(__fadd_rn(static_cast<float>(in.v[e]), yb));
    }
  }
  *reinterpret_cast<Pack*>(out + b * o_sb + c * o_sc + t) = res;
}

// snake_cat as one flat pass over the contiguous out [B, C, P + T]: each thread stores V
// consecutive elements (16-byte stores however the rows fall: the codec's P is 1..54 and rows
// are P + T long, so a per-row layout would be 2-wide or scalar), reading tail and x element
// by element (a warp's reads of one element index stay within a few cache lines).
template <typename T, int V>
__global__ void snake_cat_kernel(Rows tail, Rows x, const T* __restrict__ alpha,
                                 const T* __restrict__ bias, T* __restrict__ out, int64_t C,
                                 int64_t P, int64_t T_len, int64_t n_vec) {
  struct alignas(sizeof(T) * V) Pack { T v[V]; };
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_vec) return;
  const int64_t L = P + T_len;
  int64_t row = (i * V) / L, col = (i * V) % L;
  int64_t b = row / C, c = row % C;
  float a = static_cast<float>(alpha[c]), inv = snake_inv(a);
  float bc = bias != nullptr ? static_cast<float>(bias[c]) : 0.f;
  Pack res;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    if (col < P) {
      res.v[e] = static_cast<const T*>(tail.p)[b * tail.sb + c * tail.sc + col];
    } else {
      float s = static_cast<float>(static_cast<const T*>(x.p)[b * x.sb + c * x.sc + col - P]);
      if (bias != nullptr) s = static_cast<float>(static_cast<T>(__fadd_rn(s, bc)));
      res.v[e] = static_cast<T>(snake1<T>(s, a, inv));
    }
    if (++col == L && e + 1 < V) {  // the next row: its channel's alpha and bias
      col = 0;
      if (++c == C) { c = 0; ++b; }
      a = static_cast<float>(alpha[c]);
      inv = snake_inv(a);
      bc = bias != nullptr ? static_cast<float>(bias[c]) : 0.f;
    }
  }
  *reinterpret_cast<Pack*>(out + i * V) = res;
}

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// Snake of V consecutive channels c0.. of one sample (+ their conv bias, rounded to T first)
template <typename T, int V, typename I>
__device__ __forceinline__ Vec<T, V> snake_vec(const Vec<T, V>& in, const T* __restrict__ alpha,
                                               const T* __restrict__ bias, I c0) {
  Vec<T, V> res;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const float a = static_cast<float>(alpha[c0 + e]);
    float s = static_cast<float>(in.v[e]);
    if (bias != nullptr) s = static_cast<float>(static_cast<T>(__fadd_rn(s, static_cast<float>(bias[c0 + e]))));
    res.v[e] = static_cast<T>(snake1<T>(s, a, snake_inv(a)));
  }
  return res;
}

// Channels-last: the tensors are [B, T, C] in memory (out dense; an input's streams may be
// further apart: a slice along T of a longer tensor), so an elementwise op is one flat pass
// over out whose channel is the flat index mod C; each thread handles V consecutive channels
// of one sample (C % V == 0: 16-byte loads and stores). I is the index type (32-bit where
// the tensors allow: 64-bit division costs more than the math).
template <typename T, int V, int OP, typename I>
__global__ void pointwise_cl_kernel(const T* __restrict__ x, const T* __restrict__ y,
                                    const T* __restrict__ alpha, const T* __restrict__ bias,
                                    T* __restrict__ out, I n_vec, I C, I TC, I x_sb, I y_sb) {
  using Pack = Vec<T, V>;
  const I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_vec) return;
  const I e0 = i * V, c0 = e0 % C, b = e0 / TC, r = e0 - b * TC;
  const Pack in = *reinterpret_cast<const Pack*>(x + b * x_sb + r);
  Pack res;
  if constexpr (OP == kSnake) {
    res = snake_vec<T, V, I>(in, alpha, bias, c0);
  } else {
    const Pack yv = *reinterpret_cast<const Pack*>(y + b * y_sb + r);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float yb = static_cast<float>(static_cast<T>(
          __fadd_rn(static_cast<float>(yv.v[e]), static_cast<float>(bias[c0 + e]))));
      res.v[e] = static_cast<T>(__fadd_rn(static_cast<float>(in.v[e]), yb));
    }
  }
  *reinterpret_cast<Pack*>(out + e0) = res;
}

// snake_cat channels-last: out is dense [B, P + T, C]; sample t < P of stream b comes from
// tail (any strides: the codec's saved tails are channels-first [B, C, P], a few samples),
// the rest is snake(x + bias) of the channels-last x.
template <typename T, int V, typename I>
__global__ void snake_cat_cl_kernel(Rows3 tail, const T* __restrict__ x,
                                    const T* __restrict__ alpha, const T* __restrict__ bias,
                                    T* __restrict__ out, I n_vec, I C, I P, I L, I x_sb) {
  using Pack = Vec<T, V>;
  const I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_vec) return;
  const I e0 = i * V, c0 = e0 % C, row = e0 / C;
  const I b = row / L, t = row % L;
  Pack res;
  if (t < P) {
    const T* tp = static_cast<const T*>(tail.p);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      res.v[e] = tp[b * tail.sb + (c0 + e) * tail.sc + t * tail.st];
    }
  } else {
    const Pack in = *reinterpret_cast<const Pack*>(x + b * x_sb + (t - P) * C + c0);
    res = snake_vec<T, V, I>(in, alpha, bias, c0);
  }
  *reinterpret_cast<Pack*>(out + e0) = res;
}

// The widest V (16 bytes, then 1) that divides C and the pointers' alignment.
template <typename T>
int cl_width(int64_t C, std::initializer_list<const torch::Tensor*> ts) {
  constexpr int kWide = 16 / sizeof(T);
  if (C % kWide != 0) return 1;
  for (const torch::Tensor* t : ts) {
    if (t != nullptr && (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0 ||
                         t->stride(0) % kWide != 0)) {
      return 1;
    }
  }
  return kWide;
}

// 32-bit indices below this: a thread's index i * V + V - 1 (the grid's last block rounds
// n / V up to 256 threads) stays clear of 2^31
constexpr int64_t kIndex32 = (1ll << 31) - (1 << 16);

// Calls launch(width, index) with width a std::integral_constant of the vector width v (16
// bytes' worth, or 1) and index a value of the index type (int32_t where `small`: the sizes
// and offsets stay below 2^31, else int64_t): the channels-last kernels' four variants.
template <typename T, typename F>
void for_width_and_index(int v, bool small, F&& launch) {
  constexpr int kWide = 16 / sizeof(T);
  if (v == kWide) {
    if (small) launch(std::integral_constant<int, kWide>{}, int32_t{});
    else launch(std::integral_constant<int, kWide>{}, int64_t{});
  } else {
    if (small) launch(std::integral_constant<int, 1>{}, int32_t{});
    else launch(std::integral_constant<int, 1>{}, int64_t{});
  }
}

template <typename T, int OP>
void launch_cl(const torch::Tensor& x, const torch::Tensor* y, const torch::Tensor* alpha,
               const torch::Tensor* bias, torch::Tensor& out) {
  const int64_t C = x.size(1), n = x.numel(), TC = x.size(2) * C;
  const T* yp = y != nullptr ? y->data_ptr<T>() : nullptr;
  const int64_t x_sb = x.stride(0), y_sb = y != nullptr ? y->stride(0) : 0;
  const int v = cl_width<T>(C, {&x, y, &out});
  const int threads = 256;
  const int64_t n_vec = n / v;
  const unsigned grid = static_cast<unsigned>((n_vec + threads - 1) / threads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const T* ap = alpha != nullptr ? alpha->data_ptr<T>() : nullptr;
  const T* bp = bias != nullptr ? bias->data_ptr<T>() : nullptr;
  const int64_t reach = std::max(x_sb, y_sb) * x.size(0);  // the largest offset read
  const bool small = std::max(n, reach) < kIndex32;
  for_width_and_index<T>(v, small, [&](auto width, auto index) {
    using I = decltype(index);
    pointwise_cl_kernel<T, decltype(width)::value, OP, I><<<grid, threads, 0, stream>>>(
        x.data_ptr<T>(), yp, ap, bp, out.data_ptr<T>(), static_cast<I>(n_vec),
        static_cast<I>(C), static_cast<I>(TC), static_cast<I>(x_sb), static_cast<I>(y_sb));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_snake_cat_cl(const torch::Tensor& tail, const torch::Tensor& x,
                         const torch::Tensor& alpha, const torch::Tensor* bias,
                         torch::Tensor& out) {
  const int64_t C = x.size(1), P = tail.size(2), L = out.size(2), n = out.numel();
  const int v = cl_width<T>(C, {&x, &out});
  const int threads = 256;
  const int64_t n_vec = n / v;
  const unsigned grid = static_cast<unsigned>((n_vec + threads - 1) / threads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const Rows3 tr{tail.data_ptr(), tail.stride(0), tail.stride(1), tail.stride(2)};
  const T* bp = bias != nullptr ? bias->data_ptr<T>() : nullptr;
  const int64_t tail_reach = (tail.size(0) - 1) * tail.stride(0) +
                             (tail.size(1) - 1) * tail.stride(1) + (P - 1) * tail.stride(2);
  const bool small = std::max({n, x.stride(0) * x.size(0), tail_reach}) < kIndex32;
  for_width_and_index<T>(v, small, [&](auto width, auto index) {
    using I = decltype(index);
    snake_cat_cl_kernel<T, decltype(width)::value, I><<<grid, threads, 0, stream>>>(
        tr, x.data_ptr<T>(), alpha.data_ptr<T>(), bp, out.data_ptr<T>(), static_cast<I>(n_vec),
        static_cast<I>(C), static_cast<I>(P), static_cast<I>(L), static_cast<I>(x.stride(0)));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// channels-last [B, C, T]: stored as [B, T, C] (dense: no gap between streams either)
bool is_cl(const torch::Tensor& t, bool dense = false) {
  const int64_t C = t.size(1), T_len = t.size(2);
  return C > 1 && T_len > 1 && t.stride(1) == 1 && t.stride(2) == C &&
         (dense ? t.stride(0) == C * T_len : t.stride(0) >= C * T_len);
}

template <typename T>
void launch_snake_cat(const torch::Tensor& tail, const torch::Tensor& x,
                      const torch::Tensor& alpha, const torch::Tensor* bias, torch::Tensor& out) {
  const int64_t C = x.size(1), P = tail.size(2), T_len = x.size(2), n = out.numel();
  constexpr int kWide = 16 / sizeof(T);
  const bool wide = n % kWide == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  const int v = wide ? kWide : 1;
  const int threads = 256;
  const int64_t n_vec = n / v;
  TORCH_CHECK(n_vec / threads < (1ll << 31), "snake_cat: tensor too large (",
              rtvoice::dims(out), ")");
  const unsigned grid = static_cast<unsigned>((n_vec + threads - 1) / threads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const Rows tr{tail.data_ptr(), tail.stride(0), tail.stride(1)};
  const Rows xr{x.data_ptr(), x.stride(0), x.stride(1)};
  const T* bp = bias != nullptr ? bias->data_ptr<T>() : nullptr;
  if (wide) {
    snake_cat_kernel<T, kWide><<<grid, threads, 0, stream>>>(
        tr, xr, alpha.data_ptr<T>(), bp, out.data_ptr<T>(), C, P, T_len, n_vec);
  } else {
    snake_cat_kernel<T, 1><<<grid, threads, 0, stream>>>(
        tr, xr, alpha.data_ptr<T>(), bp, out.data_ptr<T>(), C, P, T_len, n_vec);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
bool fits(const torch::Tensor& t, int v) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % (v * sizeof(T)) == 0 &&
         t.stride(0) % v == 0 && t.stride(1) % v == 0;
}

template <typename T, int OP>
void launch(const torch::Tensor& x, const torch::Tensor* y, const torch::Tensor* alpha,
            const torch::Tensor* bias, torch::Tensor& out) {
  const int64_t B = x.size(0), C = x.size(1), T_len = x.size(2);
  constexpr int kWide = 16 / sizeof(T);
  int v = 1;
  for (int cand : {kWide, 2}) {
    if (T_len % cand == 0 && fits<T>(x, cand) && fits<T>(out, cand) &&
        (y == nullptr || fits<T>(*y, cand))) {
      v = cand;
      break;
    }
  }
  const int threads = 256;
  const int64_t n = B * C * (T_len / v);  // threads needed
  TORCH_CHECK(n / threads < (1ll << 31), "codec pointwise op: tensor too large (",
              rtvoice::dims(x), ")");
  const unsigned grid = static_cast<unsigned>((n + threads - 1) / threads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const Rows xr{x.data_ptr(), x.stride(0), x.stride(1)};
  const Rows yr = y != nullptr ? Rows{y->data_ptr(), y->stride(0), y->stride(1)} : Rows{nullptr, 0, 0};
  const T* ap = alpha != nullptr ? alpha->data_ptr<T>() : nullptr;
  const T* bp = bias != nullptr ? bias->data_ptr<T>() : nullptr;
#define RTV_POINTWISE(V_)                                                                   \
  pointwise_kernel<T, V_, OP><<<grid, threads, 0, stream>>>(                                \
      xr, yr, ap, bp, out.data_ptr<T>(), out.stride(0), out.stride(1), B * C, C, T_len)
  if (v == kWide) {
    RTV_POINTWISE(kWide);
  } else if (v == 2) {
    RTV_POINTWISE(2);
  } else {
    RTV_POINTWISE(1);
  }
#undef RTV_POINTWISE
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_rows(const char* op, const torch::Tensor& x, const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == x.device(), op, ": ", name,
              " must be a CUDA tensor on x's device");
  TORCH_CHECK(t.dim() == 3 && t.sizes() == x.sizes(), op, ": ", name, " ", rtvoice::dims(t),
              " must match x ", rtvoice::dims(x));
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype");
}

// channels-first operands need a contiguous last dimension
void check_rows_cf(const char* op, const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() == 0 || t.stride(2) == 1, op, ": ", name, " must be dense "
              "channels-last like the other operands, or have a contiguous last dimension");
}

void check_channels(const char* op, const torch::Tensor& x, const torch::Tensor& t,
                    const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == x.device(), op, ": ", name,
              " must be a CUDA tensor on x's device");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(1) && t.is_contiguous(), op, ": ", name,
              " must be contiguous [C] with C = ", x.size(1), ", got ", rtvoice::dims(t));
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype");
}

template <int OP>
void dispatch(const torch::Tensor& x, const torch::Tensor* y, const torch::Tensor* alpha,
              const torch::Tensor* bias, torch::Tensor& out, const char* op) {
  const c10::cuda::CUDAGuard guard(x.device());
  const bool cl = is_cl(x) && is_cl(out, true) && (y == nullptr || is_cl(*y));
  if (!cl) {
    check_rows_cf(op, x, "x");
    check_rows_cf(op, out, "out");
    if (y != nullptr) check_rows_cf(op, *y, "y");
  }
  switch (x.scalar_type()) {
#define RTV_CASE(K, T)                                                    \
    case K:                                                               \
      if (cl) launch_cl<T, OP>(x, y, alpha, bias, out);                   \
      else launch<T, OP>(x, y, alpha, bias, out);                         \
      break;
    RTV_CASE(at::kFloat, float)
    RTV_CASE(at::kBFloat16, at::BFloat16)
    RTV_CASE(at::kHalf, at::Half)
#undef RTV_CASE
    default: TORCH_CHECK(false, op, ": dtype ", x.scalar_type(), " is not supported");
  }
}

}  // namespace

void snake(torch::Tensor x, torch::Tensor alpha, std::optional<torch::Tensor> bias,
           torch::Tensor out) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3, "snake: x must be a CUDA [B, C, T] tensor, got ",
              rtvoice::dims(x));
  check_rows("snake", x, out, "out");
  check_channels("snake", x, alpha, "alpha");
  if (bias.has_value()) check_channels("snake", x, *bias, "bias");
  if (x.numel() == 0) return;
  dispatch<kSnake>(x, nullptr, &alpha, bias.has_value() ? &*bias : nullptr, out, "snake");
}

void bias_residual(torch::Tensor x, torch::Tensor y, torch::Tensor bias, torch::Tensor out) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3,
              "bias_residual: x must be a CUDA [B, C, T] tensor, got ", rtvoice::dims(x));
  check_rows("bias_residual", x, y, "y");
  check_rows("bias_residual", x, out, "out");
  check_channels("bias_residual", x, bias, "bias");
  if (x.numel() == 0) return;
  dispatch<kBiasResidual>(x, &y, nullptr, &bias, out, "bias_residual");
}

void snake_cat(torch::Tensor tail, torch::Tensor x, torch::Tensor alpha,
               std::optional<torch::Tensor> bias, torch::Tensor out) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3, "snake_cat: x must be a CUDA [B, C, T] tensor, got ",
              rtvoice::dims(x));
  TORCH_CHECK(tail.is_cuda() && tail.device() == x.device() && tail.dim() == 3 &&
                  tail.size(0) == x.size(0) && tail.size(1) == x.size(1) &&
                  tail.scalar_type() == x.scalar_type(),
              "snake_cat: tail ", rtvoice::dims(tail), " must be a [B, C, P] tensor of x's batch, ",
              "channels, dtype and device (x ", rtvoice::dims(x), ")");
  TORCH_CHECK(out.is_cuda() && out.device() == x.device() &&
                  out.scalar_type() == x.scalar_type() && out.dim() == 3 &&
                  out.size(0) == x.size(0) && out.size(1) == x.size(1) &&
                  out.size(2) == tail.size(2) + x.size(2),
              "snake_cat: out must be a [B, C, P + T] tensor of x's dtype, got ",
              rtvoice::dims(out));
  check_channels("snake_cat", x, alpha, "alpha");
  if (bias.has_value()) check_channels("snake_cat", x, *bias, "bias");
  if (out.numel() == 0) return;
  const bool cl = x.numel() > 0 && is_cl(x) && is_cl(out, true);
  if (!cl) {
    TORCH_CHECK(x.numel() == 0 || x.stride(2) == 1,
                "snake_cat: x must be dense channels-last or have a contiguous last dimension");
    TORCH_CHECK(tail.numel() == 0 || tail.stride(2) == 1,
                "snake_cat: the last dimension of tail must be contiguous (channels-first x)");
    TORCH_CHECK(out.is_contiguous(), "snake_cat: out must be contiguous (channels-first x) "
                "or dense channels-last (channels-last x)");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const torch::Tensor* bp = bias.has_value() ? &*bias : nullptr;
  switch (x.scalar_type()) {
#define RTV_CASE(K, T)                                                    \
    case K:                                                               \
      if (cl) launch_snake_cat_cl<T>(tail, x, alpha, bp, out);            \
      else launch_snake_cat<T>(tail, x, alpha, bp, out);                  \
      break;
    RTV_CASE(at::kFloat, float)
    RTV_CASE(at::kBFloat16, at::BFloat16)
    RTV_CASE(at::kHalf, at::Half)
#undef RTV_CASE
    default: TORCH_CHECK(false, "snake_cat: dtype ", x.scalar_type(), " is not supported");
  }
}
