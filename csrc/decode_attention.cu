// decode_attention: one new query position per row, grouped-query attention over the row's
// paged KV blocks, with this position's key/value written into the cache by the same launch.
//
// Replaces, per layer and step, the two index_put writes of the new k/v plus the attention
// itself (which for a bool mask + GQA is torch's multi-kernel math path) with one kernel.
//
// Contract (checked by the Python wrapper engine/kernels.py and again here):
//   q        [B, H, D]        bf16/fp16/fp32, rows may be strided (heads and dims packed)
//   k_new    [B, Hkv, D]      same dtype, rows may be strided
//   v_new    [B, Hkv, D]      same dtype, rows may be strided
//   k_cache  [N, Hkv, BS, D]  same dtype, contiguous: N blocks of BS positions, written at
//   v_cache  [N, Hkv, BS, D]  (wblock[b], :, pos[b] % BS)
//   table    [B, MB] int64    row b's blocks: its position t lives at (table[b, t / BS], t % BS)
//   wblock   [B] int64        block each row writes pos[b] into (0 <= wblock < N): its own
//                             table[b, pos[b] / BS], or a block no row of this launch reads
//                             (a scratch block, for rows that only pad the batch)
//   pos      [B] int64        each row's position (0 <= pos < MB * BS; not checked on device)
//   out      [B, H, D]        same dtype, rows may be strided (heads and dims packed): one
//                             position of a [B, T, H, D] output written per launch
// or, for two new positions per row (the fast AR's first call: positions 0 and 1 of a frame),
//   q, out [B, 2, H, D], k_new, v_new [B, 2, Hkv, D] (bf16/fp16; batch and position strides
//   free, heads and dims packed), cs [B or 1, 2, D/2, 2]: row b's queries at pos[b] and
//   pos[b] + 1, each attending causally, the second reading the first's key/value from
//   k_new/v_new (not from the cache the same launch writes); both positions are stored in
//   block wblock[b], so they must share one block (the fast AR's dense cache: one block of
//   every position). The result is the two one-position launches' bit for bit.
//   qw, kw   [D] or None      same dtype: with cs, RMSNorm weights of q's and k's heads
//   cs       [B or 1, D/2, 2] or None, same dtype, last two dims packed: (cos, sin) of each
//                             row's position (one row for all: row stride 0). Given, the
//                             kernel first normalises each head of q and k_new (where qw /
//                             kw are given; eps) and rotates its pairs (2i, 2i+1) by cs[i]
//                             with every rounding of engine/functional.py's norm_rope_qk,
//                             and stores and attends with that k: the model's q/k norm and
//                             RoPE launch folded into this one. Needs D / L even (not D = 40).
//   splits   int              1: one block reads all of a row's positions; > 1: each row's
//                             positions are cut into `splits` ranges read by separate blocks
//                             (partial softmax states in float32, merged by a second kernel);
//                             0: as many as it takes to fill the GPU when the batch is small
// Row b attends to positions 0..pos[b] through its block table; the key/value at pos[b] is
// taken from k_new/v_new, so blocks never read what another block of the same launch writes.
// A dense cache [N, Hkv, S, D] read in place is the case BS = S, table[b] = [b]. Query head h
// uses kv head h / (H / Hkv).
// Scores and the softmax are computed in float32; scale = 1/sqrt(D).
//
// Why splits: at batch 1 a launch has only H (R = 1) blocks, each walking all positions one
// dependent memory round trip after another — latency-bound (37 us per layer at position
// 1,000 on an H200 for 4 MB of keys and values). Splitting the positions gives the GPU
// enough blocks to overlap those round trips.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <type_traits>

#include "check.cuh"
#include "launch.cuh"

namespace {

using rtvoice::pdl_trigger;
using rtvoice::pdl_wait;

// A block is 16 groups of L adjacent lanes (L = 8, or 16 for head_dim 128: 8 elements, one
// 16-byte load, per lane keeps the R = 4 variant near 128 registers instead of 222, so more
// blocks fit on an SM); a group owns one position at a time (U of them per
// trip of the position loop, their loads issued together).
constexpr int kGroups = 16;
constexpr int kMinLanes = 8;
constexpr int64_t kMaxSplits = 32;

template <typename T>
__device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }

