// sample_topk: the sampler's whole draw for one row per block, in one launch.
//
// Replaces torch.topk + softmax + gather + cumsum + masking + tempered softmax + the hashed
// exponential noise + argmax (~35 kernels per draw, ~6 compiled) with one kernel. The rule
// is engine/sampler.py's `sample`, which is the fallback and the reference:
//   K = min(128, V) best candidates (value descending, index ascending on ties);
//   top-p on the un-tempered softmax of the whole row, the best candidate always kept;
//   candidates past top_k removed; softmax of kept values / max(temperature, 1e-5);
//   race = p / E with E = -log(u), u from a hash of (seed, step, stream, index);
//   the argmax of the race (first on ties) is drawn; temperature <= 0 takes the best.
//
// Contract (checked by engine/kernels.py and again here):
//   logits       [B, V] float32 or bfloat16, rows may be strided, 1 <= V <= 8192
//   temperature  [B] float32;  top_p [B] float32;  top_k [B] int64 (1..128)
//   seed, step, stream  [B] int64
//   out          [B] int64
//   embed, embed_out  (optional, together) a table [R, D] (R >= V, contiguous) and [B, D]
//                of its dtype: the launch also copies row out[b] of the table to embed_out[b]
//                (the next position's input embedding: no lookup launch of its own); rows of
//                a multiple of 16 bytes, both 16-byte aligned
// Results equal the fallback's but for float rounding: the cumulative sum and the softmax
// are summed in another order, which can move a candidate across the top-p boundary or swap
// a near-tie of the race in rare rows.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "check.cuh"
#include "launch.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kMaxV = 8192;
constexpr int kK = 128;  // TOPK_MAX in engine/sampler.py
constexpr int kWarps = kThreads / 32;
constexpr int kLoads = kMaxV / kThreads;  // row elements a thread loads at once: all of them

__device__ __forceinline__ uint32_t order_key(float f) {
  // float -> uint32 with the same order (larger float, larger key); NaN sorts high
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t mix32(uint64_t x) {
  x &= 0xFFFFFFFFull;
  x ^= x >> 16;
  x = (x * 0x7FEB352Dull) & 0xFFFFFFFFull;
  x ^= x >> 15;
  x = (x * 0x846CA68Bull) & 0xFFFFFFFFull;
  return x ^ (x >> 16);
}

template <typename T>
__device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }

// Block-wide reductions over one float per thread (all threads must call).
__device__ float block_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float r = -INFINITY;
  for (int w = 0; w < kWarps; ++w) r = fmaxf(r, red[w]);
  return r;
}

__device__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float r = 0.f;
  for (int w = 0; w < kWarps; ++w) r += red[w];
  return r;
}

