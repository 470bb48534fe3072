// The decode step's per-row bookkeeping (engine/bookkeeping.py's functions), one launch each.
//
// Compiled by inductor, these small functions became one kernel per output size: the draw's
// inputs for the main token and its RAS candidate 6 launches, the frame's token ids and the
// fast AR's first input 3, the rows' state after the frame 6 — 15 of a batch-1 frame step's
// ~400 launches, each a microsecond of work behind a launch. Here each is one launch with the
// same results (integer and copy work only: bit-equal to the torch functions).
//
// Contracts (checked by the Python wrapper, engine/kernels/step_book.py, and again here):
//   book_ras_inputs  logits [B, V] (rows of stride >= V, unit element stride; f32/bf16/f16),
//                    temperature, ras_temperature, top_p, ras_top_p float32 [B], top_k, seed,
//                    step int64 [B] (all contiguous) -> out_logits [2B, V] contiguous (logits'
//                    dtype), out_t, out_p float32 [2B], out_k, out_seed, out_step int64 [2B]:
//                    rows 0..B-1 the main draw's, rows B..2B-1 the RAS draw's (its temperature
//                    0 where the main one is 0: greedy stays greedy), logits and ids repeated.
//   book_frame_tokens idx int64 [B] (the main draw over [semantic 0..n-1, <|im_end|>]), table
//                    [R, D], h [B, D] (same dtype, rows contiguous) -> token, code int64 [B],
//                    x [B, 2, D] contiguous: token = idx + semantic_start if idx < n else
//                    im_end; code = idx if idx < n else 0; x[b] = [h[b], table[code[b]]]
//                    (a code outside [0, R), which no draw gives, makes a zero row: no read
//                    out of bounds).
//   book_step_end    columns: 1+K int64 [B] tensors (contiguous), was bool [B], next_col int64
//                    [B, 1+K] (unit column stride), pos, frames_left int64 [B], active bool [B],
//                    draw_step int64 [B] (contiguous; the last five updated in place), im_end
//                    -> out int64 [B, 1+K+2] contiguous: the frame, was, stopped (as step_end).

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <utility>
#include <vector>

#include "check.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxColumns = 32;

template <typename T>
__global__ void ras_inputs_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t V,
                                  int64_t B, const float* __restrict__ temperature,
                                  const float* __restrict__ ras_temperature,
                                  const float* __restrict__ top_p,
                                  const float* __restrict__ ras_top_p,
                                  const int64_t* __restrict__ top_k,
                                  const int64_t* __restrict__ seed,
                                  const int64_t* __restrict__ step, T* __restrict__ out_logits,
                                  float* __restrict__ out_t, float* __restrict__ out_p,
                                  int64_t* __restrict__ out_k, int64_t* __restrict__ out_seed,
                                  int64_t* __restrict__ out_step) {
  // block r: output row r of 2B, reading input row r mod B
  const int64_t r = blockIdx.x;
  const int64_t b = r < B ? r : r - B;
  const T* src = logits + b * row_stride;
  T* dst = out_logits + r * V;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) dst[i] = src[i];
  if (threadIdx.x == 0) {
    const float t = temperature[b];
    out_t[r] = r < B ? t : (t == 0.0f ? 0.0f : ras_temperature[b]);
    out_p[r] = r < B ? top_p[b] : ras_top_p[b];
    out_k[r] = top_k[b];
    out_seed[r] = seed[b];
    out_step[r] = step[b];
  }
}

template <typename T>
__global__ void frame_tokens_kernel(const int64_t* __restrict__ idx, const T* __restrict__ table,
                                    int64_t R, const T* __restrict__ h, int64_t h_stride,
                                    int64_t D, int64_t n_semantic, int64_t semantic_start,
                                    int64_t im_end, int64_t* __restrict__ token,
                                    int64_t* __restrict__ code, T* __restrict__ x) {
  // block b: row b's ids and its fast-AR input [h[b], table[code]]
  const int64_t b = blockIdx.x;
  const int64_t i = idx[b];
  const bool semantic = i < n_semantic;
  const int64_t c = semantic ? i : 0;
  if (threadIdx.x == 0) {
    token[b] = semantic ? i + semantic_start : im_end;
    code[b] = c;
  }
  const bool valid = c >= 0 && c < R;
  const T* hb = h + b * h_stride;
  const T* row = table + (valid ? c : 0) * D;
  T* xb = x + b * 2 * D;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    xb[j] = hb[j];
    xb[D + j] = valid ? row[j] : T(0);
  }
}

struct Columns {
  const int64_t* p[kMaxColumns];
};