// E consecutive elements at p (16-byte aligned when `vec`) as floats.
template <typename T, int E>
__device__ __forceinline__ void load(const T* __restrict__ p, float (&out)[E], bool vec) {
  constexpr int kPer = 16 / sizeof(T);
  if constexpr ((E * sizeof(T)) % 16 == 0) {
    if (vec) {
#pragma unroll
      for (int c = 0; c < E / kPer; ++c) {
        const uint4 raw = reinterpret_cast<const uint4*>(p)[c];
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int e = 0; e < kPer; ++e) out[c * kPer + e] = to_f(v[e]);
      }
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) out[e] = to_f(p[e]);
}

template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_f(static_cast<T>(x)); }

// One head's RMSNorm (w != nullptr) and interleaved RoPE on a lane's E elements sub * E..
// (the head spread over the L lanes of a group), rounding to T where the reference does: the
// normed value, its product with the weight, each rotated element. The products are kept
// apart (no FMA contraction), as torch computes them. Every lane of the warp must call it
// (shuffles).
template <typename T, int E, int L>
__device__ __forceinline__ void norm_rope(float (&x)[E], const T* __restrict__ w,
                                          const T* __restrict__ cs, int sub, float eps) {
  static_assert(E % 2 == 0, "RoPE pairs must not straddle lanes");
  if (w != nullptr) {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) ss = __fadd_rn(ss, __fmul_rn(x[e], x[e]));
#pragma unroll
    for (int o = L / 2; o >= 1; o /= 2) ss += __shfl_xor_sync(0xffffffff, ss, o);
    // the mean as torch's reduction takes it: the sum times the float 1 / D
    const float r = rsqrtf(__fmul_rn(ss, 1.0f / static_cast<float>(E * L)) + eps);
#pragma unroll
    for (int e = 0; e < E; ++e)
      x[e] = round_to<T>(__fmul_rn(round_to<T>(__fmul_rn(x[e], r)), to_f(w[sub * E + e])));
  }
#pragma unroll
  for (int i = 0; i < E / 2; ++i) {
    const int j = sub * (E / 2) + i;
    const float c = to_f(cs[2 * j]), sn = to_f(cs[2 * j + 1]);
    const float x0 = x[2 * i], x1 = x[2 * i + 1];
    x[2 * i] = round_to<T>(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn)));
    x[2 * i + 1] = round_to<T>(__fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, sn)));
  }
}

