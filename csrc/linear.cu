// linear_small_m: y = x @ W^T for the few rows of a decode step (M = 1..64), bf16 activations
// and output, float32 accumulation, W in bf16 or in FP8 e4m3 with 128 x 128 block scales
// (weight-only: the e4m3 values become bf16 or f16 in registers).
//
// At these M a linear layer is a stream over its weights (31 MB for S2-Pro's wqkv in bf16):
// the kernel's job is to keep enough bytes in flight to run at the HBM's copy bandwidth. The
// previous attempt (a CUDA-core GEMV, x staged through shared memory with a __syncthreads per
// 1024-element tile, 8 warps over R rows each, a grid of N / 8R blocks) was slower than cuBLAS
// on the H200. This one:
//   - multiplies on the tensor cores (mma.sync m16n8k16, "swap AB": 16 weight rows are the A
//     operand, 8 x rows the B operand, so M = 1..8 is one MMA column tile, M = 64 eight), and
//     feeds them straight from 16-byte loads: a dot product is a sum, so K may be visited in
//     any order as long as A and B use the same one. Lane (g = lane / 4, t = lane % 4) loads
//     16 contiguous bytes of weight rows g and g + 8 at k = kk + t * (16 / elem) and 16 (bf16
//     W) or 32 (FP8 W) bytes of x row g at the same k, which are exactly the A and B fragments
//     of two (bf16: 32 k) or four (FP8: 64 k) m16n8k16 steps under a permutation of k;
//   - has no shared memory and no barrier in the main loop: x (M x K bf16, at most 1.3 MB) is
//     read through L1 by every warp that needs it;
//   - fills the GPU at small N by splitting K: inside a block (the warps of a row tile take
//     interleaved K chunks, summed through shared memory once at the end; 8 warps on one tile
//     for N <= ~4,200) and, with `splits` > 1, across blocks (float32 partials to a workspace,
//     summed by a second, tiny kernel).
// Variants (`variant`), one of which the recorded plan picks per shape:
//   0: register batches. A warp issues a whole batch of loads (U chunks x 2 rows x 16 bytes
//      per lane: 8 x 16 B at M <= 16, 4 KB per warp) with an L2 256-byte prefetch hint and no
//      L1 allocation, in a main loop without predicates (ptxas sinks predicated loads, and any
//      load when register use is unbounded, to their use: one round trip per load), waits for
//      all of it, computes, then issues the next: one exposed round trip per batch, and the
//      FP8 conversion's ALU work never overlaps the loads (measured on the H200: bf16 w13 at
//      83 % of the copy bandwidth, FP8 at 37-61 %).
//   1: pipelined (linear_pipe_kernel). The weights go global -> shared memory by cp.async
//      into a per-warp ring of S stages: S - 1 chunks (128 bytes of each row) in flight while
//      the oldest is converted and multiplied. Each lane reads back only what it copied (no
//      barrier, conflict-free 16-byte reads); 32-row tiles at M <= 32 (x through L1 half as
//      often). Exact like 0.
//   2: FP8 only: 1 without the per-element multiply by 2^120 (the 2^120 goes into the block
//      scale). The MMA then sees 2^-120 times the weights (e4m3 subnormals: bf16 subnormals)
//      and float32 products below 2^-126 when |x w| < 2^-6 e4m3 units: exact where the
//      tensor cores keep subnormals (linear_bench probes it and drops the variant if not).
//   3: FP8 only, sm_89+: 1 with the conversion unit (cvt.rn.f16x2.e4m3x2: one instruction per
//      pair instead of five) and f16 MMAs; x is rounded to f16 on the fly (cvt.satfinite):
//      exact for 2^-17 <= |x| <= 65504 (bf16's 8 significant bits), rounded below (error
//      < 2^-25 |w|), saturated above 65504 (a wrong result, but finite). For normed
//      activations only; 0-2, 4 and 5 are bf16-exact.
//   4: 0 software-pipelined in registers: the next batch's weight loads go out before this
//      batch's MMAs, the first batch's before the PDL wait and the prologue; bit-equal to 0
//      (linear_small_m_kernel's kPipe).
//   5: 4 with half of 0's batches at M <= 16 (as many bytes in flight per warp as 0) and one
//      block per SM more (FP8 at M <= 8: three); bit-equal to 0 with one warp per tile (a
//      warp sums its chunks in K order either way), otherwise exact the same way.
//   6: FP8 only, sm_89+, M <= 16: 5 with the conversion unit (one cvt.rn.f16x2.e4m3x2 per
//      pair where the bit move takes five) and f16 MMAs. A prologue stages x's rows (normed
//      first with norm_weight) in shared memory as f16 times a power of two 2^e that puts
//      each row's largest |value| in [2^14, 2^15) (kProStageF16, kProNormF16), and the
//      epilogue multiplies by 2^-e: every product is then 2^e times variant 5's, exactly, for
//      values at least 2^-31 times their row's largest (bf16's 8 significant bits fit f16's
//      11); smaller ones are rounded (error <= 2^-39 of the row's largest): bit-equal to 5
//      unless a row spans more than 2^31, where the f16 MMAs sum as the bf16 ones do (not
//      promised by PTX: linear_bench probes it before recording 6). Every block stages all M rows whole (from L2, one
//      round trip per row, while its first weight batch is in flight), also in a K split
//      (staging only the split's range cost the M <= 8 kernel 16 bytes of spill).
//   7: FP8 only, sm_89+, M <= 16: W8A8. 5 with x quantised to e4m3 too, per 1 x 128 block of
//      K (one float32 scale each: amax / 448), by a prologue into shared memory (normed
//      first with norm_weight), and e4m3 MMAs (m16n8k32: no conversion of the weights at
//      all); each 128-wide chunk's MMA sum is scaled by its weight block's scale times x's
//      block scale. Other numerics than 0-6 (x rounded to e4m3's 4 significant bits within
//      each block's range), so taken only where activations may be quantised (its
//      reference: engine.kernels.fp8_triton.fp8_linear_w8a8_torch).
// FP8 (0-2, 4, 5): each e4m3 byte is moved into a bf16's bit fields and scaled by 2^120 (exact;
// integer and FMA instructions only, no conversion unit); one 128-wide K chunk is one scale
// block, whose MMA sum is multiplied by its scale (all rows of a tile share it: 128 % 32 ==
// 0) and added to the float32 accumulator. Accuracy: all variants accumulate exact products
// in float32 and round once, so they are at least as close to the exact product as F.linear
// (which rounds the dequantised FP8 weight to bf16 first); 3 within its x range.
//
// Contract (checked by engine/kernels/linear.py and again here):
//   x      [M, K]  bf16, 1 <= M <= 64, rows may be strided (row stride * 2 and the base
//                  16-byte aligned), last dim contiguous
//   w      [N, K]  bf16, or float8_e4m3fn with `scale`; contiguous, 16-byte aligned; finite
//                  (a lane with nothing to read loads row 0 and discards it; e4m3 NaN codes
//                  read as +-480 in 0-2, 4 and 5, NaN in 3 and 6; checked at load)
//   scale  [ceil(N/128), ceil(K/128)] float32, contiguous (FP8 only; None for bf16):
//                  W[n, k] = w[n, k] * scale[n / 128, k / 128]
//   out    [M, N]  bf16, contiguous ([M, N / 2] with glu)
//   K % 16 == 0; N >= 1; compute capability 8.0+ (variant 3: 8.9+)
//   splits 1..64: K cut into this many ranges read by separate blocks (float32 partials,
//                  summed by linear_splits_reduce); 0: automatic
//   kwarps 1, 2, 4, 8: warps of a block sharing one row tile (K split inside the block);
//                  0: automatic (variants 0, 4, 5: the fewest that still give two blocks per SM,
//                  else 8; 1-3: the fewest that give every SM a block, else 8)
//   variant 0..7 (above); bf16 weights take 0, 1, 4 or 5; 6 needs M <= 16 and
//          M x (K + 32) x 2 bytes <= 160 KB (its rows in shared memory); 7 M <= 16 and
//          M x (K + 64) bytes + 64 per 128 of K (+ the normed rows) <= 160 KB
//   glu    SwiGLU epilogue (bf16 W; FP8 W in variant 0, 4, 5 or 6 at M <= 16 with I % 128 == 0, the
//          tile's gate and up rows scaled by their own block rows): w = [W1; W3] (N = 2 I rows, the gate's then the
//          up projection's), out [M, I] = silu(x W1^T) * (x W3^T), each of the two rounded to
//          bf16 first as the unfused linear would (then silu in float32, rounded, times the
//          up value, rounded: what F.silu(a) * b does in bf16). A 16-row tile then holds the
//          gate rows f0..f0+7 as its rows g and the up rows I+f0.. as its rows g + 8, so each
//          lane ends with a gate and its up value side by side; with splits > 1 the partials
//          keep the [splits, M, 2 I] layout and the reduce kernel applies the epilogue.
//   residual  [M, N] bf16, rows strided, last dim contiguous (not with glu): out = residual +
//          x W^T, the product rounded to bf16 first and the sum rounded again, as the
//          unfused linear and add would (a block's residual add folded into its projection).
//   norm_weight  [K] bf16 (variant 0, 4, 5 or 6, M <= 16; bf16 or FP8 W): x rows are h,
//          multiplied as rms_norm(h) * norm_weight: bf16(bf16(h * rsqrt(mean(h^2) + eps)) * w), as
//          engine.functional.rms_norm rounds it. Every block normalises all M rows itself
//          (a warp per row reads it from L2 in one round trip and sums its squares; one
//          barrier) into shared memory, from which the main loop reads x: the norm's launch
//          folded into the linear's.
//   linear_small_m_attend (variant 0, M <= 16, not with glu or norm_weight): x = qkv[:, :K]
//          of one position's [q | k | v] rows; the attention prologue (attend_rows below)
//          computes their attention over a few cached positions into shared memory, which
//          the main loop multiplies (the fast AR's attention launch folded into wo).
//   pdl    0: a plain launch; 1..3: programmatic dependent launch (sm_90+; a plain launch
//          before, csrc/launch.cuh): 1 the kernel's blocks may start while the kernel before
//          ends and wait for it, the next kernel's may come in for this one's tail; 2 as 1,
//          each warp also bringing its first two weight batches into L2 before the wait; 3
//          as 2, triggering the next kernel right after the wait (kPdl* above).

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>

#include "check.cuh"
#include "launch.cuh"

namespace {

using rtvoice::pdl_trigger;
using rtvoice::pdl_wait;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = 16;  // weight rows per warp tile (the MMA's M)
constexpr int kMaxM = 64;      // 8 MMA n-tiles of 8 x rows
constexpr int kMaxSplits = 64;
constexpr int kScaleBlock = 128;

// 16 bytes of weights, read once: no L1 allocation, the L2 fetches 256-byte lines. Never
// predicated: ptxas sinks a predicated load (its registers zeroed first) to its use.
__device__ __forceinline__ uint4 ld_weights(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// The same, volatile: variant 4 issues the next batch's loads before this batch's MMAs, and
// its first batch before the PDL wait; a volatile asm keeps that program order.
__device__ __forceinline__ uint4 ld_weights_early(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16 bytes of activations: read by every warp of every block, kept in L1.
__device__ __forceinline__ uint4 ld_x(const void* p) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// 16 bytes of shared memory at a shared-window address. Volatile: never moved across the
// barrier that ends the prologue writing it.
__device__ __forceinline__ uint4 ld_smem(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

// The same, volatile: kept in program order before the pipelined kernel's cp.async wait (a
// plain asm load is sunk past it to its use, exposing its latency after the wait).
__device__ __forceinline__ uint4 ld_x_early(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// d += A (16 x 16, row-major) * B (16 x 8, column-major); bf16 in, float32 accumulate.
// a0: (row g, k 2t..2t+1), a1: (row g+8, same k), a2: (row g, k 2t+8..2t+9), a3: (row g+8);
// b0: (k 2t..2t+1, col g), b1: (k 2t+8..2t+9, col g); d: (row g | g+8, cols 2t, 2t+1).
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // bf16 MMA needs sm_80; the host refuses older devices (other kernels still build)
#endif
}

// d += A (16 x 32, row-major) * B (32 x 8, column-major); e4m3 in, float32 accumulate (the
// W8A8 variant 7). a0: (row g, k 4t..4t+3), a1: (row g+8, same k), a2: (row g, k 16+4t..),
// a3: (row g+8); b0: (k 4t..4t+3, col g), b1: (k 16+4t.., col g); d as mma_bf16's.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // e4m3 MMA needs sm_89; the host refuses older devices
#endif
}

// Four e4m3 values (bytes b0..b3 of v, b0 first) -> bf16x2 lo = (b0, b1), hi = (b2, b3),
// exactly, on the integer and FMA pipes rather than the conversion unit (cvt e4m3 -> f16 ->
// f32 -> bf16 takes 4 instructions per pair, two of them conversions): each byte's sign goes
// to a bf16's sign and its 4 exponent + 3 mantissa bits to the bf16's low exponent bits and
// top mantissa bits, which makes a bf16 of 2^-120 times the value (e4m3's bias is 7, bf16's
// 127; subnormals map to bf16 subnormals), then a multiplication by 2^120 (exact, and the
// bf16 FMA keeps subnormal inputs).
__device__ __forceinline__ void e4m3x4_to_bf16x4(uint32_t v, uint32_t& lo, uint32_t& hi) {
  const uint32_t p = __byte_perm(v, 0u, 0x3120);  // bytes [b3 b1 b2 b0]: b2, b3 in bytes 1, 3
  const uint32_t q = p << 8;                       // bytes [b1 b2 b0 0]: b0, b1 in bytes 1, 3
  const uint32_t h = (p & 0x80008000u) | ((p & 0x7F007F00u) >> 4);
  const uint32_t l = (q & 0x80008000u) | ((q & 0x7F007F00u) >> 4);
  __nv_bfloat162_raw k2;
  k2.x = k2.y = 0x7B80;  // 2^120
  const __nv_bfloat162 k(k2);
  const __nv_bfloat162 bl = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&l), k);
  const __nv_bfloat162 bh = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&h), k);
  lo = *reinterpret_cast<const uint32_t*>(&bl);
  hi = *reinterpret_cast<const uint32_t*>(&bh);
}