__global__ void step_end_kernel(Columns cols, int n_cols, const bool* __restrict__ was,
                                int64_t* __restrict__ next_col, int64_t next_stride,
                                int64_t* __restrict__ pos, int64_t* __restrict__ frames_left,
                                bool* __restrict__ active, int64_t* __restrict__ draw_step,
                                int64_t im_end, int64_t B, int64_t* __restrict__ out) {
  // one thread per row
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const bool w = was[b];
  int64_t* o = out + b * (n_cols + 2);
  for (int c = 0; c < n_cols; ++c) {
    const int64_t f = cols.p[c][b];
    o[c] = f;
    if (w) next_col[b * next_stride + c] = f;
  }
  int64_t left = frames_left[b];
  if (w) {
    pos[b] += 1;
    left -= 1;
    frames_left[b] = left;
  }
  draw_step[b] += 1;
  const bool stop = w && (o[0] == im_end || left <= 0);
  active[b] = w && !stop;
  o[n_cols] = w ? 1 : 0;
  o[n_cols + 1] = stop ? 1 : 0;
}

void check_vec(const torch::Tensor& t, const torch::Tensor& like, int64_t n, at::ScalarType dt,
               const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), op, ": ", name,
              " must be on ", like.device().str());
  TORCH_CHECK(t.scalar_type() == dt, op, ": ", name, " must be ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.is_contiguous(), op, ": ", name,
              " must be a contiguous [", n, "] tensor, got ", rtvoice::dims(t));
}

}  // namespace