// One block per (row b, R query heads of one kv head g, range of positions): with R = all the
// heads of g each key/value row is read once (large batches); with R = 1 there are more,
// smaller blocks to fill the GPU (small batches). E = D / L elements of the head dimension
// per lane. With splits > 1 the block writes its range's softmax state (max, sum, unnormalised
// output, float32) to ws_ml / ws_o for decode_attention_combine.
// ROPE: the fused q/k norm + RoPE (a separate instantiation, so that the plain kernel is
// unchanged by it).
template <typename T, int E, int R, int L, bool ROPE, bool PAIR>
__global__ void __launch_bounds__(kGroups * L) decode_attention_kernel(
    const T* __restrict__ q, int64_t q_rs, const T* __restrict__ k_new, int64_t k_rs,
    const T* __restrict__ v_new, int64_t v_rs, T* __restrict__ k_cache,
    T* __restrict__ v_cache, const int64_t* __restrict__ table, int64_t MB,
    const int64_t* __restrict__ wblock, const int64_t* __restrict__ pos, T* __restrict__ out,
    int64_t out_rs, int Hkv, int rep, int64_t BS,
    float scale, bool vec, int splits, float* __restrict__ ws_o, float* __restrict__ ws_ml,
    const T* __restrict__ qw, const T* __restrict__ kw, const T* __restrict__ cs, int64_t cs_rs,
    float eps, int64_t q_ts, int64_t k_ts, int64_t v_ts, int64_t out_ts, int64_t cs_ts) {
  constexpr int D = E * L;
  constexpr int kThreads = kGroups * L;
  __shared__ float s_m[kGroups][R];
  __shared__ float s_l[kGroups][R];
  __shared__ float s_acc[kGroups][R][D];

  const int parts = rep / R;
  // PAIR: launch row y = 2 b + qi is row b's query at pos[b] + qi (qi = 0, 1)
  const int y = blockIdx.y, b = PAIR ? y / 2 : y, qi = PAIR ? y % 2 : 0;
  const int g = blockIdx.x / parts, part = blockIdx.x % parts;
  const int split = blockIdx.z;
  const int h0 = g * rep + part * R;  // first query head of this block
  const int grp = threadIdx.x / L, sub = threadIdx.x % L;
  pdl_wait();  // (PDL) q, k_new, v_new, pos come from the kernels before
  const int64_t p = pos[b] + qi;
  // the row's other new position (its first query's, read from k_new/v_new), or none (-1)
  const int64_t pp = PAIR && qi == 1 ? p - 1 : -1;
  // this block's positions [t_begin, t_end) of 0..p (empty for a split past the row's end)
  // ranges in whole passes of kGroups positions, so only a range's last pass runs part-empty
  const int64_t n = p + 1, chunk = ((n + splits - 1) / splits + kGroups - 1) / kGroups * kGroups;
  const int64_t t_begin = min(n, split * chunk), t_end = min(n, t_begin + chunk);
  const T* kn = k_new + b * k_rs + qi * k_ts + g * D;
  const T* vn = v_new + b * v_rs + qi * v_ts + g * D;
  const T* kp = kn - k_ts;  // PAIR, qi = 1: position pp's key and value
  const T* vp = vn - v_ts;

  // with cs: this lane's elements of the normed, rotated key (every group holds the whole
  // head), stored below and used in place of k_new at position p (kxp: at pp)
  const T* csr = ROPE ? cs + b * cs_rs + qi * cs_ts : nullptr;
  float kx[ROPE ? E : 1];
  float kxp[ROPE && PAIR ? E : 1];
  if constexpr (ROPE) {
    load<T, E>(kn + sub * E, kx, vec);
    norm_rope<T, E, L>(kx, kw, csr, sub, eps);
    if constexpr (PAIR) {
      if (pp >= 0) {  // uniform over the block: every lane reaches the shuffles
        load<T, E>(kp + sub * E, kxp, vec);
        norm_rope<T, E, L>(kxp, kw, csr - cs_ts, sub, eps);
      }
    }
  }

  if (part == 0 && split == 0) {  // store this position (read back from k_new/v_new below)
    const int64_t w = ((wblock[b] * Hkv + g) * BS + p % BS) * D;
    for (int i = threadIdx.x; i < D; i += kThreads) {
      if constexpr (!ROPE) k_cache[w + i] = kn[i];
      v_cache[w + i] = vn[i];
    }
    if constexpr (ROPE) {
      if (grp == 0) {
#pragma unroll
        for (int e = 0; e < E; ++e) k_cache[w + sub * E + e] = static_cast<T>(kx[e]);
      }
    }
  }

  float qv[R][E];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    load<T, E>(q + b * q_rs + qi * q_ts + (h0 + r) * D + sub * E, qv[r], vec);
    if constexpr (ROPE) norm_rope<T, E, L>(qv[r], qw, csr, sub, eps);
#pragma unroll
    for (int e = 0; e < E; ++e) qv[r][e] *= scale;
  }
  float m[R], l[R], acc[R][E];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[r][e] = 0.f;
  }

  const int64_t* blocks = table + static_cast<int64_t>(b) * MB;
  const int bs32 = static_cast<int>(BS);
  // Trips are uniform across the block (t0 is), so every lane reaches every shuffle; a group
  // whose position t is past the range computes nothing and keeps its state. A trip takes U
  // positions per group (t0 + u * kGroups + grp) and issues all their loads before the first
  // score: with R = 1 (small batches: few blocks, each walking many positions) a trip then
  // costs one table + one key/value round trip for U positions instead of one per position.
  constexpr int U = R == 1 ? 4 : (ROPE ? 1 : 2);
  // 16-byte pieces of a lane's E elements (the raw loads; 0: not a whole number of them)
  constexpr int kRaw = (E * sizeof(T)) % 16 == 0 ? E * sizeof(T) / 16 : 0;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kGroups * U) {
    float kk[U][E], vv[U][E];
    bool live[U];
    if (kRaw > 0 && vec) {
      // every load of the trip first, without a branch (a slot past the range reads the new
      // key and value, and its result is dropped), then the conversions: U key/value round
      // trips overlap (a conversion right after each load would wait for it)
      uint4 kr[U][kRaw > 0 ? kRaw : 1], vr[U][kRaw > 0 ? kRaw : 1];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t t = t0 + u * kGroups + grp;
        live[u] = t < t_end;
        const int64_t tt = live[u] ? t : p;
        // 32-bit division: positions and block sizes are small (64-bit division is emulated)
        const int tb = static_cast<int>(tt) / bs32, to = static_cast<int>(tt) - tb * bs32;
        const bool fresh = tt == p || (PAIR && tt == pp);  // from k_new / v_new
        const int64_t at = fresh ? 0 : ((blocks[tb] * Hkv + g) * BS + to) * D;
        const T* ks = tt == p ? kn : PAIR && tt == pp ? kp : k_cache + at;
        const T* vs = tt == p ? vn : PAIR && tt == pp ? vp : v_cache + at;
        const uint4* kq = reinterpret_cast<const uint4*>(ks + sub * E);
        const uint4* vq = reinterpret_cast<const uint4*>(vs + sub * E);
#pragma unroll
        for (int c = 0; c < kRaw; ++c) {
          kr[u][c] = kq[c];
          vr[u][c] = vq[c];
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int c = 0; c < kRaw; ++c) {
          const T* kv = reinterpret_cast<const T*>(&kr[u][c]);
          const T* vv_ = reinterpret_cast<const T*>(&vr[u][c]);
#pragma unroll
          for (int e = 0; e < 16 / static_cast<int>(sizeof(T)); ++e) {
            kk[u][c * (16 / sizeof(T)) + e] = to_f(kv[e]);
            vv[u][c * (16 / sizeof(T)) + e] = to_f(vv_[e]);
          }
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t t = t0 + u * kGroups + grp;
        live[u] = t < t_end;
        if (live[u]) {  // key and value loads issued together: their round trips overlap
          const int tb = static_cast<int>(t) / bs32, to = static_cast<int>(t) - tb * bs32;
          const bool fresh = t == p || (PAIR && t == pp);
          const int64_t at = fresh ? 0 : ((blocks[tb] * Hkv + g) * BS + to) * D;
          load<T, E>((t == p ? kn : PAIR && t == pp ? kp : k_cache + at) + sub * E, kk[u], false);
          load<T, E>((t == p ? vn : PAIR && t == pp ? vp : v_cache + at) + sub * E, vv[u], false);
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) kk[u][e] = vv[u][e] = 0.f;
        }
      }
    }
    if constexpr (ROPE) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t t = t0 + u * kGroups + grp;
        if (t == p) {
#pragma unroll
          for (int e = 0; e < E; ++e) kk[u][e] = kx[e];  // the normed, rotated key
        }
        if constexpr (PAIR) {
          if (t == pp) {
#pragma unroll
            for (int e = 0; e < E; ++e) kk[u][e] = kxp[e];
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float s[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) d += qv[r][e] * kk[u][e];
        s[r] = d;
      }
      // the L lanes of a group are adjacent in the warp: reduce within them
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int o = L / 2; o >= 1; o /= 2) s[r] += __shfl_xor_sync(0xffffffff, s[r], o);
      }
      if (live[u]) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float mn = fmaxf(m[r], s[r]);
          const float c = __expf(m[r] - mn), w = __expf(s[r] - mn);
          l[r] = l[r] * c + w;