// 16 e4m3 values -> 8 bf16x2 registers, r[i] = elements 2i, 2i+1.
__device__ __forceinline__ void e4m3x16_to_bf16(const uint4& v, uint32_t (&r)[8]) {
  e4m3x4_to_bf16x4(v.x, r[0], r[1]);
  e4m3x4_to_bf16x4(v.y, r[2], r[3]);
  e4m3x4_to_bf16x4(v.z, r[4], r[5]);
  e4m3x4_to_bf16x4(v.w, r[6], r[7]);
}

// The bit move of e4m3x4_to_bf16x4 without the multiplication: bf16s of 2^-120 times the
// values (variant 2 puts the 2^120 into the block scale instead). Exact as MMA inputs as long
// as the tensor cores keep bf16 subnormal inputs (e4m3 subnormals) and float32 subnormal
// products (|x w| < 2^-6 in e4m3 units); linear_bench probes this before timing the variant.
__device__ __forceinline__ void e4m3x4_to_bf16x4_unscaled(uint32_t v, uint32_t& lo,
                                                          uint32_t& hi) {
  const uint32_t p = __byte_perm(v, 0u, 0x3120);
  const uint32_t q = p << 8;
  hi = (p & 0x80008000u) | ((p & 0x7F007F00u) >> 4);
  lo = (q & 0x80008000u) | ((q & 0x7F007F00u) >> 4);
}

// Four e4m3 values -> f16x2 lo = (b0, b1), hi = (b2, b3) on the conversion unit (sm_89+:
// one instruction per pair; exact, every e4m3 value is an f16).
__device__ __forceinline__ void e4m3x4_to_f16x4(uint32_t v, uint32_t& lo, uint32_t& hi) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
  asm("{\n"
      "  .reg .b16 l, h;\n"
      "  mov.b32 {l, h}, %2;\n"
      "  cvt.rn.f16x2.e4m3x2 %0, l;\n"
      "  cvt.rn.f16x2.e4m3x2 %1, h;\n"
      "}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(v));
#else
  lo = hi = 0u;
  __trap();  // e4m3 conversions need sm_89; the host refuses variant 3 on older devices
#endif
}

// bf16x2 -> f16x2 (x of variant 3): exact for 2^-14 <= |x| <= 65504 (and down to 2^-17 for
// bf16's 8 significant bits), rounded below, saturated to +-65504 above.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t x) {
  const float lo = __uint_as_float(x << 16), hi = __uint_as_float(x & 0xFFFF0000u);
  uint32_t d;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// d += A * B as mma_bf16, with f16 operands.
__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// How the pipelined kernel turns e4m3 into MMA operands (variants 1, 2, 3).
enum Conv : int {
  kConvBits = 0,   // bit move + exact bf16 multiply by 2^120 (bf16-exact; as variant 0)
  kConvFold = 1,   // bit move only, 2^120 applied with the block scale
  kConvCvt16 = 2,  // hardware e4m3x2 -> f16x2, x rounded to f16, f16 MMA
};

template <int CONV>
__device__ __forceinline__ void e4m3x16_convert(const uint4& v, uint32_t (&r)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (CONV == kConvBits) e4m3x4_to_bf16x4(w[i], r[2 * i], r[2 * i + 1]);
    else if constexpr (CONV == kConvFold) e4m3x4_to_bf16x4_unscaled(w[i], r[2 * i], r[2 * i + 1]);
    else e4m3x4_to_f16x4(w[i], r[2 * i], r[2 * i + 1]);
  }
}

// cp.async (sm_80+): 16 bytes global -> shared without registers, L2 only, 256-byte L2
// prefetch; `bytes` < 16 zero-fills the rest (0: reads nothing).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// PDL modes (`pdl`): how a launch overlaps the kernel before it and lets the next one in.
// The next kernel may start once every block of this one has triggered: triggering early
// keeps a waiting block of it on every SM for this kernel's whole run, triggering after the
// main loop only for its tail. Measured on the H200 (linear_bench, docs/PERF.md): 1 is the
// fastest; the L2 prefetch of 2 and the early trigger of 3 cost more than they hide.
constexpr int kPdlOff = 0;       // plain launch; trigger after the main loop
constexpr int kPdlLate = 1;      // PDL launch; trigger after the main loop
constexpr int kPdlPrefetch = 2;  // 1, each warp's first weight batches prefetched into L2
constexpr int kPdlEarly = 3;     // 2, triggering right after the wait

struct Args {
  const __nv_bfloat16* x;
  int64_t x_rs;          // x's row stride (elements)
  const uint8_t* w;      // [N, K] bf16 or e4m3
  const float* scale;    // [ceil(N/128), kb] (FP8)
  __nv_bfloat16* y;      // [M, N] (splits == 1)
  float* ws;             // [splits, M, N] float32 partials (splits > 1)
  int M, N, K, kb;
  int kw;                // warps per 16-row tile
  int n_chunks, cps;     // K chunks in all, per split
  int glu;               // > 0: the SwiGLU epilogue, I = N / 2 (y is [M, I]); 0: y = x W^T
  const __nv_bfloat16* res;  // residual [M, N] added to y (null: none)
  int64_t res_rs;            // its row stride (elements)
  const __nv_bfloat16* nw;   // RMSNorm weight [K]: x rows are normed first (null: plain x)
  float eps;
  int xs_rs;                 // row stride (elements) of the prologue's rows in shared memory
  int pdl;                   // PDL mode (kPdl*): prefetch before the wait, where to trigger
  // the attention prologue (kProAttend): x rows are [q | k | v] of one position
  __nv_bfloat16* at_k;       // the layer's key cache [rows, at_hkv, at_s, kAttnD]
  __nv_bfloat16* at_v;       // its value cache, same shape
  const __nv_bfloat16* at_cs;  // [kAttnD / 2, 2] (cos, sin) of the position
  int at_hkv, at_s, at_pos;  // kv heads, cache positions per row, this position
  float at_scale;            // 1 / sqrt(kAttnD)
};

// What variant 0 does before its main loop (a separate instantiation each): nothing, the
// normed prologue (x rows RMS-normed into shared memory) or the attention prologue (x rows
// are a position's q/k/v projections; their attention output goes to shared memory).
constexpr int kProPlain = 0;
constexpr int kProNorm = 1;
constexpr int kProAttend = 2;
constexpr int kProNormF16 = 3;   // the normed prologue in f16, scaled per row (variant 6)
constexpr int kProStageF16 = 4;  // x's rows staged in f16, scaled per row (variant 6)
constexpr int kProStageE4M3 = 5;  // x's rows quantised to e4m3 per 1 x 128 block (variant 7)
constexpr int kProNormE4M3 = 6;   // the normed prologue, then that quantisation (variant 7)
// variant 7's e4m3 rows: K rounded up to a scale block, plus 64 bytes (rows 64 bytes apart mod
// 128: a quarter-warp's 16-byte reads of rows g, g + 1 at t * 16 hit distinct banks), then
// the scales [chunk][16 rows] float32
constexpr int kQuantPad = 64;
__host__ __device__ constexpr int quant_row_bytes(int K) {
  return (K + 127) / 128 * 128 + kQuantPad;
}

// The attention prologue's limits and layout: head_dim kAttnD; lane t of a warp scores
// cache position t (at most kAttnMaxPos positions); a warp's shared scratch holds its (row,
// kv head)'s keys [S][kAttnD + kAttnKPad] (rows 272 bytes apart: a quarter-warp's 16-byte
// reads of 8 rows hit distinct banks), values [S][kAttnD] and kAttnHeads rotated queries.
constexpr int kAttnD = 128;
constexpr int kAttnMaxPos = 32;
constexpr int kAttnHeads = 4;
constexpr int kAttnKPad = 8;
__host__ __device__ constexpr int attn_warp_bytes(int s) {
  return (s * (kAttnD + kAttnKPad) + s * kAttnD + kAttnHeads * kAttnD) * 2;
}

// y = residual + bf16(d): the linear's output rounded, then the residual add rounded (what
// `x + F.linear(...)` computes in bf16).
__device__ __forceinline__ __nv_bfloat16 add_residual(float d, __nv_bfloat16 r) {
  return __float2bfloat16(__bfloat162float(__float2bfloat16(d)) + __bfloat162float(r));
}

// The weight rows of 16-row sub-tile `st` that lane group g multiplies: `ra` as the MMA's
// row g, `rb` as its row g + 8. Plain: rows 16 st + g and + 8. SwiGLU (glu = I): output f =
// 8 st + g, its gate row f and its up row I + f. kMayGlu = false (the pipelined FP8 kernels,
// which never take the epilogue) compiles the SwiGLU branches out: no registers spent on them.
struct TileRows {
  int ra, rb;      // weight rows
  bool oka, okb;   // rows that exist (a missing one reads row 0 and its result is dropped)
  int f;           // SwiGLU: the output column
};

template <bool kMayGlu>
__device__ __forceinline__ TileRows tile_rows(const Args& a, int st, int g) {
  if (kMayGlu && a.glu > 0) {
    const int f = st * 8 + g;
    return {f, a.glu + f, f < a.glu, f < a.glu, f};
  }
  const int n = st * kTileRows + g;
  return {n, n + 8, n < a.N, n + 8 < a.N, 0};
}

// silu(gate) * up as the unfused ops compute it in bf16: the linear's outputs rounded, then
// F.silu (float32 x / (1 + exp(-x)), rounded), then the product, rounded.
__device__ __forceinline__ __nv_bfloat16 swiglu_bf16(float gate, float up) {
  const float gb = __bfloat162float(__float2bfloat16(gate));
  const float ub = __bfloat162float(__float2bfloat16(up));
  const float s = __bfloat162float(__float2bfloat16(gb / (1.0f + expf(-gb))));
  return __float2bfloat16(s * ub);
}

// A lane's four results of one 16-row sub-tile and MMA n-tile: d[e] = row (e < 2 ? ra : rb)
// times x row m0 + (e & 1). Written as bf16 to y [M, N], as float32 partials to ws (split
// K), or, SwiGLU without split K, as silu(d[e]) * d[e + 2] to y [M, I].
template <bool kMayGlu>
__device__ __forceinline__ void store_tile(const Args& a, const float (&d)[4],
                                           const TileRows& tr, int m0) {
  if (kMayGlu && a.glu > 0 && a.ws == nullptr) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = m0 + e;
      if (tr.oka && m < a.M)
        a.y[static_cast<int64_t>(m) * a.glu + tr.f] = swiglu_bf16(d[e], d[e + 2]);
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int n = e >= 2 ? tr.rb : tr.ra, m = m0 + (e & 1);
    if ((e >= 2 ? tr.okb : tr.oka) && m < a.M) {
      if (a.ws != nullptr)  // an empty split range writes its zeros too
        a.ws[(static_cast<int64_t>(blockIdx.y) * a.M + m) * a.N + n] = d[e];
      else if (a.res != nullptr)
        a.y[static_cast<int64_t>(m) * a.N + n] = add_residual(d[e], a.res[m * a.res_rs + n]);
      else
        a.y[static_cast<int64_t>(m) * a.N + n] = __float2bfloat16(d[e]);
    }
  }
}

