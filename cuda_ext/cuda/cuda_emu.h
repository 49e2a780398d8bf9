// CPU emulation of the CUDA built-ins that dcr_cuda.cu uses, so that its kernels run (slowly)
// where there is no GPU: the logic (tiling, partial vectors, block scan, ranks, look-back,
// capacity and resume, scatter validation, ulp ops) is then tested by CI and on every
// developer machine; only speed and the hardware memory model need a GPU.
//
//   g++ -std=c++20 -O1 -shared -fPIC -DDCR_EMULATE -include cuda_emu.h -x c++ dcr_cuda.cu
//
// Each CUDA thread of a block is a fiber (ucontext) on the calling OS thread: a fiber runs
// until it waits at a barrier (__syncthreads, or a warp intrinsic's exchange), then the next
// one runs. Blocks run one after another in launch order, so a tile's look-back always finds
// its predecessor's inclusive prefix; __shared__ variables are function statics.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
struct dcr_emu_dim3 {
  unsigned x = 0, y = 1, z = 1;
};
inline dcr_emu_dim3 threadIdx, blockIdx, gridDim, blockDim;

using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorUnknown = 999 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaMemoryType { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2 };
struct cudaPointerAttributes {
  cudaMemoryType type;
  int device;
  void* devicePointer;
  void* hostPointer;
};
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
// An emulated device of 4 multiprocessors with room for 2 blocks each (the persistent grid).
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) {
  *v = 4;
  return cudaSuccess;
}
template <class K>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, K, int, size_t) {
  *n = 2;
  return cudaSuccess;
}
template <class K>
cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute, int) {
  return cudaSuccess;
}
inline const char* cudaGetErrorString(cudaError_t) { return "emulated CUDA error"; }
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  a->type = cudaMemoryTypeDevice;  // host memory is the "device" here
  a->device = 0;
  a->devicePointer = const_cast<void*>(p);
  a->hostPointer = const_cast<void*>(p);
  return cudaSuccess;
}

namespace dcr_emu {

constexpr size_t kStack = 128 * 1024;

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack{new char[kStack]};
  unsigned tid = 0;
  bool done = false;
};

inline ucontext_t scheduler;
inline Fiber* current = nullptr;
inline std::function<void()> body;
inline unsigned char* dynamic_smem = nullptr;  // a block's dynamic shared memory (extern __shared__)

inline void yield() { swapcontext(&current->ctx, &scheduler); }

struct Barrier {
  unsigned expected = 0, arrived = 0;
  unsigned long long phase = 0;
  void wait() {
    if (++arrived == expected) {
      arrived = 0;
      ++phase;
      return;
    }
    const unsigned long long p = phase;
    for (long spins = 0; phase == p; ++spins) {
      if (spins > 100000000L) {
        std::fprintf(stderr, "cuda_emu: deadlock at a barrier\n");
        std::abort();
      }
      yield();
    }
  }
};

struct Warp {
  Barrier bar;
  unsigned long long slot[32] = {};
};

inline Barrier block_bar;
inline std::vector<Warp> warps;

// Every lane of the warp puts v in, then each takes lane src's value.
inline unsigned long long exchange(unsigned long long v, unsigned src) {
  Warp& w = warps[threadIdx.x / 32];
  w.slot[threadIdx.x % 32] = v;
  w.bar.wait();
  unsigned long long r = w.slot[src];
  w.bar.wait();
  return r;
}

inline unsigned ballot(bool p) {
  Warp& w = warps[threadIdx.x / 32];
  w.slot[threadIdx.x % 32] = p;
  w.bar.wait();
  unsigned m = 0;
  for (unsigned l = 0; l < 32 && l < w.bar.expected; ++l) m |= static_cast<unsigned>(w.slot[l] != 0) << l;
  w.bar.wait();
  return m;
}

inline void trampoline() {
  body();
  current->done = true;  // returning resumes the scheduler (uc_link)
}

template <class... KArgs>
void launch(void (*kernel)(KArgs...), unsigned grid, unsigned block, size_t smem, KArgs... args) {
  std::vector<Fiber> fibers(block);
  std::vector<uint4> smem_buf((smem + sizeof(uint4) - 1) / sizeof(uint4));
  dynamic_smem = reinterpret_cast<unsigned char*>(smem_buf.data());
  block_bar = Barrier{block};
  warps.assign((block + 31) / 32, Warp{});
  for (unsigned w = 0; w < warps.size(); ++w) warps[w].bar.expected = std::min(32u, block - 32 * w);
  body = [&] { kernel(args...); };
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    for (unsigned t = 0; t < block; ++t) {
      Fiber& f = fibers[t];
      f.tid = t;
      f.done = false;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.get();
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = &scheduler;
      makecontext(&f.ctx, trampoline, 0);
    }
    for (unsigned left = block; left;) {
      left = 0;
      for (Fiber& f : fibers) {
        if (f.done) continue;
        current = &f;
        threadIdx.x = f.tid;
        swapcontext(&scheduler, &f.ctx);
        left += !f.done;
      }
    }
  }
}

}  // namespace dcr_emu

inline void __syncthreads() { dcr_emu::block_bar.wait(); }
// cp.async: the copy happens at once, so commits and waits have nothing to do.
inline void __pipeline_memcpy_async(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
inline void __pipeline_commit() {}
inline void __pipeline_wait_prior(size_t) {}
inline void __threadfence() {}
inline void __nanosleep(unsigned) { dcr_emu::yield(); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
template <class T>
T __ldcs(const T* p) {
  return *p;
}
template <class T>
T __ldcg(const T* p) {
  return *p;
}
template <class T>
void __stcs(T* p, T v) {
  *p = v;
}
template <class T>
T __shfl_up_sync(unsigned, T v, unsigned d) {
  const unsigned lane = threadIdx.x % 32;
  return static_cast<T>(dcr_emu::exchange(static_cast<unsigned long long>(v), lane >= d ? lane - d : lane));
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int m) {
  return static_cast<T>(dcr_emu::exchange(static_cast<unsigned long long>(v), (threadIdx.x % 32) ^ m));
}
inline unsigned __ballot_sync(unsigned, int p) { return dcr_emu::ballot(p != 0); }
inline int __any_sync(unsigned, int p) { return dcr_emu::ballot(p != 0) != 0; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  unsigned long long old = *p;
  *p = old + v;
  return old;
}
inline int atomicExch(int* p, int v) {
  int old = *p;
  *p = v;
  return old;
}
inline int atomicMin(int* p, int v) {
  int old = *p;
  if (v < old) *p = v;
  return old;
}
