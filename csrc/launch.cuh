// Programmatic dependent launch (PDL, sm_90+), shared by the decode step's kernels.
//
// A decode step is a chain of short kernels (a linear is 5-30 us) in which every launch waits
// for the previous one to finish completely: its tail (the last blocks, while most SMs idle),
// its completion and the next launch are a few microseconds per kernel with the HBM mostly
// idle. Launched with PDL, a kernel may start as soon as the kernel before it has called
// `pdl_trigger` in every block (or exited): it does what depends on no earlier kernel (in
// linear.cu's mode 2, its first weight batches into L2: weights are the step's constants),
// then `pdl_wait`s for the previous kernel's completion and memory before reading its outputs or
// writing anything. A kernel launched without PDL, or after one that never triggers, waits as
// usual (`pdl_wait` returns at once), so every kernel here is correct either way; a kernel
// that is not PDL-aware (torch, Triton) after one of these waits for its completion.
//
// Rules for a kernel launched with `pdl`: no global write and no read of anything an earlier
// kernel of the stream writes before `pdl_wait`; `pdl_trigger` after `pdl_wait`, and late:
// after the main loop, so that the next kernel's blocks come in for this one's tail (a block
// waiting in `pdl_wait` holds its SM slot; triggered right after the wait, every SM would
// keep one for this kernel's whole run).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <utility>

namespace rtvoice {

// Waits until the kernels this one depends on have completed and their writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel of the stream (launched with PDL) start its blocks.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Brings the line holding p into L2 (no registers, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// Whether `dev` runs PDL launches (compute capability 9.0+), cached per device.
inline bool pdl_device(int dev) {
  static int cached[64] = {};  // 0: not asked, 1: no, 2: yes; a racing first call writes the same
  if (dev >= 0 && dev < 64 && cached[dev] != 0) return cached[dev] == 2;
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (dev >= 0 && dev < 64) cached[dev] = major >= 9 ? 2 : 1;
  return major >= 9;
}

// fn<<<grid, block, smem, stream>>>(args...), with programmatic stream serialisation when
// `pdl` (the caller checked pdl_device). Works under CUDA-graph capture (the dependency
// becomes a programmatic edge of the graph).
template <typename... P, typename... A>
void launch_kernel(void (*fn)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   bool pdl, A&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, fn, std::forward<A>(args)...));
}

}  // namespace rtvoice