// x fragments of one 16-byte weight load step: x rows 8 j + g (xrow[j] points at the lane's
// k offset of its row) at k = kk + t * kVec: 8 bf16 (bf16 W) or 16 (FP8 W) per n-tile j.
template <int NT, bool F8>
struct XFrag {
  uint4 v[NT][F8 ? 2 : 1];
};

template <int NT, bool F8>
__device__ __forceinline__ void load_x(XFrag<NT, F8>& f, const __nv_bfloat16* const (&xrow)[NT],
                                       int kk) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    f.v[j][0] = ld_x(xrow[j] + kk);
    if constexpr (F8) f.v[j][1] = ld_x(xrow[j] + kk + 8);
  }
}

// The same from normed rows in shared memory: xrow holds their shared-window addresses
// (bytes) at the lane's k offset.
template <int NT, bool F8>
__device__ __forceinline__ void load_x(XFrag<NT, F8>& f, const uint32_t (&xrow)[NT], int kk) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    f.v[j][0] = ld_smem(xrow[j] + kk * 2);
    if constexpr (F8) f.v[j][1] = ld_smem(xrow[j] + (kk + 8) * 2);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// |v| for the row scale of variant 6: an infinity takes no part (it stays one, 2^e times; the
// finite values keep their scale), a NaN neither (fmaxf drops it)
__device__ __forceinline__ float finite_abs(float v) { return isinf(v) ? 0.f : fabsf(v); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The normed prologue: rows m < M of x (h) -> rms_norm(h) * nw into xs [M, xs_rs] (shared),
// rounded as engine.functional.rms_norm does. A warp per row (rows w, w + 8): its lanes
// issue the row's loads together (kB 16-byte chunks per lane in flight, unpredicated: one L2
// round trip for a row of K <= 2560), sum the squares in one fixed order (each lane's, then
// the butterfly), and normalise the chunks each lane wrote to shared memory itself; one
// barrier at the end, before the main loop reads the rows. kF16 (variant 6): each row then
// goes to f16 times 2^e, e chosen from the row's largest |value| (in [2^14, 2^15) after
// scaling; e in [-126, 126]), and unscale[m] = 2^-e; !kNorm: the rows as they are (staged,
// not normed).
template <bool kF16 = false, bool kNorm = true>
__device__ __forceinline__ void norm_rows(const Args& a, __nv_bfloat16* xs,
                                          float* unscale = nullptr) {
  static_assert(kNorm || kF16, "a plain bf16 row needs no staging");
  constexpr int kB = 10;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int per_row = a.K / 8;
  for (int m = warp; m < a.M; m += kWarps) {
    const __nv_bfloat16* src = a.x + m * a.x_rs;
    __nv_bfloat16* dst = xs + m * a.xs_rs;
    float ss = 0.f;
    float mx = 0.f;  // kF16: this lane's largest |value| (normed, with kNorm)
    for (int c0 = 0; c0 < per_row; c0 += 32 * kB) {
      uint4 v[kB];
#pragma unroll
      for (int b = 0; b < kB; ++b)  // a chunk past the row rereads the row's last one
        v[b] = ld_x(src + min(c0 + b * 32 + lane, per_row - 1) * 8);
#pragma unroll
      for (int b = 0; b < kB; ++b) {
        const int c = c0 + b * 32 + lane;
        if (c < per_row) {
          *reinterpret_cast<uint4*>(dst + c * 8) = v[b];
          const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v[b]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(p[i]);
            if constexpr (kNorm) {
              ss = fmaf(f.x, f.x, ss);
              ss = fmaf(f.y, f.y, ss);
            } else {
              mx = fmaxf(mx, fmaxf(finite_abs(f.x), finite_abs(f.y)));
            }
          }
        }
      }
    }
    const float rstd = kNorm ? rsqrtf(warp_sum(ss) / static_cast<float>(a.K) + a.eps) : 1.f;
    for (int c0 = 0; kNorm && c0 < per_row; c0 += 32 * kB) {
      uint4 w[kB];
#pragma unroll
      for (int b = 0; b < kB; ++b) w[b] = ld_x(a.nw + min(c0 + b * 32 + lane, per_row - 1) * 8);
#pragma unroll
      for (int b = 0; b < kB; ++b) {
        const int c = c0 + b * 32 + lane;
        if (c >= per_row) continue;
        uint4 v = *reinterpret_cast<const uint4*>(dst + c * 8);
        __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
        const __nv_bfloat162* q = reinterpret_cast<const __nv_bfloat162*>(&w[b]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(p[i]);
          const float2 n = __bfloat1622float2(__floats2bfloat162_rn(f.x * rstd, f.y * rstd));
          const float2 g = __bfloat1622float2(q[i]);
          p[i] = __floats2bfloat162_rn(n.x * g.x, n.y * g.y);
          if constexpr (kF16) {
            const float2 o = __bfloat1622float2(p[i]);
            mx = fmaxf(mx, fmaxf(finite_abs(o.x), finite_abs(o.y)));
          }
        }
        *reinterpret_cast<uint4*>(dst + c * 8) = v;
      }
    }
    if constexpr (kF16) {
      mx = warp_max(mx);
      int ex = 0;
      if (mx > 0.f) frexpf(mx, &ex);  // mx = f 2^ex, f in [0.5, 1)
      const int e = max(-126, min(126, 15 - ex));
      const float up = __int_as_float((127 + e) << 23);
      // each lane converts the chunks it wrote above
      for (int c = lane; c < per_row; c += 32) {
        uint4 v = *reinterpret_cast<const uint4*>(dst + c * 8);
        uint32_t* p = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p[i]));
          asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(p[i]) : "f"(f.y * up), "f"(f.x * up));
        }
        *reinterpret_cast<uint4*>(dst + c * 8) = v;
      }
      if (lane == 0) unscale[m] = __int_as_float((127 - e) << 23);
    }
  }
  __syncthreads();
}

// 4 bf16 (8 bytes, packed) as floats.
__device__ __forceinline__ void bf16x4_to_f(const uint2& v, float (&f)[4]) {
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.y));
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}

// 4 bf16 at p (8-byte aligned) as floats, and back (values already bf16: exact).
// Variant 7's prologue: x's rows (with kNorm the normed rows norm_rows left in xs) quantised
// to e4m3 per 1 x 128 block of K, as engine.kernels.fp8_triton.quantize_act_torch does:
// s = max(amax, 1e-30) / 448, q = e4m3(v / s) rounded to nearest even and saturated to +-448,
// into xq [M][quant_row_bytes(K)] and the scales into sx [chunk][16]. A warp takes 2 kQU
// blocks of one row at a time: each lane loads 8 values of each of kQU pairs of blocks (a
// half-warp per block), all loads issued before the first is used (one L2 round trip per
// 2 kQU blocks; from shared memory, normed, kQU = 2: fewer registers beside the weight batch
// in flight), the half-warp reduces its block's amax. One barrier at the end, before the main
// loop reads them.
template <bool kNorm>
__device__ __forceinline__ void quant_rows(const Args& a, const __nv_bfloat16* xs, uint8_t* xq,
                                           float* sx) {
  constexpr int kQU = kNorm ? 2 : 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane >> 4, hl = lane & 15;
  const int qrs = quant_row_bytes(a.K);
  const int groups = (a.kb + 2 * kQU - 1) / (2 * kQU);  // of 2 kQU blocks, per row
  for (int i = warp; i < a.M * groups; i += kWarps) {
    const int m = i / groups, b0 = (i - m * groups) * 2 * kQU;
    const __nv_bfloat16* src = kNorm ? xs + m * a.xs_rs : a.x + m * a.x_rs;
    uint4 v[kQU];
#pragma unroll
    for (int u = 0; u < kQU; ++u) {  // K % 16 == 0: a lane's 8 values are in or past K
      const int k0 = (b0 + 2 * u + half) * 128 + hl * 8;
      v[u] = k0 < a.K ? *reinterpret_cast<const uint4*>(src + k0) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kQU; ++u) {
      const int b = b0 + 2 * u + half, k0 = b * 128 + hl * 8;
      const uint32_t raw[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
      float f[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 p = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[e]));
        f[2 * e] = p.x;
        f[2 * e + 1] = p.y;
      }
      float mx = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) mx = fmaxf(mx, fabsf(f[e]));
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float sc = __fdiv_rn(fmaxf(mx, 1e-30f), 448.f);  // a block of zeros: q = 0
      if (k0 < a.K) {
        uint32_t q[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          unsigned short lo = 0, hi = 0;  // the first value of each pair in the low byte
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
          asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n"
              : "=h"(lo) : "f"(__fdiv_rn(f[4 * h + 1], sc)), "f"(__fdiv_rn(f[4 * h], sc)));
          asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n"
              : "=h"(hi) : "f"(__fdiv_rn(f[4 * h + 3], sc)), "f"(__fdiv_rn(f[4 * h + 2], sc)));
#else
          __trap();  // e4m3 conversions need sm_89; the host refuses variant 7 below it
#endif
          q[h] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
        }
        *reinterpret_cast<uint2*>(xq + static_cast<int64_t>(m) * qrs + k0) = make_uint2(q[0], q[1]);
      }
      if (hl == 0 && b < a.kb) sx[b * 16 + m] = sc;
    }
  }
  __syncthreads();
}

__device__ __forceinline__ void ld_bf16x4(const __nv_bfloat16* p, float (&f)[4]) {
  bf16x4_to_f(*reinterpret_cast<const uint2*>(p), f);
}
__device__ __forceinline__ void st_bf16x4(__nv_bfloat16* p, const float (&f)[4]) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(f[0], f[1]);
  const __nv_bfloat162 b = __floats2bfloat162_rn(f[2], f[3]);
  uint2 v;
  v.x = *reinterpret_cast<const uint32_t*>(&a);
  v.y = *reinterpret_cast<const uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = v;
}

// RoPE on a lane's 4 dims 4 l .. 4 l + 3 of a head (its pairs 2 l and 2 l + 1, whose
// (cos, sin) are cs = (c0, s0, c1, s1)), rounded as engine/functional.py's apply_rope:
// float32 products kept apart, each result to bf16.
__device__ __forceinline__ void rope_bf16x4(float (&x)[4], const float (&cs)[4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float c = cs[2 * j], sn = cs[2 * j + 1];
    const float x0 = x[2 * j], x1 = x[2 * j + 1];
    x[2 * j] = __bfloat162float(__float2bfloat16(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn))));
    x[2 * j + 1] =
        __bfloat162float(__float2bfloat16(__fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, sn))));
  }
}