// Exclusive prefix sum of one int per thread, in thread order; returns the thread's offset
// and writes the block total to *total (all threads must call).
__device__ int block_exclusive_scan(int v, int* sm, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inc = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffff, inc, o);
    if (lane >= o) inc += n;
  }
  __syncthreads();
  if (lane == 31) sm[warp] = inc;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += sm[w];
    all += sm[w];
  }
  *total = all;
  return before + inc - v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sample_topk_kernel(
    const T* __restrict__ logits, int64_t row_stride, int V, const float* __restrict__ temperature,
    const float* __restrict__ top_p, const int64_t* __restrict__ top_k,
    const int64_t* __restrict__ seed, const int64_t* __restrict__ step,
    const int64_t* __restrict__ stream, int64_t* __restrict__ out,
    const uint4* __restrict__ embed, int64_t embed_row_vecs, uint4* __restrict__ embed_out) {
  __shared__ float xs[kMaxV];
  __shared__ float red[kWarps];
  __shared__ int ired[kWarps];
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_need;
  __shared__ float cv[kK];  // candidates: value, index
  __shared__ int ci[kK];
  __shared__ float cw[kK];  // race weights
  __shared__ float sv[kK];  // the candidates in rank order: value, index
  __shared__ int si[kK];
  __shared__ int s_drawn;  // the drawn index, for the embedding row copy

  const int b = blockIdx.x, tid = threadIdx.x;
  const T* row = logits + b * row_stride;
  const int K = V < kK ? V : kK;
  rtvoice::pdl_wait();  // (PDL) the logits and the draw's inputs come from the kernels before
  // the draw's parameters, loaded now (read by the last warp at the end): their round trip
  // overlaps the row's
  float temp_b = 0.f, top_p_b = 0.f;
  int64_t k_top = 0, seed_b = 0, stream_b = 0, step_b = 0;
  if (tid < 32) {
    temp_b = temperature[b];
    top_p_b = top_p[b];
    k_top = top_k[b];
    seed_b = seed[b];
    stream_b = stream[b];
    step_b = step[b];
  }

  // 1. the row, as float, and its softmax normaliser. A thread's loads are issued together
  //    (all of its up to kLoads elements, unrolled): one round trip, not one per element as
  //    a loop that stores each value before loading the next takes.
  float lmax = -INFINITY;
  for (int base = 0; base < V; base += kThreads * kLoads) {  // one trip (V <= kMaxV)
    float x[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = base + j * kThreads + tid;
      x[j] = i < V ? to_f(row[i]) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = base + j * kThreads + tid;
      if (i < V) {
        xs[i] = x[j] == 0.f ? 0.f : x[j];  // -0 as +0: one key for equal values
        lmax = fmaxf(lmax, x[j]);
      }
    }
  }
  const float mx = block_max(lmax, red);
  float lsum = 0.f;
  for (int i = tid; i < V; i += kThreads) lsum += expf(xs[i] - mx);
  const float total = block_sum(lsum, red);

  // 2. radix select: the key of the K-th largest value, 8 bits at a time from the top.
  //    Logits of one row share their top bits, so most keys of a pass fall into a few bins:
  //    the lanes of a warp that hit one bin add to it once (__match_any_sync; measured
  //    faster than a ballot per bin), not 32 times over one shared-memory address. The bin
  //    is then found by a parallel suffix sum over the 256 bins (thread i owns bin 255 - i)
  //    instead of a serial walk down from 255.
  if (tid == 0) {
    s_prefix = 0;
    s_need = K;
  }
  const int lane = tid % 32, warp = tid / 32;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kThreads) hist[i] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix;
    const int need = s_need;
    const uint32_t hi_mask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
    for (int base = 0; base < V; base += kThreads) {  // warp-uniform trip count
      const int i = base + tid;
      uint32_t bin = 256u;  // no bin: past the row, or outside the prefix
      if (i < V) {
        const uint32_t k = order_key(xs[i]);
        if ((k & hi_mask) == (prefix & hi_mask)) bin = (k >> shift) & 0xFFu;
      }
      const uint32_t peers = __match_any_sync(0xffffffffu, bin);  // the lanes with my bin
      if (bin < 256u && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
    }
    __syncthreads();
    // inclusive suffix sums S[b] = hist[b] + ... + hist[255]; the bin is the one with
    // S[b + 1] < need <= S[b] (exactly one: the keys under the prefix number >= need)
    int h = 0, inc = 0;
    if (tid < 256) {
      h = hist[255 - tid];
      inc = h;
      for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
      }
      if (lane == 31) ired[warp] = inc;
    }
    __syncthreads();
    if (tid < 256) {
      for (int w = 0; w < warp; ++w) inc += ired[w];
      if (inc - h < need && need <= inc) {
        s_prefix = prefix | (static_cast<uint32_t>(255 - tid) << shift);
        s_need = need - (inc - h);  // how many of the keys equal to the final prefix are taken
      }
    }
    __syncthreads();
  }
  const uint32_t kth = s_prefix;
  const int take_eq = s_need;

  // 3. gather the K candidates in index order: all keys > kth, then the first take_eq keys
  //    equal to kth (lowest indices first). Each thread owns a contiguous run of indices.
  const int per = (V + kThreads - 1) / kThreads;
  const int lo = tid * per, hi = min(V, lo + per);
  int n_gt = 0, n_eq = 0;
  for (int i = lo; i < hi; ++i) {
    const uint32_t k = order_key(xs[i]);
    n_gt += k > kth;
    n_eq += k == kth;
  }
  int all_gt, all_eq;
  int at_gt = block_exclusive_scan(n_gt, ired, &all_gt);
  int at_eq = block_exclusive_scan(n_eq, ired, &all_eq);
  for (int i = lo; i < hi; ++i) {
    const uint32_t k = order_key(xs[i]);
    if (k > kth) {
      cv[at_gt] = xs[i];
      ci[at_gt] = i;
      ++at_gt;
    } else if (k == kth) {
      if (at_eq < take_eq) {
        cv[all_gt + at_eq] = xs[i];
        ci[all_gt + at_eq] = i;
      }
      ++at_eq;
    }
  }
  for (int i = K + tid; i < kK; i += kThreads) {  // pad a short row to the sort's size
    cv[i] = -INFINITY;
    ci[i] = 0x7FFFFFFF;
  }
  __syncthreads();

  // 4. sort the kK slots (value descending, index ascending on ties; the slot breaks the
  //    padding's ties) by rank: slot i's rank is the number of slots ordered before it, a
  //    permutation of 0..kK-1 (the key order is total), counted by four adjacent
  //    threads over a quarter of the slots each (broadcast reads) — one barrier, where a
  //    bitonic network takes 28
  static_assert(kThreads == 4 * kK, "four threads rank each candidate slot");
  {
    const int slot = tid / 4, quarter = tid % 4;
    const float v = cv[slot];
    const int ix = ci[slot];
    const uint32_t kv = order_key(v);
    int rank = 0;
#pragma unroll 8
    for (int j = quarter * (kK / 4); j < (quarter + 1) * (kK / 4); ++j) {
      const float u = cv[j];
      const uint32_t ku = order_key(u);
      const int iu = ci[j];
      rank += ku > kv || (ku == kv && (iu < ix || (iu == ix && j < slot)));
    }
    rank += __shfl_xor_sync(0xffffffffu, rank, 1);
    rank += __shfl_xor_sync(0xffffffffu, rank, 2);
    if (quarter == 0) {
      sv[rank] = v;
      si[rank] = ix;
    }
  }
  __syncthreads();

  rtvoice::pdl_trigger();  // what is left is one warp's work: the next kernel may come in
  // 5. top-p / top-k masks, tempered softmax of the kept candidates, the race (one warp)
  if (tid < 32) {
    const float t = fmaxf(temp_b, 1e-5f), p_top = top_p_b;
    const uint64_t key0 = mix32(static_cast<uint64_t>(seed_b) * 0x9E3779B1ull +
                                static_cast<uint64_t>(stream_b) * 0x632BE5ABull);
    const uint64_t key = mix32(key0 + static_cast<uint64_t>(step_b) * 0x85EBCA77ull);
    // inclusive cumulative probability in rank order: each lane owns 4 consecutive ranks
    float pr[4], run = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = tid * 4 + j;
      pr[j] = r < K ? expf(sv[r] - mx) / total : 0.f;
      run += pr[j];
    }
    float inc = run;
    for (int o = 1; o < 32; o <<= 1) {
      const float n = __shfl_up_sync(0xffffffff, inc, o);
      if (tid >= o) inc += n;
    }
    float cum = inc - run;
    const float top = sv[0] / t;
    float best = -1.f;
    int best_r = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = tid * 4 + j;
      cum += pr[j];
      const bool keep = r < K && (r == 0 || cum <= p_top) && r < k_top;
      cw[r] = keep ? expf(sv[r] / t - top) : 0.f;
    }
    __syncwarp();
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) s += cw[tid * 4 + j];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = tid * 4 + j;
      if (cw[r] > 0.f) {
        const uint64_t x = mix32(key + static_cast<uint64_t>(si[r]) * 0xC2B2AE3Dull);
        // as engine/sampler.py: the top value would round to 1.0 (E = 0): clamp below 1
        const float u = fminf((static_cast<float>(x >> 8) + 0.5f) * (1.0f / 16777216.0f),
                              1.0f - 5.9604644775390625e-8f);
        const float race = (cw[r] / s) / (-logf(u));
        if (race > best) {  // ranks rise within a lane: the first maximum is kept
          best = race;
          best_r = r;
        }
      }
    }
    for (int o = 16; o > 0; o >>= 1) {  // warp argmax, lowest rank on ties
      const float ob = __shfl_xor_sync(0xffffffff, best, o);
      const int orr = __shfl_xor_sync(0xffffffff, best_r, o);
      if (ob > best || (ob == best && orr < best_r)) {
        best = ob;
        best_r = orr;
      }
    }
    if (tid == 0) {
      const int drawn = temp_b > 0.f ? si[best_r] : si[0];
      out[b] = drawn;
      s_drawn = drawn;
    }
  }
  // 6. (optional) the drawn row of the embedding table, 16 bytes per thread and step
  if (embed != nullptr) {  // uniform across the block
    __syncthreads();
    const uint4* src = embed + static_cast<int64_t>(s_drawn) * embed_row_vecs;
    uint4* dst = embed_out + static_cast<int64_t>(b) * embed_row_vecs;
    for (int64_t i = tid; i < embed_row_vecs; i += kThreads) dst[i] = src[i];
  }
}

}  // namespace