void book_ras_inputs(torch::Tensor logits, torch::Tensor temperature,
                     torch::Tensor ras_temperature, torch::Tensor top_p, torch::Tensor ras_top_p,
                     torch::Tensor top_k, torch::Tensor seed, torch::Tensor step,
                     torch::Tensor out_logits, torch::Tensor out_t, torch::Tensor out_p,
                     torch::Tensor out_k, torch::Tensor out_seed, torch::Tensor out_step) {
  const char* op = "book_ras_inputs";
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1, op,
              ": logits must be a CUDA [B, V] tensor with unit column stride, got ",
              rtvoice::dims(logits), " strides ", rtvoice::dims(logits.strides()));
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(B < (1 << 30), op, ": too many rows (", B, ")");
  for (auto [t, name] : {std::pair{temperature, "temperature"},
                         {ras_temperature, "ras_temperature"}, {top_p, "top_p"},
                         {ras_top_p, "ras_top_p"}})
    check_vec(t, logits, B, at::kFloat, op, name);
  for (auto [t, name] : {std::pair{top_k, "top_k"}, {seed, "seed"}, {step, "step"}})
    check_vec(t, logits, B, at::kLong, op, name);
  TORCH_CHECK(out_logits.is_cuda() && out_logits.device() == logits.device() &&
                  out_logits.scalar_type() == logits.scalar_type() && out_logits.dim() == 2 &&
                  out_logits.size(0) == 2 * B && out_logits.size(1) == V &&
                  out_logits.is_contiguous(),
              op, ": out_logits must be a contiguous [2B, V] tensor of logits' dtype, got ",
              rtvoice::dims(out_logits));
  check_vec(out_t, logits, 2 * B, at::kFloat, op, "out_t");
  check_vec(out_p, logits, 2 * B, at::kFloat, op, "out_p");
  check_vec(out_k, logits, 2 * B, at::kLong, op, "out_k");
  check_vec(out_seed, logits, 2 * B, at::kLong, op, "out_seed");
  check_vec(out_step, logits, 2 * B, at::kLong, op, "out_step");
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto dtype = logits.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "book_ras_inputs", [&] {
    ras_inputs_kernel<scalar_t><<<static_cast<unsigned>(2 * B), kThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), logits.stride(0), V, B, temperature.data_ptr<float>(),
        ras_temperature.data_ptr<float>(), top_p.data_ptr<float>(),
        ras_top_p.data_ptr<float>(), top_k.data_ptr<int64_t>(), seed.data_ptr<int64_t>(),
        step.data_ptr<int64_t>(), out_logits.data_ptr<scalar_t>(), out_t.data_ptr<float>(),
        out_p.data_ptr<float>(), out_k.data_ptr<int64_t>(), out_seed.data_ptr<int64_t>(),
        out_step.data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void book_frame_tokens(torch::Tensor idx, torch::Tensor table, torch::Tensor h,
                       int64_t n_semantic, int64_t semantic_start, int64_t im_end,
                       torch::Tensor token, torch::Tensor code, torch::Tensor x) {
  const char* op = "book_frame_tokens";
  TORCH_CHECK(idx.is_cuda() && idx.dim() == 1, op, ": idx must be a CUDA [B] tensor");
  const int64_t B = idx.size(0);
  TORCH_CHECK(B < (1 << 30), op, ": too many rows (", B, ")");
  check_vec(idx, idx, B, at::kLong, op, "idx");
  TORCH_CHECK(table.is_cuda() && table.device() == idx.device() && table.dim() == 2 &&
                  table.is_contiguous(),
              op, ": table must be a contiguous CUDA [R, D] tensor, got ", rtvoice::dims(table));
  const int64_t R = table.size(0), D = table.size(1);
  TORCH_CHECK(h.is_cuda() && h.device() == idx.device() && h.dim() == 2 && h.size(0) == B &&
                  h.size(1) == D && h.stride(1) == 1 && h.scalar_type() == table.scalar_type(),
              op, ": h must be a [B, D] = [", B, ", ", D, "] tensor of table's dtype with unit "
              "column stride, got ", rtvoice::dims(h), " ", h.scalar_type());
  check_vec(token, idx, B, at::kLong, op, "token");
  check_vec(code, idx, B, at::kLong, op, "code");
  TORCH_CHECK(x.is_cuda() && x.device() == idx.device() && x.scalar_type() == h.scalar_type() &&
                  x.dim() == 3 && x.size(0) == B && x.size(1) == 2 && x.size(2) == D &&
                  x.is_contiguous(),
              op, ": x must be a contiguous [B, 2, D] tensor of h's dtype, got ", rtvoice::dims(x));
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(idx.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto dtype = h.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "book_frame_tokens", [&] {
    frame_tokens_kernel<scalar_t><<<static_cast<unsigned>(B), kThreads, 0, stream>>>(
        idx.data_ptr<int64_t>(), table.data_ptr<scalar_t>(), R, h.data_ptr<scalar_t>(),
        h.stride(0), D, n_semantic, semantic_start, im_end, token.data_ptr<int64_t>(),
        code.data_ptr<int64_t>(), x.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void book_step_end(std::vector<torch::Tensor> columns, torch::Tensor was, torch::Tensor next_col,
                   torch::Tensor pos, torch::Tensor frames_left, torch::Tensor active,
                   torch::Tensor draw_step, int64_t im_end, torch::Tensor out) {
  const char* op = "book_step_end";
  TORCH_CHECK(was.is_cuda() && was.dim() == 1, op, ": was must be a CUDA [B] tensor");
  const int64_t B = was.size(0);
  const int n = static_cast<int>(columns.size());
  TORCH_CHECK(n >= 1 && n <= kMaxColumns, op, ": 1..", kMaxColumns, " columns, got ", n);
  check_vec(was, was, B, at::kBool, op, "was");
  Columns cols{};
  for (int c = 0; c < n; ++c) {
    check_vec(columns[c], was, B, at::kLong, op, "a column");
    cols.p[c] = columns[c].data_ptr<int64_t>();
  }
  TORCH_CHECK(next_col.is_cuda() && next_col.device() == was.device() &&
                  next_col.scalar_type() == at::kLong && next_col.dim() == 2 &&
                  next_col.size(0) == B && next_col.size(1) == n && next_col.stride(1) == 1 &&
                  (B <= 1 || next_col.stride(0) >= n),
              op, ": next_col must be an int64 [B, ", n, "] tensor with unit column stride and "
              "rows apart, got ",
              rtvoice::dims(next_col));
  check_vec(pos, was, B, at::kLong, op, "pos");
  check_vec(frames_left, was, B, at::kLong, op, "frames_left");
  check_vec(active, was, B, at::kBool, op, "active");
  check_vec(draw_step, was, B, at::kLong, op, "draw_step");
  TORCH_CHECK(out.is_cuda() && out.device() == was.device() && out.scalar_type() == at::kLong &&
                  out.dim() == 2 && out.size(0) == B && out.size(1) == n + 2 &&
                  out.is_contiguous(),
              op, ": out must be a contiguous int64 [B, ", n + 2, "] tensor, got ",
              rtvoice::dims(out));
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(was.device());
  const int threads = 128;
  const auto blocks = static_cast<unsigned>((B + threads - 1) / threads);
  step_end_kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      cols, n, was.data_ptr<bool>(), next_col.data_ptr<int64_t>(), next_col.stride(0),
      pos.data_ptr<int64_t>(), frames_left.data_ptr<int64_t>(), active.data_ptr<bool>(),
      draw_step.data_ptr<int64_t>(), im_end, B, out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