// The attention prologue: rows m < M of x are one position's [q | k | v] projections (q
// K = H kAttnD wide, then Hkv kAttnD each of k and v, all rows at position at_pos) ->
// softmax(q_h k^T / sqrt(D)) v over the row's cached positions 0..pos-1 and this one, per
// query head h (kv head h / (H / Hkv)), q and k rotated by at_cs first: [M, K] bf16 rows
// into xs (shared) for the main loop, as engine/kernels/decode_attention.py's kernel with
// its RoPE computes them (scores and softmax in float32). Block (0, 0) also stores this
// position's rotated key and its value in the caches; every block reads only positions
// before it there. A warp per (row, kv head): the cached keys and values come into its
// scratch by cp.async (one round trip for all), lane t scores position t against up to
// kAttnHeads query heads at a time (whole-row dot products from shared memory), the softmax
// is a warp reduction, and each lane sums its 4 output dims over the positions. One barrier
// at the end, before the main loop reads xs.
__device__ void attend_rows(const Args& a, __nv_bfloat16* xs, unsigned char* scratch) {
  constexpr int kRs = kAttnD + kAttnKPad;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int S = a.at_s, p = a.at_pos, hkv = a.at_hkv;
  const int rep = a.K / kAttnD / hkv, kvw = hkv * kAttnD;
  __nv_bfloat16* kb = reinterpret_cast<__nv_bfloat16*>(scratch + warp * attn_warp_bytes(S));
  __nv_bfloat16* vb = kb + S * kRs;
  __nv_bfloat16* qb = vb + S * kAttnD;
  const bool store = blockIdx.x == 0 && blockIdx.y == 0;
  float cs[4];  // the lane's two (cos, sin) pairs
  ld_bf16x4(a.at_cs + lane * 4, cs);
  for (int item = warp; item < a.M * hkv; item += kWarps) {
    const int m = item / hkv, g = item - m * hkv;
    const __nv_bfloat16* row = a.x + static_cast<int64_t>(m) * a.x_rs;
    const int64_t at = (static_cast<int64_t>(m) * hkv + g) * S * kAttnD;
    // every global read of the item issued first, one round trip for all (the cp.async's
    // memory clobber and the cache stores below would otherwise keep later loads waiting):
    // this position's key and value, the first pass's query heads (a head past the kv
    // head's rereads its first one, unused), then the cached positions 0..p-1 (16 chunks of
    // 16 bytes per key and per value) into the scratch
    // (raw: 2 registers per 4 values until used)
    const uint2 kraw = *reinterpret_cast<const uint2*>(row + a.K + g * kAttnD + lane * 4);
    const uint2 vraw = *reinterpret_cast<const uint2*>(row + a.K + kvw + g * kAttnD + lane * 4);
    uint2 qraw[kAttnHeads];
#pragma unroll
    for (int r = 0; r < kAttnHeads; ++r)
      qraw[r] = *reinterpret_cast<const uint2*>(row + (g * rep + (r < rep ? r : 0)) * kAttnD +
                                                lane * 4);
    for (int c = lane; c < p * 16; c += 32) {
      const int t = c >> 4, j = (c & 15) * 8;
      cp_async16(smem_u32(kb + t * kRs + j), a.at_k + at + t * kAttnD + j);
      cp_async16(smem_u32(vb + t * kAttnD + j), a.at_v + at + t * kAttnD + j);
    }
    cp_async_commit();
    // this position: its key rotated, key and value as row p of the scratch (and the caches)
    float kx[4], vx[4];
    bf16x4_to_f(kraw, kx);
    bf16x4_to_f(vraw, vx);
    rope_bf16x4(kx, cs);
    st_bf16x4(kb + p * kRs + lane * 4, kx);
    st_bf16x4(vb + p * kAttnD + lane * 4, vx);
    if (store) {
      st_bf16x4(a.at_k + at + p * kAttnD + lane * 4, kx);
      st_bf16x4(a.at_v + at + p * kAttnD + lane * 4, vx);
    }
    for (int h0 = 0; h0 < rep; h0 += kAttnHeads) {
      const int nh = min(kAttnHeads, rep - h0);
      if (h0 > 0) {  // a later pass's query heads (the first pass's were loaded above)
#pragma unroll
        for (int r = 0; r < kAttnHeads; ++r)
          qraw[r] = *reinterpret_cast<const uint2*>(
              row + (g * rep + h0 + (r < nh ? r : 0)) * kAttnD + lane * 4);
      }
#pragma unroll
      for (int r = 0; r < kAttnHeads; ++r) {
        float qx[4];
        bf16x4_to_f(qraw[r], qx);
        rope_bf16x4(qx, cs);
        st_bf16x4(qb + r * kAttnD + lane * 4, qx);
      }
      cp_async_wait<0>();
      __syncwarp();  // every lane's copies and stores are visible to the warp
      float sc[kAttnHeads];
#pragma unroll
      for (int r = 0; r < kAttnHeads; ++r) sc[r] = 0.f;
      if (lane <= p) {  // lane t: position t's key against each query head
        const __nv_bfloat16* kr = kb + lane * kRs;
#pragma unroll 4
        for (int d = 0; d < kAttnD; d += 8) {
          const uint4 kv = *reinterpret_cast<const uint4*>(kr + d);
          const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&kv);
#pragma unroll
          for (int r = 0; r < kAttnHeads; ++r) {
            const uint4 qv = *reinterpret_cast<const uint4*>(qb + r * kAttnD + d);
            const __nv_bfloat162* q2 = reinterpret_cast<const __nv_bfloat162*>(&qv);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 kf = __bfloat1622float2(k2[e]), qf = __bfloat1622float2(q2[e]);
              sc[r] = fmaf(qf.x, kf.x, sc[r]);
              sc[r] = fmaf(qf.y, kf.y, sc[r]);
            }
          }
        }
      }
      // the softmax of each head over lanes 0..p, then each lane's 4 output dims: the heads'
      // sums interleaved (independent chains), one value row read per position
      float ex[kAttnHeads], den[kAttnHeads], o[kAttnHeads][4];
#pragma unroll
      for (int r = 0; r < kAttnHeads; ++r) {
        const float s = lane <= p ? sc[r] * a.at_scale : -INFINITY;
        float mx = s;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        ex[r] = lane <= p ? __expf(s - mx) : 0.f;
        den[r] = warp_sum(ex[r]);
#pragma unroll
        for (int i = 0; i < 4; ++i) o[r][i] = 0.f;
      }
      for (int t = 0; t <= p; ++t) {
        float v4[4];
        ld_bf16x4(vb + t * kAttnD + lane * 4, v4);
#pragma unroll
        for (int r = 0; r < kAttnHeads; ++r) {
          const float et = __shfl_sync(0xffffffffu, ex[r], t);
#pragma unroll
          for (int i = 0; i < 4; ++i) o[r][i] = fmaf(et, v4[i], o[r][i]);
        }
      }
#pragma unroll
      for (int r = 0; r < kAttnHeads; ++r) {
        if (r < nh) {
#pragma unroll
          for (int i = 0; i < 4; ++i) o[r][i] = o[r][i] / den[r];
          st_bf16x4(xs + m * a.xs_rs + (g * rep + h0 + r) * kAttnD + lane * 4, o[r]);
        }
      }
      __syncwarp();  // the next pass rewrites the queries
    }
    __syncwarp();  // the next item rewrites the keys and values
  }
  __syncthreads();
}

// d += weight rows g and g + 8 (wa, wb: 16 bytes at the lane's k) times x's rows at the same
// k, operands already of the MMA's type: bf16 W and x (two m16n8k16), or, kE4M3 (variant 7),
// e4m3 W and x (two m16n8k32 under the k permutation: mma k 4t + i <-> byte i, k 16 + 4t + i
// <-> byte 4 + i of the lane's first 8 bytes, the next 8 likewise, the same for A and B).
template <int NT, bool kE4M3>
__device__ __forceinline__ void mma_direct(float (&d)[NT][4], const uint4& wa, const uint4& wb,
                                           const XFrag<NT, false>& x) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const uint4 xv = x.v[j][0];
    if constexpr (kE4M3) {
      mma_e4m3(d[j], wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
      mma_e4m3(d[j], wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
    } else {
      mma_bf16(d[j], wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
      mma_bf16(d[j], wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
    }
  }
}

// d += weight rows g and g + 8 (wa, wb: 8 bf16 or 16 e4m3 values at k = kk + t * kVec) times
// the x fragments.
// kF16 (FP8 only): the e4m3 values on the conversion unit to f16, x already f16 (variant 6).
template <int NT, bool F8, bool kF16 = false>
__device__ __forceinline__ void mma_step(float (&d)[NT][4], const uint4& wa, const uint4& wb,
                                         const XFrag<NT, F8>& x) {
  if constexpr (F8) {
    uint32_t ra[8], rb[8];
    if constexpr (kF16) {
      e4m3x16_convert<kConvCvt16>(wa, ra);
      e4m3x16_convert<kConvCvt16>(wb, rb);
    } else {
      e4m3x16_to_bf16(wa, ra);
      e4m3x16_to_bf16(wb, rb);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint4 x0 = x.v[j][0], x1 = x.v[j][1];
      const uint32_t xb[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if constexpr (kF16)
          mma_f16(d[j], ra[2 * q], rb[2 * q], ra[2 * q + 1], rb[2 * q + 1], xb[2 * q],
                  xb[2 * q + 1]);
        else
          mma_bf16(d[j], ra[2 * q], rb[2 * q], ra[2 * q + 1], rb[2 * q + 1], xb[2 * q],
                   xb[2 * q + 1]);
      }
    }
  } else {
    mma_direct<NT, false>(d, wa, wb, x);
  }
}

// Variant 7's x fragments: 16 e4m3 of rows 8 j + g at byte kk of the lane's offset (shared).
template <int NT>
__device__ __forceinline__ void load_xq(XFrag<NT, false>& f, const uint32_t (&xrow)[NT],
                                        int kk) {
#pragma unroll
  for (int j = 0; j < NT; ++j) f.v[j][0] = ld_smem(xrow[j] + kk);
}

// Block: 8 warps = (8 / kw) row tiles x kw warps splitting the tile's K chunks (batches of U
// consecutive chunks, dealt round-robin). Grid: (tiles / (8 / kw), splits). NT: MMA n-tiles
// (8 x rows each, M <= 8 NT). A chunk is 32 k (bf16: one 16-byte load per row and lane) or
// 128 k (FP8: two 16-byte loads, one scale block).
//
// The main loop runs whole batches with no predicate at all: a weight row past N reads row 0
// instead (rows of the MMA are independent: its output is dropped), an x row past M reads x
// row 0 (so are columns). Only the last, partial batch of a warp (chunks past the split's
// range, a chunk reaching past K) takes the checked path.
//
// kPipe (variant 4): the same batches software-pipelined in registers. A warp issues its
// next batch's weight loads before converting and multiplying the current one, so a batch's
// round trip overlaps the previous batch's MMAs (variant 0 exposes one per batch), and its
// first batch before the PDL wait and the prologue (weights never depend on the kernel
// before). The last full batch re-reads itself as its "next" (L2 hits, no predicate). Same
// products in the same order: bit-equal to variant 0.
template <int NT, int U, bool F8, int MINB, int PRO = kProPlain, bool kPipe = false>
__global__ void __launch_bounds__(kThreads, MINB) linear_small_m_kernel(const Args a) {
  constexpr int kEl = F8 ? 1 : 2;             // bytes per weight element
  constexpr int kVec = 16 / kEl;              // weight elements per 16-byte load
  constexpr int kSteps = F8 ? 2 : 1;          // 16-byte loads per row, lane and chunk
  constexpr int kChunk = kSteps * 4 * kVec;   // 32 (bf16) or 128 (FP8) k per chunk
  constexpr bool kF16 = PRO == kProNormF16 || PRO == kProStageF16;  // variant 6
  static_assert(!kF16 || (F8 && NT <= 2), "variant 6: FP8 weights, M <= 16");
  constexpr bool kQ = PRO == kProStageE4M3 || PRO == kProNormE4M3;  // variant 7 (W8A8)
  static_assert(!kQ || (F8 && NT <= 2), "variant 7: FP8 weights, M <= 16");
  using XF = XFrag<NT, F8 && !kQ>;  // variant 7: 16 e4m3 of x per load step, not 16 bf16
  __shared__ float red[kWarps][NT * 4][32];
  __shared__ float unscale[kF16 ? 16 : 1];  // kF16: 2^-e of each row

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rt = warp / a.kw, kw = warp - rt * a.kw;
  const int tile = blockIdx.x * (kWarps / a.kw) + rt;
  const int n0 = tile * kTileRows;
  const int c_begin = blockIdx.y * a.cps, c_end = min(a.n_chunks, c_begin + a.cps);
  const int c_full = min(c_end, a.K / kChunk);  // chunks [.., c_full) lie inside K
  const int64_t row_bytes = static_cast<int64_t>(a.K) * kEl;
  // FP8 takes the SwiGLU epilogue at M <= 16 only (NT <= 2): compiled into the larger FP8
  // tiles, its branches and second scale row cost registers (spills at NT = 4)
  constexpr bool kGlu = !F8 || NT <= 2;
  const TileRows tr = tile_rows<kGlu>(a, tile, g);
  const uint8_t* w0 = a.w + (tr.oka ? static_cast<int64_t>(tr.ra) * row_bytes : 0) + t * 16;
  const uint8_t* w1 = a.w + (tr.okb ? static_cast<int64_t>(tr.rb) * row_bytes : 0) + t * 16;
  // a batch's weights: U chunks x kSteps loads of the tile's rows g (a) and g + 8 (b)
  struct WBatch {
    uint4 a[U][kSteps], b[U][kSteps];
  };
  // One batch: U chunks from c0, every load first (2 U kSteps x 16 bytes of weights in flight
  // per lane), then the MMAs. kCheck (a warp's last batch, if partial): a chunk past the
  // split's range or a step past K loads from its rows' starts instead and counts as zeros.
  auto live_step = [&](int c0, int u, int s, auto check) {
    constexpr bool kCheck = decltype(check)::value;
    const int kk = (c0 + u) * kChunk + s * 4 * kVec;
    return !kCheck || (c0 + u < c_end && kk + t * kVec < a.K);
  };
  auto load_batch = [&](WBatch& wv, int c0, auto check) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        // a dead step reads the first 16 bytes of the row (the lane's offset t * kVec is
        // undone: K may be shorter than a quad's 4 * kVec)
        const int64_t at = live_step(c0, u, s, check) ? (c0 + u) * kChunk + s * 4 * kVec
                                                      : -t * kVec;
        if constexpr (kPipe) {
          wv.a[u][s] = ld_weights_early(w0 + at * kEl);
          wv.b[u][s] = ld_weights_early(w1 + at * kEl);
        } else {
          wv.a[u][s] = ld_weights(w0 + at * kEl);
          wv.b[u][s] = ld_weights(w1 + at * kEl);
        }
      }
    }
  };
  // variant 4 loads the warp's first batch now, before the PDL wait and the prologue
  // (checked: the same addresses as unchecked for a full batch, which the main loop then
  // uses; a warp without one reads only inside its rows, and its partial batch loads again)
  int c0 = c_begin + kw * U;
  WBatch cur;
  if constexpr (kPipe) load_batch(cur, c0, std::true_type{});
  if (!kPipe && (a.pdl == kPdlPrefetch || a.pdl == kPdlEarly)) {
    // launched early (PDL): the first kPrefetch full batches of this warp's weights into L2
    // while the kernel before, whose output x is, finishes
    constexpr int kPrefetch = 2;
    for (int b = 0; b < kPrefetch; ++b) {
      const int cb = c_begin + (kw + b * a.kw) * U;
      if (cb + U > c_full) break;
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          const int64_t kk = static_cast<int64_t>(cb + u) * kChunk + s * 4 * kVec;
          rtvoice::prefetch_l2(w0 + kk * kEl);
          rtvoice::prefetch_l2(w1 + kk * kEl);
        }
    }
  }
  pdl_wait();
  if (a.pdl == kPdlEarly) pdl_trigger();
  // x rows 8 j + g at the lane's k offset: in global memory, or (a prologue) made in shared
  using XRow = std::conditional_t<PRO != kProPlain, uint32_t, const __nv_bfloat16*>;
  XRow xrow[NT];
  const float* sxs = nullptr;  // variant 7: x's block scales [chunk][16] (shared)
  if constexpr (kQ) {
    extern __shared__ __align__(16) unsigned char smem_x[];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_x);
    uint8_t* xq = smem_x + (PRO == kProNormE4M3 ? a.M * a.xs_rs * 2 : 0);
    const int qrs = quant_row_bytes(a.K);
    float* sx = reinterpret_cast<float*>(xq + a.M * qrs);
    if constexpr (PRO == kProNormE4M3) norm_rows(a, xs);
    quant_rows<PRO == kProNormE4M3>(a, xs, xq, sx);
    sxs = sx;