void sample_topk(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_p,
                 torch::Tensor top_k, torch::Tensor seed, torch::Tensor step,
                 torch::Tensor stream, torch::Tensor out, bool pdl,
                 std::optional<torch::Tensor> embed, std::optional<torch::Tensor> embed_out) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1,
              "sample_topk: logits must be a CUDA [B, V] tensor with contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1 && V <= kMaxV, "sample_topk: V must be in [1, ", kMaxV, "], got ", V);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat,
              "sample_topk: temperature and top_p must be float32");
  for (const auto* t : {&top_k, &seed, &step, &stream, &out})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == B && t->is_contiguous() &&
                    t->device() == logits.device(),
                "sample_topk: top_k, seed, step, stream and out must be int64 [B] on the device");
  TORCH_CHECK(temperature.numel() == B && top_p.numel() == B && temperature.is_contiguous() &&
                  top_p.is_contiguous(),
              "sample_topk: temperature and top_p must be contiguous [B]");
  TORCH_CHECK(embed.has_value() == embed_out.has_value(),
              "sample_topk: embed and embed_out go together");
  const uint4* table = nullptr;
  uint4* rows = nullptr;
  int64_t row_vecs = 0;
  if (embed.has_value()) {
    const auto& e = *embed;
    const auto& eo = *embed_out;
    TORCH_CHECK(e.dim() == 2 && e.is_contiguous() && e.device() == logits.device() &&
                    e.size(0) >= V,
                "sample_topk: embed must be a contiguous [R, D] table on the logits' device "
                "with R >= V (every drawable index a row), got ", rtvoice::dims(e));
    TORCH_CHECK(eo.dim() == 2 && eo.is_contiguous() && eo.size(0) == B &&
                    eo.size(1) == e.size(1) && eo.scalar_type() == e.scalar_type() &&
                    eo.device() == logits.device(),
                "sample_topk: embed_out must be a contiguous [B, D] tensor of embed's dtype");
    const int64_t row_bytes = e.size(1) * e.element_size();
    TORCH_CHECK(row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(e.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(eo.data_ptr()) % 16 == 0,
                "sample_topk: embedding rows must be a multiple of 16 bytes, 16-byte aligned");
    table = reinterpret_cast<const uint4*>(e.data_ptr());
    rows = reinterpret_cast<uint4*>(eo.data_ptr());
    row_vecs = row_bytes / 16;
  }
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  auto s = c10::cuda::getCurrentCUDAStream();
  pdl = pdl && rtvoice::pdl_device(logits.get_device());
#define RTV_SAMPLE(T_)                                                                        \
  rtvoice::launch_kernel(sample_topk_kernel<T_>, dim3(static_cast<unsigned>(B)),            \
      dim3(kThreads), 0, s, pdl,                                                              \
      logits.data_ptr<T_>(), logits.stride(0), static_cast<int>(V),                           \
      temperature.data_ptr<float>(), top_p.data_ptr<float>(), top_k.data_ptr<int64_t>(),      \
      seed.data_ptr<int64_t>(), step.data_ptr<int64_t>(), stream.data_ptr<int64_t>(),         \
      out.data_ptr<int64_t>(), table, row_vecs, rows)
  switch (logits.scalar_type()) {
    case at::kFloat: RTV_SAMPLE(float); break;
    case at::kBFloat16: RTV_SAMPLE(at::BFloat16); break;
    default: TORCH_CHECK(false, "sample_topk: logits must be float32 or bfloat16");
  }
#undef RTV_SAMPLE
}