#pragma unroll
          for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * c + w * vv[u][e];
          m[r] = mn;
        }
      }
    }
  }

  pdl_trigger();  // the next kernel's blocks may come in for the merge below
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (sub == 0) {
      s_m[grp][r] = m[r];
      s_l[grp][r] = l[r];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) s_acc[grp][r][sub * E + e] = acc[r][e];
  }
  __syncthreads();

  for (int i = threadIdx.x; i < R * D; i += kThreads) {
    const int r = i / D, d = i % D;
    float M = -INFINITY;
    for (int j = 0; j < kGroups; ++j) M = fmaxf(M, s_m[j][r]);
    float den = 0.f, o = 0.f;
    for (int j = 0; j < kGroups; ++j) {
      if (s_l[j][r] == 0.f) continue;  // a group that saw no position
      const float f = __expf(s_m[j][r] - M);
      den += s_l[j][r] * f;
      o += s_acc[j][r][d] * f;
    }
    const int64_t bh = static_cast<int64_t>(y) * Hkv * rep + h0 + r;
    if (splits == 1) {
      out[b * out_rs + qi * out_ts + static_cast<int64_t>(h0 + r) * D + d] = static_cast<T>(o / den);
    } else {  // an empty range leaves den = 0: the merge skips it
      const int64_t w = bh * splits + split;
      ws_o[w * D + d] = o;
      if (d == 0) {
        ws_ml[2 * w] = M;
        ws_ml[2 * w + 1] = den;
      }
    }
  }
}