#pragma unroll
    for (int j = 0; j < NT; ++j)
      xrow[j] = smem_u32(xq + (8 * j + g < a.M ? (8 * j + g) * qrs : 0) + t * kVec);
  } else if constexpr (PRO != kProPlain) {
    extern __shared__ __align__(16) unsigned char smem_x[];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_x);
    if constexpr (PRO == kProNorm)
      norm_rows(a, xs);
    else if constexpr (PRO == kProNormF16)
      norm_rows<true>(a, xs, unscale);
    else if constexpr (PRO == kProStageF16)
      norm_rows<true, false>(a, xs, unscale);
    else
      attend_rows(a, xs, smem_x + static_cast<int64_t>(a.M) * a.xs_rs * 2);
#pragma unroll
    for (int j = 0; j < NT; ++j)
      xrow[j] = smem_u32(xs + (8 * j + g < a.M ? (8 * j + g) * a.xs_rs : 0) + t * kVec);
  } else {
#pragma unroll
    for (int j = 0; j < NT; ++j)
      xrow[j] = a.x + (8 * j + g < a.M ? (8 * j + g) * a.x_rs : 0) + t * kVec;
  }
  // FP8: the scale rows of the tile's MMA rows g (sa) and g + 8 (sb): one block row for a
  // plain tile (16 rows inside a 128-row block); with SwiGLU the gate rows' and the up
  // rows' (8 each, the host checked I % 128 == 0)
  const int64_t na = kGlu && a.glu > 0 ? tile * 8 : n0;
  const int64_t nb = kGlu && a.glu > 0 ? a.glu + tile * 8 : n0;
  const float* sra = F8 ? a.scale + (na / kScaleBlock) * a.kb : nullptr;
  const float* srb = F8 ? a.scale + (nb / kScaleBlock) * a.kb : nullptr;

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

  auto compute_batch = [&](WBatch& wv, int c0, auto check) {
    constexpr bool kCheck = decltype(check)::value;
    auto& wa = wv.a;
    auto& wb = wv.b;
    XF xf[U][kSteps];
    bool live[U][kSteps];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int s = 0; s < kSteps; ++s) live[u][s] = live_step(c0, u, s, check);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int kk = live[u][s] ? (c0 + u) * kChunk + s * 4 * kVec : -t * kVec;
        if constexpr (kQ)
          load_xq(xf[u][s], xrow, kk);
        else
          load_x(xf[u][s], xrow, kk);
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if constexpr (kCheck) {
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          if (!live[u][s]) {  // both operands zero: exact zeros whatever was read
            const uint4 z = make_uint4(0u, 0u, 0u, 0u);
            wa[u][s] = wb[u][s] = z;
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
              for (int h = 0; h < (F8 && !kQ ? 2 : 1); ++h) xf[u][s].v[j][h] = z;
          }
        }
      }
      if constexpr (F8) {
        float part[NT][4] = {};  // this chunk's (scale block's) sum
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          if constexpr (kQ)
            mma_direct<NT, true>(part, wa[u][s], wb[u][s], xf[u][s]);
          else
            mma_step<NT, F8, kF16>(part, wa[u][s], wb[u][s], xf[u][s]);
        }
        const bool in = !kCheck || c0 + u < c_end;
        const float sa = in ? __ldg(sra + c0 + u) : 0.f;
        const float sb = !kGlu ? sa : in ? __ldg(srb + c0 + u) : 0.f;
        if constexpr (kQ) {  // and x's block scale of each column (x row 8 j + 2 t (+1))
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int m = 8 * j + 2 * t + (e & 1);
              const float xsc = in && m < a.M ? sxs[(c0 + u) * 16 + m] : 0.f;
              acc[j][e] = fmaf((e < 2 ? sa : sb) * xsc, part[j][e], acc[j][e]);
            }
        } else {
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = fmaf(e < 2 ? sa : sb, part[j][e], acc[j][e]);
        }
      } else {
        mma_step<NT, F8>(acc, wa[u][0], wb[u][0], xf[u][0]);
      }
    }
  };
  auto batch = [&](int c0, auto check) {
    WBatch wv;
    load_batch(wv, c0, check);
    compute_batch(wv, c0, check);
  };
  // batches dealt round-robin to the tile's kw warps; whole ones unchecked, then at most one
  // partial one per warp (the next would start at or past c_full + 1 >= c_end)
  if constexpr (kPipe) {
    if (c0 + U <= c_full) {
      for (;;) {  // cur holds batch c0 (loaded one iteration, or the prologue, before)
        const int c1 = c0 + a.kw * U;
        const bool more = c1 + U <= c_full;
        WBatch nxt;
        load_batch(nxt, more ? c1 : c0, std::false_type{});
        compute_batch(cur, c0, std::false_type{});
        c0 = c1;
        if (!more) break;
        cur = nxt;
      }
    }
  } else {
    for (; c0 + U <= c_full; c0 += a.kw * U) batch(c0, std::false_type{});
  }
  if (c0 < c_end) batch(c0, std::true_type{});
  if (a.pdl != kPdlEarly) pdl_trigger();  // the next kernel's blocks come in for our tail

  // the kw warps of a tile: the first one sums the others' accumulators
  if (a.kw > 1) {
    if (kw > 0) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[warp][j * 4 + e][lane] = acc[j][e];
    }
    __syncthreads();
    if (kw > 0) return;
    for (int o = 1; o < a.kw; ++o) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] += red[warp + o][j * 4 + e][lane];
    }
  }
  if constexpr (kF16) {  // x row m was 2^e times itself: exact back by 2^-e
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = 8 * j + 2 * t + (e & 1);
        if (m < a.M) acc[j][e] *= unscale[m];
      }
  }
  // d[e]: row tr.ra (tr.rb for e >= 2), x row 8 j + 2 t (+ 1 for odd e)
#pragma unroll
  for (int j = 0; j < NT; ++j) store_tile<kGlu>(a, acc[j], tr, 8 * j + 2 * t);
}

// ---------------------------------------------------------------- variants 1-3: pipelined
// Same tiles, fragments and K split as above, but the weights travel global -> shared memory
// by cp.async into a per-warp ring of S stages, so a warp keeps S - 1 chunks of loads in
// flight while it converts and multiplies the oldest one (variant 0 issues a batch, waits for
// all of it, computes, and only then issues the next: one exposed round trip per batch).
// A chunk is 128 bytes of each of the warp's rows (FP8: 128 k = one scale block; bf16: 64 k):
// RT x 2 rows x 2 steps x 16 bytes per lane, plus the chunk's block scale (FP8). Each lane
// copies exactly the bytes it later reads (slot [stage][load][lane]), so no barrier is ever
// needed, only cp.async.wait_group, and the reads are conflict-free 16-byte accesses. Tiles
// are RT x 16 rows (x fragments reused RT times: at M > 16 the L1 traffic of x, not HBM,
// would bound a 16-row tile). Chunks are dealt round-robin to the kw warps of a tile.
template <bool F8, int RT>
constexpr int pipe_stage_bytes() {
  return RT * 4 * 512 + (F8 ? 128 : 0);
}