// Merges the splits' softmax states of one (launch row, query head) per block: out = sum_s o_s e^(m_s
// - M) / sum_s l_s e^(m_s - M). Split 0 always holds position 0, so some den is > 0.
template <typename T>
__global__ void decode_attention_combine(const float* __restrict__ ws_o,
                                         const float* __restrict__ ws_ml, T* __restrict__ out,
                                         int64_t out_rs, int64_t out_ts, int tq, int H,
                                         int splits, int D) {
  const int64_t bh = blockIdx.x;  // launch row y = bh / H (row b = y / tq's position y % tq)
  const int64_t y = bh / H;
  T* o_row = out + (y / tq) * out_rs + (y % tq) * out_ts + (bh % H) * D;
  pdl_wait();
  pdl_trigger();
  const float* ml = ws_ml + 2 * bh * splits;
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s)
    if (ml[2 * s + 1] > 0.f) M = fmaxf(M, ml[2 * s]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int s = 0; s < splits; ++s) {
      if (ml[2 * s + 1] == 0.f) continue;
      const float f = __expf(ml[2 * s] - M);
      den += ml[2 * s + 1] * f;
      num += ws_o[(bh * splits + s) * D + d] * f;
    }
    o_row[d] = static_cast<T>(num / den);
  }
}

// The optional q/k norm + RoPE of a launch (cs undefined: none).
struct Rope {
  torch::Tensor qw, kw, cs;
  int64_t cs_rs = 0, cs_ts = 0;
  float eps = 0.f;
  template <typename T>
  const T* ptr(const torch::Tensor& t) const {
    return t.defined() ? t.data_ptr<T>() : nullptr;
  }
};

// A tensor's position stride: [B, T, ...] with T = 2 (a pair launch), 0 for [B, ...].
int64_t ts(const torch::Tensor& t, bool pair) { return pair ? t.stride(1) : 0; }

template <typename T, int E, int L>
void launch_e(int R, int rep, int Hkv, bool pair, dim3 grid, cudaStream_t stream,
              const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
              torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& table,
              const torch::Tensor& wblock, const torch::Tensor& pos, torch::Tensor& out,
              float scale, bool vec, int splits, float* ws_o, float* ws_ml, const Rope& rp,
              bool pdl) {
#define RTV_LAUNCH(R_, PAIR_)                                                               \
  if (rp.cs.defined())                                                                      \
    RTV_KERNEL(R_, E % 2 == 0, PAIR_);                                                      \
  else                                                                                      \
    RTV_KERNEL(R_, false, PAIR_)
#define RTV_KERNEL(R_, ROPE_, PAIR_)                                                        \
  rtvoice::launch_kernel(decode_attention_kernel<T, E, R_, L, ROPE_, PAIR_>, grid,          \
      dim3(kGroups * L), 0, stream, pdl,                                                    \
      q.data_ptr<T>(), q.stride(0), k_new.data_ptr<T>(), k_new.stride(0),                   \
      v_new.data_ptr<T>(), v_new.stride(0), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),   \
      table.data_ptr<int64_t>(), table.stride(0), wblock.data_ptr<int64_t>(),               \
      pos.data_ptr<int64_t>(), out.data_ptr<T>(), out.stride(0), Hkv, rep,                  \
      k_cache.size(2), scale, vec, splits, ws_o, ws_ml, rp.ptr<T>(rp.qw), rp.ptr<T>(rp.kw),   \
      rp.ptr<T>(rp.cs), rp.cs_rs, rp.eps, ts(q, PAIR_), ts(k_new, PAIR_), ts(v_new, PAIR_), \
      ts(out, PAIR_), rp.cs_ts)
  // pair launches for the 16-bit types only (the fast AR's): half the instantiations
  constexpr bool kPair = !std::is_same_v<T, float>;
  if (pair) {
    if constexpr (kPair) {
      switch (R) {
        case 1: RTV_LAUNCH(1, kPair); break;
        case 2: RTV_LAUNCH(2, kPair); break;
        case 4: RTV_LAUNCH(4, kPair); break;
        default: TORCH_CHECK(false, "decode_attention: ", R, " query heads per kv head is not supported");
      }
    } else {
      TORCH_CHECK(false, "decode_attention: two positions per row need bf16/fp16 tensors");
    }
    return;
  }
  switch (R) {
    case 1: RTV_LAUNCH(1, false); break;
    case 2: RTV_LAUNCH(2, false); break;
    case 4: RTV_LAUNCH(4, false); break;
    default: TORCH_CHECK(false, "decode_attention: ", R, " query heads per kv head is not supported");
  }
#undef RTV_KERNEL
#undef RTV_LAUNCH
}

// 16-byte loads: the base and every stride but the (packed) last one's in whole 16 bytes
bool aligned16(const torch::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d + 2 < t.dim(); ++d)
    if ((t.stride(d) * t.element_size()) % 16 != 0) return false;
  return true;
}

// q [B, H, D] or, pair, [B, 2, H, D] (k_new, v_new, out alike)
template <typename T>
void launch(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
            torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& table,
            const torch::Tensor& wblock, const torch::Tensor& pos, torch::Tensor& out,
            int64_t splits, const Rope& rp, bool pdl) {
  const bool pair = q.dim() == 4;
  const int tq = pair ? 2 : 1;
  const int B = q.size(0), H = q.size(q.dim() - 2), D = q.size(q.dim() - 1);
  const int Hkv = k_new.size(k_new.dim() - 2);
  const int rows = B * tq;  // launch rows: one per query position
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int rep = H / Hkv;
  // Whole kv groups per block once there are enough of them to fill the GPU twice over.
  static int sm_count[64] = {0};  // per device; a racing first call writes the same value
  const int dev = q.get_device();
  int n_sm = dev < 64 ? sm_count[dev] : 0;
  if (n_sm == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    if (dev < 64) sm_count[dev] = n_sm;
  }
  const int R = (static_cast<int64_t>(rows) * Hkv >= 2 * n_sm) ? rep : 1;
  const int64_t blocks = static_cast<int64_t>(rows) * Hkv * (rep / R);
  // auto: fill the GPU twice over, at most one split per 64 cache positions (the count must
  // not depend on pos: a captured graph replays it at every position). A pair launch takes
  // the count of its one-position launches (B rows), so that it gives their bits.
  if (splits == 0) {
    const int R1 = (static_cast<int64_t>(B) * Hkv >= 2 * n_sm) ? rep : 1;
    const int64_t blocks1 = static_cast<int64_t>(B) * Hkv * (rep / R1);
    const int64_t want = blocks1 >= n_sm ? 1 : (2 * n_sm + blocks1 - 1) / blocks1;
    const int64_t positions = table.size(1) * k_cache.size(2);
    splits = std::max<int64_t>(1, std::min<int64_t>({want, kMaxSplits, positions / 64}));
  }
  const int ns = static_cast<int>(std::min<int64_t>(splits, kMaxSplits));  // documented cap
  const dim3 grid(Hkv * (rep / R), rows, ns);
  const bool vec = aligned16(q) && aligned16(k_new) && aligned16(v_new) && aligned16(k_cache) &&
                   aligned16(v_cache);
  auto stream = c10::cuda::getCurrentCUDAStream();
  torch::Tensor ws_o, ws_ml;  // the splits' partial softmax states (float32)
  float* o_ptr = nullptr;
  float* ml_ptr = nullptr;
  if (ns > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    ws_o = torch::empty({static_cast<int64_t>(rows) * H * ns * D}, f32);
    ws_ml = torch::empty({static_cast<int64_t>(rows) * H * ns * 2}, f32);
    o_ptr = ws_o.data_ptr<float>();
    ml_ptr = ws_ml.data_ptr<float>();
  }
#define RTV_E(E_, L_)                                                                       \
  launch_e<T, E_, L_>(R, rep, Hkv, pair, grid, stream, q, k_new, v_new, k_cache, v_cache,  \
                      table, wblock, pos, out, scale, vec, ns, o_ptr, ml_ptr, rp, pdl)
  switch (D) {
    case 40: RTV_E(5, 8); break;
    case 48: RTV_E(6, 8); break;
    case 64: RTV_E(8, 8); break;
    case 128: RTV_E(8, 16); break;
    default: TORCH_CHECK(false, "decode_attention: head_dim ", D, " is not supported");
  }
#undef RTV_E
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (ns > 1) {
    rtvoice::launch_kernel(decode_attention_combine<T>, dim3(static_cast<unsigned>(rows * H)),
                           dim3(128), 0, stream, pdl, o_ptr, ml_ptr, out.data_ptr<T>(),
                           out.stride(0), ts(out, pair), tq, H, ns, D);
  }
}

}  // namespace