template <int NT, int RT, int S, bool F8, int CONV, int MINB>
__global__ void __launch_bounds__(kThreads, MINB) linear_pipe_kernel(const Args a) {
  constexpr int kEl = F8 ? 1 : 2;
  constexpr int kVec = 16 / kEl;       // weight elements per 16-byte load
  constexpr int kXr = kVec / 2;        // x registers (2 bf16) per n-tile and load step
  constexpr int kChunk = 8 * kVec;     // k per chunk: 2 steps x 4 lanes x kVec
  constexpr int kLoads = RT * 4;       // 16-byte weight loads per lane and chunk
  constexpr int kStage = pipe_stage_bytes<F8, RT>();
  constexpr bool kXAll = NT == 1;      // load both steps' x before waiting for the weights
  static_assert(!F8 || kChunk == kScaleBlock, "an FP8 chunk is one scale block");
  static_assert((kTileRows * RT) <= kScaleBlock && kScaleBlock % (kTileRows * RT) == 0,
                "a tile's rows share one scale row");
  extern __shared__ __align__(16) unsigned char smem[];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rt = warp / a.kw, kwi = warp - rt * a.kw;
  const int tile = blockIdx.x * (kWarps / a.kw) + rt;
  const int n0 = tile * (kTileRows * RT);
  const int c_begin = blockIdx.y * a.cps, c_end = min(a.n_chunks, c_begin + a.cps);
  const int c_full = min(c_end, a.K / kChunk);  // chunks [.., c_full) lie inside K
  const int64_t row_bytes = static_cast<int64_t>(a.K) * kEl;
  TileRows tr[RT];  // sub-tile r: MMA rows g (h = 0) and g + 8 (h = 1)
  const uint8_t* wrow[RT][2];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    tr[r] = tile_rows<!F8>(a, tile * RT + r, g);
    wrow[r][0] = a.w + (tr[r].oka ? static_cast<int64_t>(tr[r].ra) * row_bytes : 0) + t * 16;
    wrow[r][1] = a.w + (tr[r].okb ? static_cast<int64_t>(tr[r].rb) * row_bytes : 0) + t * 16;
  }
  const __nv_bfloat16* xrow[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j)
    xrow[j] = a.x + (8 * j + g < a.M ? (8 * j + g) * a.x_rs : 0) + t * kVec;
  const float* srow = F8 ? a.scale + static_cast<int64_t>(n0 / kScaleBlock) * a.kb : nullptr;

  unsigned char* ring = smem + warp * (S * kStage);
  const uint32_t ring_lane = smem_u32(ring) + lane * 16;
  pdl_wait();  // (PDL) x and the outputs belong to the kernels before
  if (a.pdl == kPdlEarly) pdl_trigger();

  // chunk c into stage st: load (r, s, h) = row tr[r].ra (h = 0) or .rb (h = 1), k = c kChunk
  // + s 4 kVec + t kVec at slot (r * 2 + s) * 2 + h. The chunk reaching past K zero-fills its
  // dead steps.
  auto issue = [&](int c, int st) {
    const uint32_t dst = ring_lane + st * kStage;
    const int64_t k0 = static_cast<int64_t>(c) * kChunk;
    if (c < c_full) {
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            cp_async16(dst + ((r * 2 + s) * 2 + h) * 512, wrow[r][h] + (k0 + s * 4 * kVec) * kEl);
    } else {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const bool live = k0 + s * 4 * kVec + t * kVec < a.K;
        const int64_t at = live ? (k0 + s * 4 * kVec) * kEl : -t * 16;  // dead: the row start
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            cp_async16_zfill(dst + ((r * 2 + s) * 2 + h) * 512, wrow[r][h] + at, live ? 16 : 0);
      }
    }
    if constexpr (F8) cp_async4(smem_u32(ring) + st * kStage + kLoads * 512 + lane * 4, srow + c);
  };

  // x of chunk c, step s, n-tile j (a dead step reads its row's start: finite values times
  // the zero-filled weights). Variant 3 converts it to f16 once for the RT tiles.
  auto load_xs = [&](uint32_t (&xb)[NT][kXr], int c, int s) {
    const int k = c * kChunk + s * 4 * kVec;
    const int off = k + t * kVec < a.K ? k : -t * kVec;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint4 v0 = ld_x_early(xrow[j] + off);
      xb[j][0] = v0.x, xb[j][1] = v0.y, xb[j][2] = v0.z, xb[j][3] = v0.w;
      if constexpr (F8) {
        const uint4 v1 = ld_x_early(xrow[j] + off + 8);
        xb[j][4] = v1.x, xb[j][5] = v1.y, xb[j][6] = v1.z, xb[j][7] = v1.w;
      }
    }
  };

  // d += rows (wa: g, wb: g + 8) x the x fragments of one step
  auto mma_step_p = [&](float (&d)[NT][4], const uint4& wa, const uint4& wb,
                        const uint32_t (&xb)[NT][kXr]) {
    if constexpr (F8) {
      uint32_t ra[8], rb[8];
      e4m3x16_convert<CONV>(wa, ra);
      e4m3x16_convert<CONV>(wb, rb);
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if constexpr (CONV == kConvCvt16)
            mma_f16(d[j], ra[2 * q], rb[2 * q], ra[2 * q + 1], rb[2 * q + 1], xb[j][2 * q],
                    xb[j][2 * q + 1]);
          else
            mma_bf16(d[j], ra[2 * q], rb[2 * q], ra[2 * q + 1], rb[2 * q + 1], xb[j][2 * q],
                     xb[j][2 * q + 1]);
        }
    } else {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        mma_bf16(d[j], wa.x, wb.x, wa.y, wb.y, xb[j][0], xb[j][1]);
        mma_bf16(d[j], wa.z, wb.z, wa.w, wb.w, xb[j][2], xb[j][3]);
      }
    }
  };

  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][j][e] = 0.f;

  const int first = c_begin + kwi;  // this warp's chunks: first, first + kw, ... < c_end
  const int n_my = first < c_end ? (c_end - first + a.kw - 1) / a.kw : 0;
  // prologue: S - 1 chunks in flight (one commit group per chunk, empty past the end, so
  // that chunk i is always group i)
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < n_my) issue(first + i * a.kw, i);
    cp_async_commit();
  }
  int st_w = S - 1, st_r = 0;
  for (int i = 0; i < n_my; ++i) {
    if (i + S - 1 < n_my) issue(first + (i + S - 1) * a.kw, st_w);
    cp_async_commit();
    st_w = st_w == S - 1 ? 0 : st_w + 1;
    const int c = first + i * a.kw;
    uint32_t xb[kXAll ? 2 : 1][NT][kXr];
    if constexpr (kXAll) {
      load_xs(xb[0], c, 0);
      load_xs(xb[1], c, 1);
    }
    cp_async_wait<S - 1>();  // chunk i (group i) has landed; S - 1 younger groups may not
    const unsigned char* slot = ring + st_r * kStage + lane * 16;
    float sc = 0.f;  // FP8: the chunk's block scale (variant 2: times 2^60, the sums too)
    if constexpr (F8) {
      sc = *reinterpret_cast<const float*>(ring + st_r * kStage + kLoads * 512 + lane * 4);
      if constexpr (CONV == kConvFold) sc *= 0x1p60f;
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      uint32_t(&xs)[NT][kXr] = xb[kXAll ? s : 0];
      if constexpr (!kXAll) load_xs(xs, c, s);
      if constexpr (CONV == kConvCvt16) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int q = 0; q < kXr; ++q) xs[j][q] = bf16x2_to_f16x2(xs[j][q]);
      }
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const uint4 wa = *reinterpret_cast<const uint4*>(slot + ((r * 2 + s) * 2) * 512);
        const uint4 wb = *reinterpret_cast<const uint4*>(slot + ((r * 2 + s) * 2 + 1) * 512);
        if constexpr (F8) {
          // this step's sums, scaled into the accumulator (per step rather than per chunk:
          // fewer registers live, for a few FMAs per 4 NT MMAs)
          float part[NT][4];
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) part[j][e] = 0.f;
          mma_step_p(part, wa, wb, xs);
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc[r][j][e] = fmaf(sc, CONV == kConvFold ? part[j][e] * 0x1p60f : part[j][e],
                                  acc[r][j][e]);
        } else {
          mma_step_p(acc[r], wa, wb, xs);
        }
      }
    }
    st_r = st_r == S - 1 ? 0 : st_r + 1;
  }
  cp_async_wait<0>();
  if (a.pdl != kPdlEarly) pdl_trigger();

  // the kw warps of a tile: the first one sums the others' accumulators (through the rings'
  // memory, once every warp of the block is done with its ring)
  if (a.kw > 1) {
    float* red = reinterpret_cast<float*>(smem);
    constexpr int kAcc = RT * NT * 4;
    __syncthreads();
    if (kwi > 0) {
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            red[(warp * kAcc + (r * NT + j) * 4 + e) * 32 + lane] = acc[r][j][e];
    }
    __syncthreads();
    if (kwi > 0) return;
    for (int o = 1; o < a.kw; ++o) {
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc[r][j][e] += red[((warp + o) * kAcc + (r * NT + j) * 4 + e) * 32 + lane];
    }
  }
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j) store_tile<!F8>(a, acc[r][j], tr[r], 8 * j + 2 * t);
}

// y = sum over the splits' float32 partials ws [splits, M, N], rounded once to bf16 (plus
// the residual res [M, N] (row stride res_rs), if any, as add_residual).
__global__ void linear_splits_reduce(const float* __restrict__ ws, __nv_bfloat16* __restrict__ y,
                                     int64_t mn, int splits, const __nv_bfloat16* res, int n,
                                     int64_t res_rs) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < mn;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int p = 0; p < splits; ++p) s += ws[p * mn + i];
    y[i] = res != nullptr ? add_residual(s, res[(i / n) * res_rs + i % n]) : __float2bfloat16(s);
  }
}

// The SwiGLU epilogue over split-K partials ws [splits, M, 2 I]: y [M, I] = silu(gate) * up.
__global__ void linear_splits_reduce_glu(const float* __restrict__ ws,
                                         __nv_bfloat16* __restrict__ y, int64_t m_rows, int glu,
                                         int splits) {
  const int64_t mi = m_rows * glu, mn = 2 * mi;
  pdl_wait();
  pdl_trigger();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < mi;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = i / glu, at = m * 2 * glu + (i - m * glu);
    float gate = 0.f, up = 0.f;
    for (int p = 0; p < splits; ++p) {
      gate += ws[p * mn + at];
      up += ws[p * mn + at + glu];
    }
    y[i] = swiglu_bf16(gate, up);
  }
}

// (SM count, compute capability major, minor) per device; a racing first call writes the same
// values
struct DevInfo {
  int n_sm, major, minor;
};
DevInfo device_info(int dev) {
  static int cached[64][3] = {};
  if (dev < 64 && cached[dev][0] != 0) return {cached[dev][0], cached[dev][1], cached[dev][2]};
  int n = 0, major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (dev < 64) {
    cached[dev][2] = minor;
    cached[dev][1] = major;
    cached[dev][0] = n;
  }
  return {n, major, minor};
}

// One kernel instantiation as the host sees it.
struct Kern {
  void (*fn)(Args);
  int smem;   // dynamic shared memory bytes
  int rows;   // weight rows per warp tile
  int chunk;  // k per chunk
  int occ;    // resident blocks per SM (0: not asked; variant 0)
};

// <n-tiles, chunks per batch U, FP8, min blocks per SM>: U shrinks as the x fragments (NT
// per load step) take registers. The min-blocks bound matters beyond occupancy: without
// it ptxas sinks each load to its MMA (fewest registers) and a warp has one load of each
// row in flight instead of U (FP8: 2 U); with it the whole batch is issued first. Chosen
// as the largest bound that compiles without spills.
// Variant 0's instantiations <n-tiles, batch chunks U, FP8, min blocks per SM>; variant 4
// (kPipe) holds two batches of weights in registers, so it takes two blocks per SM for bf16
// at M <= 8 (not three) and one for FP8 at M <= 32 (spills otherwise; FP8 at M <= 16 spills
// 16 bytes, kept: its U must stay variant 0's, which sets the summation order across a
// tile's warps, for the two to be bit-equal). Variant 5 (v5_kern) is 4 with half of 0's
// batches at M <= 16, so as many weight bytes in flight per warp as 0 and the registers for
// one block per SM more than 4 (FP8 at M <= 8: three, where 0 has two; its normed form
// spills 4 bytes there, the plain one nothing).
template <bool F8, bool kPipe = false>
Kern v0_kern(int nt) {
  void (*fn)(Args);
  if constexpr (F8) {
    fn = nt <= 1   ? linear_small_m_kernel<1, 2, F8, 2, kProPlain, kPipe>
         : nt <= 2 ? linear_small_m_kernel<2, 2, F8, 2, kProPlain, kPipe>
         : nt <= 4 ? linear_small_m_kernel<4, 1, F8, kPipe ? 1 : 2, kProPlain, kPipe>
                   : linear_small_m_kernel<8, 1, F8, 1, kProPlain, kPipe>;
  } else {
    fn = nt <= 1   ? linear_small_m_kernel<1, 4, F8, kPipe ? 2 : 3, kProPlain, kPipe>
         : nt <= 2 ? linear_small_m_kernel<2, 4, F8, 2, kProPlain, kPipe>
         : nt <= 4 ? linear_small_m_kernel<4, 2, F8, 2, kProPlain, kPipe>
                   : linear_small_m_kernel<8, 1, F8, 1, kProPlain, kPipe>;
  }
  return {fn, 0, kTileRows, F8 ? 128 : 32, 0};
}

template <bool F8>
Kern v5_kern(int nt) {
  void (*fn)(Args);
  if constexpr (F8) {
    fn = nt <= 1   ? linear_small_m_kernel<1, 1, F8, 3, kProPlain, true>
         : nt <= 2 ? linear_small_m_kernel<2, 1, F8, 2, kProPlain, true>
         : nt <= 4 ? linear_small_m_kernel<4, 1, F8, 1, kProPlain, true>
                   : linear_small_m_kernel<8, 1, F8, 1, kProPlain, true>;
  } else {
    fn = nt <= 1   ? linear_small_m_kernel<1, 2, F8, 3, kProPlain, true>
         : nt <= 2 ? linear_small_m_kernel<2, 2, F8, 2, kProPlain, true>
         : nt <= 4 ? linear_small_m_kernel<4, 2, F8, 2, kProPlain, true>
                   : linear_small_m_kernel<8, 1, F8, 1, kProPlain, true>;
  }
  return {fn, 0, kTileRows, F8 ? 128 : 32, 0};
}

// The most shared memory a prologue's rows may take (M x (K + pad) bf16).
constexpr int kNormSmemMax = 160 * 1024;
// elements: rows 64 bytes apart mod 128, no bank conflicts for bf16 W's reads (16 bytes per
// lane at t * 16); FP8 W's (32 bytes at t * 32) conflict two ways
constexpr int kNormPad = 32;

// Variant 0 with a prologue (kProNorm or kProAttend; bf16 or FP8 W, M <= 16) for `smem`
// bytes of shared memory: past the default 48 KB (with its static shared memory) the kernel
// is allowed that much (the largest asked so far per device and instantiation, under a lock:
// a smaller setting after a larger one would fail the larger launch), within what the device
// allows a block beside the kernel's static shared memory.
Kern v0_pro_kern(int pro, bool f8, int nt, int dev, int smem, int variant = 0) {
  // the instantiations of v0_kern with the prologues (the normed one in variants 4-6 too)
  void (*fn)(Args);
  const bool pipe = variant == 4 || variant == 5;
  if (pro == kProStageE4M3)  // variant 7 (FP8 only, checked): x's rows quantised
    fn = nt <= 1 ? linear_small_m_kernel<1, 1, true, 3, kProStageE4M3, true>
                 : linear_small_m_kernel<2, 1, true, 2, kProStageE4M3, true>;
  else if (pro == kProNorm && variant == 7)  // normed, then quantised
    fn = nt <= 1 ? linear_small_m_kernel<1, 1, true, 3, kProNormE4M3, true>
                 : linear_small_m_kernel<2, 1, true, 2, kProNormE4M3, true>;
  else if (pro == kProNorm && variant == 6)  // FP8 only (checked): variant 5's, rows in f16
    fn = nt <= 1 ? linear_small_m_kernel<1, 1, true, 3, kProNormF16, true>
                 : linear_small_m_kernel<2, 1, true, 2, kProNormF16, true>;
  else if (pro == kProStageF16)  // variant 6 without a norm
    fn = nt <= 1 ? linear_small_m_kernel<1, 1, true, 3, kProStageF16, true>
                 : linear_small_m_kernel<2, 1, true, 2, kProStageF16, true>;
  else if (pro == kProNorm && variant == 5)
    fn = f8 ? (nt <= 1 ? linear_small_m_kernel<1, 1, true, 3, kProNorm, true>
                       : linear_small_m_kernel<2, 1, true, 2, kProNorm, true>)
            : (nt <= 1 ? linear_small_m_kernel<1, 2, false, 3, kProNorm, true>
                       : linear_small_m_kernel<2, 2, false, 2, kProNorm, true>);
  else if (pro == kProNorm && pipe)
    fn = f8 ? (nt <= 1 ? linear_small_m_kernel<1, 2, true, 2, kProNorm, true>
                       : linear_small_m_kernel<2, 2, true, 2, kProNorm, true>)
            : (nt <= 1 ? linear_small_m_kernel<1, 4, false, 2, kProNorm, true>
                       : linear_small_m_kernel<2, 4, false, 2, kProNorm, true>);
  else if (pro == kProNorm)
    fn = f8 ? (nt <= 1 ? linear_small_m_kernel<1, 2, true, 2, kProNorm>
                       : linear_small_m_kernel<2, 2, true, 2, kProNorm>)
            : (nt <= 1 ? linear_small_m_kernel<1, 4, false, 3, kProNorm>
                       : linear_small_m_kernel<2, 4, false, 2, kProNorm>);
  else
    fn = f8 ? (nt <= 1 ? linear_small_m_kernel<1, 2, true, 2, kProAttend>
                       : linear_small_m_kernel<2, 2, true, 2, kProAttend>)
            : (nt <= 1 ? linear_small_m_kernel<1, 4, false, 3, kProAttend>
                       : linear_small_m_kernel<2, 4, false, 2, kProAttend>);
  static std::mutex lock;
  static int allowed[64][40] = {};  // [device][i below]
  const int i = (nt <= 1 ? 0 : 1) + (f8 ? 2 : 0) +
                (pro == kProAttend || pro == kProStageF16 || pro == kProStageE4M3 ? 4 : 0) +
                (variant == 4 ? 8 : variant == 5 ? 16 : variant == 6 ? 24 : variant == 7 ? 32 : 0);
  // the kernel's static shared memory (its warps' partial sums, red[kWarps][NT * 4][32])
  // counts toward the default 48 KB per block too
  const int stat = kWarps * (nt <= 1 ? 1 : 2) * 4 * 32 * static_cast<int>(sizeof(float)) +
                   16 * static_cast<int>(sizeof(float));  // + variant 6's row scales
  if (smem + stat > 48 * 1024) {
    const std::lock_guard<std::mutex> hold(lock);
    if (dev >= 64 || smem > allowed[dev][i]) {
      cudaFuncAttributes attr;
      C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
      int optin = 0;
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
      TORCH_CHECK(smem + static_cast<int>(attr.sharedSizeBytes) <= optin,
                  "linear_small_m: the ", pro == kProAttend ? "attention" : "normed, staged or quantised",
                  " prologue needs ", smem + static_cast<int>(attr.sharedSizeBytes),
                  " bytes of shared memory for its M = ", nt <= 1 ? "1..8" : "9..16",
                  " rows; this device allows ", optin, " per block (fewer rows)");
      C10_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      if (dev < 64) allowed[dev][i] = smem;
    }
  }
  return {fn, smem, kTileRows, f8 ? 128 : 32, 0};
}

// The pipelined kernel with its shared memory set up and its occupancy (cached per device).
template <int NT, int RT, int S, bool F8, int CONV, int MINB>
Kern pipe_kern(int dev) {
  constexpr int ring = kWarps * S * pipe_stage_bytes<F8, RT>();
  constexpr int red = kWarps * RT * NT * 4 * 32 * 4;
  constexpr int smem = ring > red ? ring : red;
  void (*fn)(Args) = linear_pipe_kernel<NT, RT, S, F8, CONV, MINB>;
  static int occ[64] = {};
  int o = dev < 64 ? occ[dev] : 0;
  if (o == 0) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, fn, kThreads, smem));
    TORCH_CHECK(o >= 1, "linear_small_m: the pipelined kernel (", smem,
                " bytes of shared memory) does not fit on this device");
    if (dev < 64) occ[dev] = o;
  }
  return {fn, smem, kTileRows * RT, F8 ? 128 : 64, o};
}

// <n-tiles, row tiles per warp RT, stages S, FP8, conversion, min blocks per SM>. Shared
// memory per block: 8 warps x S x RT x 2 KB (+ 1 KB of scales per S for FP8); a warp has
// S - 1 chunks (RT x 2 KB) in flight. M <= 8: three blocks of S = 4 per SM (68 KB each, 144
// KB in flight per SM); M <= 16: two of S = 6 (the x fragments of two n-tiles do not fit
// three blocks' registers); M <= 32: 32-row tiles (x read through L1 half as often), one
// block of S = 6; M <= 64: one block of S = 8 (~230 registers: x fragments of 8 n-tiles).
// The bounds are the largest that compile without spills.
template <bool F8, int CONV>
Kern pipe_kern_nt(int nt, int dev) {
  if (nt <= 1) return pipe_kern<1, 1, 4, F8, CONV, 3>(dev);
  if (nt <= 2) return pipe_kern<2, 1, 6, F8, CONV, 2>(dev);
  if (nt <= 4) return pipe_kern<4, 2, 6, F8, CONV, 1>(dev);
  return pipe_kern<8, 1, 8, F8, CONV, 1>(dev);
}