void decode_attention(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new,
                      torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                      torch::Tensor wblock, torch::Tensor pos, torch::Tensor out,
                      int64_t splits, std::optional<torch::Tensor> qw,
                      std::optional<torch::Tensor> kw, std::optional<torch::Tensor> cs,
                      double eps, bool pdl) {
  TORCH_CHECK(splits >= 0, "decode_attention: splits must be >= 0 (0: automatic), got ", splits);
  TORCH_CHECK(q.is_cuda(), "decode_attention: CUDA tensors expected");
  const int nd = q.dim();
  TORCH_CHECK((nd == 3 || nd == 4) && k_new.dim() == nd && v_new.dim() == nd && out.dim() == nd,
              "decode_attention: q/k_new/v_new/out must be 3-d ([B, H, D]) or, for two "
              "positions per row, 4-d ([B, 2, H, D])");
  const bool pair = nd == 4;
  TORCH_CHECK(!pair || (q.size(1) == 2 && k_new.size(1) == 2 && v_new.size(1) == 2 &&
                        out.size(1) == 2),
              "decode_attention: 4-d q/k_new/v_new/out take exactly two positions per row, got ",
              rtvoice::dims(q), " and ", rtvoice::dims(k_new));
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "decode_attention: caches must be 4-d");
  const auto dt = q.scalar_type();
  for (const auto* t : {&k_new, &v_new, &k_cache, &v_cache, &out})
    TORCH_CHECK(t->scalar_type() == dt && t->device() == q.device(),
                "decode_attention: all tensors must share q's dtype and device");
  TORCH_CHECK(!pair || dt != at::kFloat,
              "decode_attention: two positions per row need bf16/fp16 tensors");
  TORCH_CHECK(table.scalar_type() == at::kLong && wblock.scalar_type() == at::kLong &&
                  pos.scalar_type() == at::kLong,
              "decode_attention: table, wblock and pos must be int64");
  const int hd = nd - 2;  // the heads' dim
  const int64_t B = q.size(0), H = q.size(hd), D = q.size(hd + 1), Hkv = k_new.size(hd);
  TORCH_CHECK(H % Hkv == 0 && D % kMinLanes == 0 && k_new.size(0) == B && v_new.size(0) == B &&
                  k_new.size(hd + 1) == D && v_new.sizes() == k_new.sizes(),
              "decode_attention: bad head counts/dim");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == B && table.size(1) >= 1 &&
                  table.stride(1) == 1 && wblock.numel() == B && pos.numel() == B,
              "decode_attention: table must be [B, MB] (rows may be strided), wblock/pos [B]");
  TORCH_CHECK(k_cache.size(1) == Hkv && k_cache.size(3) == D &&
                  v_cache.sizes() == k_cache.sizes(),
              "decode_attention: cache shape ", rtvoice::dims(k_cache), " does not fit q ",
              rtvoice::dims(q));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: caches must be contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(hd + 1) == 1 && out.stride(hd) == D &&
                  (out.size(0) <= 1 || out.stride(0) >= out.size(1) * out.stride(1)) &&
                  (!pair || out.stride(1) >= H * D),
              "decode_attention: out must be shaped like q with heads and dims packed and rows "
              "(and positions) apart, got ",
              rtvoice::dims(out), " strides ", rtvoice::dims(out.strides()));
  for (const auto* t : {&q, &k_new, &v_new})
    TORCH_CHECK(t->stride(hd + 1) == 1 && t->stride(hd) == D,
                "decode_attention: heads and dims of q/k_new/v_new must be packed");
  Rope rp;
  if (cs.has_value()) {
    const auto& c = *cs;
    const int cd = pair ? 2 : 1;  // cs's (head_dim / 2) dim
    TORCH_CHECK(D % kMinLanes == 0 && (D == 128 ? D / 16 : D / 8) % 2 == 0,
                "decode_attention: the fused q/k norm + RoPE needs an even number of elements "
                "per lane (head_dim 48, 64 or 128), got head_dim ", D);
    TORCH_CHECK(c.scalar_type() == dt && c.device() == q.device() && c.dim() == nd &&
                    (c.size(0) == B || c.size(0) == 1) && (!pair || c.size(1) == 2) &&
                    c.size(cd) == D / 2 && c.size(cd + 1) == 2 && c.stride(cd + 1) == 1 &&
                    c.stride(cd) == 2,
                "decode_attention: cs must be [B or 1, head_dim / 2, 2] ([B or 1, 2, head_dim "
                "/ 2, 2] for two positions) in q's dtype with its last two dims packed, got ",
                c.scalar_type(), " ", rtvoice::dims(c), " strides ", rtvoice::dims(c.strides()));
    for (const auto* w : {&qw, &kw})
      TORCH_CHECK(!w->has_value() || ((*w)->scalar_type() == dt && (*w)->device() == q.device() &&
                                      (*w)->dim() == 1 && (*w)->size(0) == D &&
                                      (*w)->is_contiguous()),
                  "decode_attention: q/k norm weights must be contiguous [head_dim] in q's dtype");
    TORCH_CHECK(qw.has_value() == kw.has_value(),
                "decode_attention: give both q and k norm weights or neither");
    rp.cs = c;
    rp.cs_rs = c.size(0) == 1 ? 0 : c.stride(0);
    rp.cs_ts = pair ? c.stride(1) : 0;
    if (qw.has_value()) {
      rp.qw = *qw;
      rp.kw = *kw;
    }
    rp.eps = static_cast<float>(eps);
  } else {
    TORCH_CHECK(!qw.has_value() && !kw.has_value(),
                "decode_attention: q/k norm weights come with cs (the rotation)");
  }
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  pdl = pdl && rtvoice::pdl_device(q.get_device());
  switch (dt) {
    case at::kBFloat16: launch<at::BFloat16>(q, k_new, v_new, k_cache, v_cache, table, wblock, pos, out, splits, rp, pdl); break;
    case at::kHalf: launch<at::Half>(q, k_new, v_new, k_cache, v_cache, table, wblock, pos, out, splits, rp, pdl); break;
    case at::kFloat: launch<float>(q, k_new, v_new, k_cache, v_cache, table, wblock, pos, out, splits, rp, pdl); break;
    default: TORCH_CHECK(false, "decode_attention: unsupported dtype ", dt);
  }
}