Kern pick_kernel(bool f8, int variant, int nt, int dev) {
  if (variant == 0) return f8 ? v0_kern<true>(nt) : v0_kern<false>(nt);
  if (variant == 4) return f8 ? v0_kern<true, true>(nt) : v0_kern<false, true>(nt);
  if (variant == 5) return f8 ? v5_kern<true>(nt) : v5_kern<false>(nt);
  if (!f8) return pipe_kern_nt<false, kConvBits>(nt, dev);
  if (variant == 1) return pipe_kern_nt<true, kConvBits>(nt, dev);
  if (variant == 2) return pipe_kern_nt<true, kConvFold>(nt, dev);
  return pipe_kern_nt<true, kConvCvt16>(nt, dev);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The attention prologue's operands, checked by linear_small_m_attend.
struct AttendArgs {
  __nv_bfloat16* k;
  __nv_bfloat16* v;
  const __nv_bfloat16* cs;
  int hkv, s, pos;
};

void run_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> scale,
                torch::Tensor out, int64_t splits, int64_t kwarps, int64_t variant, bool glu,
                std::optional<torch::Tensor> residual, std::optional<torch::Tensor> norm_weight,
                double eps, int64_t pdl, const AttendArgs* attend) {
  TORCH_CHECK(x.is_cuda() && w.device() == x.device() && out.device() == x.device(),
              "linear_small_m: x, w and out must be CUDA tensors on one device");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2,
              "linear_small_m: x must be [M, K], w [N, K] and out [M, N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  // register batches (linear_small_m_kernel): variants 0, 4, 5, 6, 7
  const bool batched = variant == 0 || variant == 4 || variant == 5 || variant == 6 ||
                       variant == 7;
  TORCH_CHECK(!glu || (N % 2 == 0 && (!scale.has_value() ||
                                       (batched && (N / 2) % kScaleBlock == 0 &&
                                        M <= 16))),
              "linear_small_m: the SwiGLU epilogue takes weights [W1; W3] with an even row "
              "count (FP8: variant 0, 4, 5, 6 or 7, M <= 16 rows and I = N / 2 a multiple of ",
              kScaleBlock,
              ", so that W1 and W3 keep their own block scales), got ", N, " rows",
              scale.has_value() ? " of FP8 weights" : "", ", M = ", M, " and variant ", variant);
  TORCH_CHECK(w.size(1) == K && out.size(0) == M && out.size(1) == (glu ? N / 2 : N),
              "linear_small_m: shapes do not agree: x ", rtvoice::dims(x), ", w ",
              rtvoice::dims(w), ", out ",
              rtvoice::dims(out), glu ? " (SwiGLU: out [M, N / 2])" : "");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "linear_small_m: x and out must be bfloat16");
  const bool f8 = scale.has_value();
  if (f8) {
    const auto& s = *scale;
    TORCH_CHECK(w.scalar_type() == at::kFloat8_e4m3fn,
                "linear_small_m: with a scale, w must be float8_e4m3fn, got ", w.scalar_type());
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.device() == x.device() && s.dim() == 2 &&
                    s.size(0) == (N + kScaleBlock - 1) / kScaleBlock &&
                    s.size(1) == (K + kScaleBlock - 1) / kScaleBlock && s.is_contiguous(),
                "linear_small_m: scale must be a contiguous float32 [ceil(N/128), ceil(K/128)]"
                " = [", (N + kScaleBlock - 1) / kScaleBlock, ", ",
                (K + kScaleBlock - 1) / kScaleBlock, "] on x's device, got ", s.scalar_type(),
                " ", rtvoice::dims(s));
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16,
                "linear_small_m: without a scale, w must be bfloat16, got ", w.scalar_type());
  }
  TORCH_CHECK(M <= kMaxM, "linear_small_m: M = ", M, " rows; at most ", kMaxM);
  TORCH_CHECK(K >= 16 && K % 16 == 0, "linear_small_m: K = ", K, " must be a multiple of 16");
  TORCH_CHECK(N >= 1 && N < (int64_t{1} << 31) && K < (int64_t{1} << 31),
              "linear_small_m: N = ", N, " must be >= 1 (and N, K < 2^31)");
  TORCH_CHECK(w.is_contiguous() && aligned16(w.data_ptr()),
              "linear_small_m: w must be contiguous and 16-byte aligned");
  TORCH_CHECK(out.is_contiguous(), "linear_small_m: out must be contiguous");
  TORCH_CHECK(x.stride(1) == 1 && aligned16(x.data_ptr()) &&
                  (M <= 1 || (x.stride(0) * 2) % 16 == 0),
              "linear_small_m: x's rows must be contiguous, 16-byte aligned, with a row stride "
              "that is a multiple of 8 elements; got strides ", rtvoice::dims(x.strides()));
  TORCH_CHECK(splits >= 0 && splits <= kMaxSplits, "linear_small_m: splits must be in 0..",
              kMaxSplits, " (0: automatic), got ", splits);
  TORCH_CHECK(kwarps == 0 || kwarps == 1 || kwarps == 2 || kwarps == 4 || kwarps == 8,
              "linear_small_m: kwarps must be 0 (automatic), 1, 2, 4 or 8, got ", kwarps);
  TORCH_CHECK(variant >= 0 && variant <= 7, "linear_small_m: variant must be 0..7, got ",
              variant);
  TORCH_CHECK(pdl >= kPdlOff && pdl <= kPdlEarly, "linear_small_m: pdl must be 0..3, got ",
              pdl);
  TORCH_CHECK(variant != 6 || (f8 && M <= 16 && M * (K + kNormPad) * 2 <= kNormSmemMax),
              "linear_small_m: variant 6 takes FP8 weights and stages x's rows in shared memory: "
              "M <= 16 and M x (K + ", kNormPad, ") x 2 bytes <= ", kNormSmemMax, ", got M = ",
              M, ", K = ", K);
  // variant 7: x's e4m3 rows and their scales (after the normed rows, with norm_weight)
  const int64_t quant_smem = M * quant_row_bytes(static_cast<int>(K)) +
                             (K + kScaleBlock - 1) / kScaleBlock * 16 * 4 +
                             (norm_weight.has_value() ? M * (K + kNormPad) * 2 : 0);
  TORCH_CHECK(variant != 7 || (f8 && M <= 16 && quant_smem <= kNormSmemMax),
              "linear_small_m: variant 7 takes FP8 weights and quantises x's rows into shared "
              "memory: M <= 16 and at most ", kNormSmemMax, " bytes (M x (K + 64) e4m3, "
              "their scales and, normed, M x (K + ", kNormPad, ") x 2), got M = ", M, ", K = ",
              K, norm_weight.has_value() ? " with the normed prologue" : "");
  TORCH_CHECK(f8 || variant <= 1 || variant == 4 || variant == 5,
              "linear_small_m: variants 2 and 3 convert FP8 weights; bf16 weights take 0, 1, "
              "4 or 5");
  if (residual.has_value()) {
    const auto& r = *residual;
    TORCH_CHECK(!glu, "linear_small_m: a residual add and the SwiGLU epilogue do not combine");
    TORCH_CHECK(r.device() == x.device() && r.scalar_type() == at::kBFloat16 && r.dim() == 2 &&
                    r.size(0) == M && r.size(1) == N && r.stride(1) == 1,
                "linear_small_m: residual must be a bf16 [M, N] = [", M, ", ", N,
                "] tensor on x's device with contiguous rows, got ", r.scalar_type(), " ",
                rtvoice::dims(r), " strides ", rtvoice::dims(r.strides()));
  }
  const int64_t xs_rs = K + kNormPad;
  if (norm_weight.has_value()) {
    const auto& nw = *norm_weight;
    TORCH_CHECK(batched, "linear_small_m: the normed prologue runs in variant 0, 4, 5, 6 or 7, "
                "got ", variant);
    TORCH_CHECK(M <= 16 && M * xs_rs * 2 <= kNormSmemMax,
                "linear_small_m: the normed prologue holds M x K rows in shared memory: M <= "
                "16 and M x (K + ", kNormPad, ") x 2 bytes <= ", kNormSmemMax, ", got M = ", M,
                ", K = ", K);
    TORCH_CHECK(nw.device() == x.device() && nw.scalar_type() == at::kBFloat16 &&
                    nw.dim() == 1 && nw.size(0) == K && nw.is_contiguous() &&
                    aligned16(nw.data_ptr()),
                "linear_small_m: norm_weight must be a contiguous, 16-byte aligned bf16 [K] = [",
                K, "] tensor on x's device, got ", nw.scalar_type(), " ", rtvoice::dims(nw));
    TORCH_CHECK(eps >= 0, "linear_small_m: eps must be >= 0, got ", eps);
  }
  if (attend != nullptr) {
    TORCH_CHECK(variant == 0 && !glu && !norm_weight.has_value(),
                "linear_small_m_attend: the attention prologue runs in variant 0, without the "
                "SwiGLU epilogue or the normed prologue");
    TORCH_CHECK(M <= 16 && M * xs_rs * 2 + kWarps * attn_warp_bytes(attend->s) <= kNormSmemMax,
                "linear_small_m_attend: the attention prologue holds M x K rows and each warp's "
                "keys and values in shared memory: M <= 16 and at most ", kNormSmemMax,
                " bytes, got M = ", M, ", K = ", K, ", ", attend->s, " cache positions");
  }
  if (M == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int dev = x.get_device();
  const DevInfo info = device_info(dev);
  const int n_sm = info.n_sm;
  TORCH_CHECK(info.major >= 8, "linear_small_m: needs compute capability 8.0 or newer (bf16 MMA)");
  TORCH_CHECK((variant != 3 && variant != 6 && variant != 7) ||
                  info.major * 10 + info.minor >= 89,
              "linear_small_m: variants 3, 6 and 7 (e4m3 conversions, e4m3 MMAs) need compute "
              "capability 8.9 or newer");
  const bool norm = norm_weight.has_value();
  const int nt = static_cast<int>((M + 7) / 8);
  const int rows_smem = static_cast<int>(M * xs_rs * 2);
  const Kern kern =
      variant == 7 ? v0_pro_kern(norm ? kProNorm : kProStageE4M3, f8, nt, dev,
                                 static_cast<int>(quant_smem), 7)
      : norm   ? v0_pro_kern(kProNorm, f8, nt, dev, rows_smem, static_cast<int>(variant))
      : attend ? v0_pro_kern(kProAttend, f8, nt, dev,
                             rows_smem + kWarps * attn_warp_bytes(attend->s))
      : variant == 6 ? v0_pro_kern(kProStageF16, f8, nt, dev, rows_smem, 6)
                     : pick_kernel(f8, static_cast<int>(variant), nt, dev);
  // a tile of `rows` weight rows makes rows / 2 SwiGLU outputs
  const int64_t tiles = glu ? (N / 2 + kern.rows / 2 - 1) / (kern.rows / 2)
                            : (N + kern.rows - 1) / kern.rows;
  const int64_t n_chunks = (K + kern.chunk - 1) / kern.chunk;
  int kw = static_cast<int>(kwarps);
  if (kw == 0) {
    kw = kWarps;
    // variant 0: the fewest warps per tile (the longest K runs per warp) that still give two
    // blocks per SM, else 8. Pipelined: the fewest that give every SM a block (a warp's
    // chunks run back to back through its ring: longer runs cost nothing).
    const int64_t want = batched ? 2 * n_sm : n_sm;
    for (int c = 1; c < kWarps; c *= 2)
      if ((tiles * c + kWarps - 1) / kWarps >= want) {
        kw = c;
        break;
      }
  }
  // automatic splits: enough blocks for two per SM (pipelined: one), each warp left with
  // >= 2 chunks of K
  if (splits == 0) {
    const int64_t blocks = (tiles * kw + kWarps - 1) / kWarps;
    const int64_t want = batched ? 2 * n_sm : n_sm;
    splits = std::max<int64_t>(
        1, std::min<int64_t>({(want + blocks - 1) / blocks, n_chunks / (2 * kw), kMaxSplits}));
  }
  const int64_t cps = (n_chunks + splits - 1) / splits;
  const dim3 grid(static_cast<unsigned>((tiles * kw + kWarps - 1) / kWarps),
                  static_cast<unsigned>(splits));
  torch::Tensor ws;
  if (splits > 1) ws = torch::empty({splits, M, N}, x.options().dtype(at::kFloat));
  Args a{reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
         M > 1 ? x.stride(0) : 0,
         reinterpret_cast<const uint8_t*>(w.data_ptr()),
         f8 ? scale->data_ptr<float>() : nullptr,
         reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),
         splits > 1 ? ws.data_ptr<float>() : nullptr,
         static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
         static_cast<int>((K + kScaleBlock - 1) / kScaleBlock),
         kw, static_cast<int>(n_chunks), static_cast<int>(cps),
         glu ? static_cast<int>(N / 2) : 0,
         residual.has_value() ? reinterpret_cast<const __nv_bfloat16*>(residual->data_ptr())
                              : nullptr,
         residual.has_value() ? residual->stride(0) : 0,
         norm ? reinterpret_cast<const __nv_bfloat16*>(norm_weight->data_ptr()) : nullptr,
         static_cast<float>(eps), static_cast<int>(xs_rs), 0,
         attend ? attend->k : nullptr, attend ? attend->v : nullptr,
         attend ? attend->cs : nullptr, attend ? attend->hkv : 0, attend ? attend->s : 0,
         attend ? attend->pos : 0, 1.0f / std::sqrt(static_cast<float>(kAttnD))};
  const bool launch_pdl = pdl != kPdlOff && rtvoice::pdl_device(dev);
  a.pdl = launch_pdl ? static_cast<int>(pdl) : kPdlOff;
  auto stream = c10::cuda::getCurrentCUDAStream();
  rtvoice::launch_kernel(kern.fn, grid, dim3(kThreads), kern.smem, stream, launch_pdl, a);
  if (splits > 1) {
    const int64_t mn = glu ? M * N / 2 : M * N;  // outputs
    const int blocks = static_cast<int>(std::min<int64_t>((mn + 255) / 256, 4 * n_sm));
    if (glu)
      rtvoice::launch_kernel(linear_splits_reduce_glu, dim3(blocks), dim3(256), 0, stream,
                             launch_pdl,
                             ws.data_ptr<float>(), a.y, M, static_cast<int>(N / 2),
                             static_cast<int>(splits));
    else
      rtvoice::launch_kernel(linear_splits_reduce, dim3(blocks), dim3(256), 0, stream,
                             launch_pdl,
                             ws.data_ptr<float>(), a.y, mn, static_cast<int>(splits), a.res,
                             static_cast<int>(N), a.res_rs);
  }
}

}  // namespace

void linear_small_m(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> scale,
                    torch::Tensor out, int64_t splits, int64_t kwarps, int64_t variant,
                    bool glu, std::optional<torch::Tensor> residual,
                    std::optional<torch::Tensor> norm_weight, double eps, int64_t pdl) {
  run_linear(x, w, scale, out, splits, kwarps, variant, glu, residual, norm_weight, eps, pdl,
             nullptr);
}

// out = attend(qkv) W^T (+ residual): the attention of one position (the fast AR's, whose
// context is a few positions) as the prologue of its output projection, variant 0.
//   qkv      [M, >= K + 2 Hkv D] bf16, rows [q (K = H D) | k (Hkv D) | v (Hkv D) | ...],
//            last dim contiguous, rows 16-byte aligned; all rows at position `pos`
//   k_cache, v_cache  [B >= M, Hkv, S, D] bf16, contiguous, D = 128, S <= 32: row m's
//            positions 0..pos-1 are read, position pos written (rotated key, value)
//   cs       [D / 2, 2] bf16, contiguous: (cos, sin) of `pos`
//   0 <= pos < S; H a multiple of Hkv; w, scale, out, splits, kwarps, residual, pdl: as
//   linear_small_m's (K = H D)
void linear_small_m_attend(torch::Tensor qkv, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor cs, int64_t pos, torch::Tensor w,
                           std::optional<torch::Tensor> scale, torch::Tensor out,
                           int64_t splits, int64_t kwarps,
                           std::optional<torch::Tensor> residual, int64_t pdl) {
  TORCH_CHECK(qkv.is_cuda() && qkv.dim() == 2 && qkv.scalar_type() == at::kBFloat16,
              "linear_small_m_attend: qkv must be a bf16 CUDA [M, q + 2 kv] tensor, got ",
              qkv.scalar_type(), " ", rtvoice::dims(qkv));
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.device() == qkv.device() &&
                  v_cache.device() == qkv.device() && aligned16(k_cache.data_ptr()) &&
                  aligned16(v_cache.data_ptr()),
              "linear_small_m_attend: k_cache and v_cache must be contiguous, 16-byte aligned "
              "bf16 [B, Hkv, S, D] tensors of one shape on qkv's device, got ",
              rtvoice::dims(k_cache), " and ", rtvoice::dims(v_cache));
  const int64_t M = qkv.size(0), hkv = k_cache.size(1), S = k_cache.size(2);
  const int64_t K = w.dim() == 2 ? w.size(1) : 0;
  TORCH_CHECK(k_cache.size(3) == kAttnD, "linear_small_m_attend: head_dim must be ", kAttnD,
              ", got ", k_cache.size(3));
  TORCH_CHECK(k_cache.size(0) >= M, "linear_small_m_attend: the caches hold ",
              k_cache.size(0), " rows, fewer than qkv's ", M);
  TORCH_CHECK(S >= 1 && S <= kAttnMaxPos && pos >= 0 && pos < S,
              "linear_small_m_attend: at most ", kAttnMaxPos, " cache positions and 0 <= pos < "
              "S, got S = ", S, ", pos = ", pos);
  TORCH_CHECK(hkv >= 1 && K % kAttnD == 0 && (K / kAttnD) % hkv == 0,
              "linear_small_m_attend: w's K = ", K, " must be H x ", kAttnD, " with H a "
              "multiple of the caches' ", hkv, " kv heads");
  TORCH_CHECK(qkv.size(1) >= K + 2 * hkv * kAttnD,
              "linear_small_m_attend: qkv rows must hold q (", K, "), k and v (", hkv * kAttnD,
              " each), got ", qkv.size(1));
  TORCH_CHECK(cs.device() == qkv.device() && cs.scalar_type() == at::kBFloat16 &&
                  cs.dim() == 2 && cs.size(0) == kAttnD / 2 && cs.size(1) == 2 &&
                  cs.is_contiguous() && reinterpret_cast<uintptr_t>(cs.data_ptr()) % 8 == 0,
              "linear_small_m_attend: cs must be a contiguous, 8-byte aligned bf16 [", kAttnD / 2,
              ", 2] tensor on qkv's device, got ", cs.scalar_type(), " ", rtvoice::dims(cs));
  const AttendArgs at{reinterpret_cast<__nv_bfloat16*>(k_cache.data_ptr()),
                      reinterpret_cast<__nv_bfloat16*>(v_cache.data_ptr()),
                      reinterpret_cast<const __nv_bfloat16*>(cs.data_ptr()),
                      static_cast<int>(hkv), static_cast<int>(S), static_cast<int>(pos)};
  run_linear(qkv.narrow(1, 0, K), w, scale, out, splits, kwarps, 0, false, residual,
             std::nullopt, 0.0, pdl, &at);
}
