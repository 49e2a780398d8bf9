// nemo-dcr CUDA kernels: the fused delta pass and the receiver's scatter, with the same
// contract and output as cuda_ext/cpu/dcr_cpu.cpp (the reference). Plain C ABI over device
// pointers (loaded with ctypes; no torch headers), a caller-provided workspace (nothing is
// allocated here, so the hot path never calls cudaMalloc) and a caller's stream. Results
// that only the device knows (the count, a refusal) are written to `result`, device memory
// or pinned host memory, so the caller decides when to synchronize. docs/CUDA.md has the design.
//
// Conventions as in the CPU library: `width` is the element size in bytes (1, 2, 4, 8);
// elements are raw bit patterns; positions are int32 (pos64 == 0) or int64, strictly
// increasing. Host functions return 0 (or a size) on success and < 0 on refusal:
//   -9 bad width or op, -8 workspace or capacity too small, -7 misaligned pointer,
//   -6 memory the device cannot reach, <= -1000: CUDA error (-1000 - cudaError_t).
// The scatter's refusals of its input (found on the device) go to result[0]: -4 positions
// not strictly increasing (or negative), -2 a position >= n, as dcr_scatter returns them.

#ifndef DCR_EMULATE
#include <cuda_pipeline.h>
#include <cuda_runtime.h>
#endif
// With -DDCR_EMULATE -include cuda_emu.h the same kernels build with g++ and run on CPU
// threads (tests/test_cuda_ext.py checks their logic against the CPU reference without a GPU).

#include <cstdint>

namespace {

// Tuning knobs (defaults measured on an H200: docs/CUDA.md; nemo_dcr_callback.cuda_kernels passes
// $NEMO_DCR_CUDA_DEFINES to nvcc to try others): threads per block, 16-byte vectors per thread and
// tile, the minimum resident blocks asked of ptxas (0: none), how a tile gets its id (0: blockIdx,
// as CUB's single-pass scans do, relying on in-order block dispatch; 1: an atomic counter, no
// such reliance but one contended atomic before each tile's loads), and the fast zero test of a
// vector before its per-element mask (0 turns it off); streaming (evict-first) loads and
// stores of the baseline, the look-back's back-off in ns, and resident blocks that each take
// tile after tile, loading the next while finishing the current (DCR_PERSIST 1); the look-back's
// depth in groups of 32 predecessors read at once, and the fence before a status store. Three
// more, for issue 51's study: the width of a vector load in bytes (4, 8 or 16), changed vectors
// loaded again from L2 for the writes (DCR_REREAD 1: the tile's data need not stay in registers
// through the scan and look-back), and a two-phase pass (DCR_TWO_PHASE 1: a count kernel, a
// one-block prefix over the tiles' counts, and a write kernel that reads the input again). And
// DCR_STAGES S >= 2: resident blocks that copy tiles into shared memory with cp.async, S tiles
// ahead, so loads stay in flight while earlier tiles scan, look back and write.
#ifndef DCR_BLOCK
#define DCR_BLOCK 512
#endif
#ifndef DCR_VECS
#define DCR_VECS 4
#endif
#ifndef DCR_MIN_BLOCKS
#define DCR_MIN_BLOCKS 0
#endif
#ifndef DCR_TILE_ORDER
#define DCR_TILE_ORDER 0
#endif
#ifndef DCR_FAST_MASK
#define DCR_FAST_MASK 1
#endif
#ifndef DCR_STREAM_BASE
#define DCR_STREAM_BASE 0
#endif
#ifndef DCR_SLEEP_NS
#define DCR_SLEEP_NS 32
#endif
#ifndef DCR_PERSIST
#define DCR_PERSIST 0
#endif
#ifndef DCR_LB_DEPTH
#define DCR_LB_DEPTH 1
#endif
#ifndef DCR_FENCE
#define DCR_FENCE 1
#endif
#ifndef DCR_VEC_BYTES
#define DCR_VEC_BYTES 16
#endif
#ifndef DCR_REREAD
#define DCR_REREAD 0
#endif
#ifndef DCR_TWO_PHASE
#define DCR_TWO_PHASE 0
#endif
#ifndef DCR_STAGES
#define DCR_STAGES 0
#endif

#if DCR_MIN_BLOCKS > 0
#define DCR_DELTA_BOUNDS __launch_bounds__(DCR_BLOCK, DCR_MIN_BLOCKS)
#define DCR_PERSIST_BOUNDS __launch_bounds__(DCR_BLOCK, DCR_MIN_BLOCKS)
#else
#define DCR_DELTA_BOUNDS __launch_bounds__(DCR_BLOCK)
#define DCR_PERSIST_BOUNDS __launch_bounds__(DCR_BLOCK)
#endif

constexpr int kBlock = DCR_BLOCK;  // threads per block
constexpr int kWarps = kBlock / 32;
constexpr int kVecs = DCR_VECS;  // vectors per thread and tile: independent loads in flight
static_assert(kBlock % 32 == 0 && kBlock <= 1024 && kWarps <= 32, "DCR_BLOCK: a multiple of 32, at most 1024");
static_assert(kVecs >= 1 && kVecs <= 4, "DCR_VECS: counts are packed in four 16-bit lanes");
constexpr int kVecBytes = DCR_VEC_BYTES;  // the fast path's load width
static_assert(kVecBytes == 4 || kVecBytes == 8 || kVecBytes == 16, "DCR_VEC_BYTES: 4, 8 or 16");
static_assert(!(DCR_TWO_PHASE && DCR_PERSIST), "DCR_TWO_PHASE and DCR_PERSIST exclude each other");
constexpr int kStages = DCR_STAGES;
static_assert(kStages == 0 || (kStages >= 2 && kStages <= 8 && !DCR_TWO_PHASE && !DCR_PERSIST),
              "DCR_STAGES: 0, or 2-8 without DCR_TWO_PHASE or DCR_PERSIST");
constexpr unsigned kFull = 0xffffffffu;
constexpr unsigned long long kFlagA = 1ull << 62;  // tile status: aggregate of the tile alone
constexpr unsigned long long kFlagP = 2ull << 62;  // tile status: inclusive prefix
constexpr unsigned long long kValue = (1ull << 62) - 1;
constexpr int64_t kHeader = 16;                     // delta workspace: counter, overflow flag
constexpr int64_t kMinTile = int64_t(kBlock) * kVecs;  // elements of the smallest tile (scalar path)
constexpr int kApplyItems = 4;                       // changes per thread in the scatter

constexpr int kErrWidth = -9, kErrSpace = -8, kErrAlign = -7, kErrPointer = -6, kErrCuda = -1000;

int cuda_status(cudaError_t e) { return e == cudaSuccess ? 0 : kErrCuda - static_cast<int>(e); }

// Every launch goes through here (the emulation runs kernels on CPU threads instead); smem:
// bytes of dynamic shared memory.
template <class... KArgs, class... Args>
int launch_smem(void (*kernel)(KArgs...), int64_t grid, int block, size_t smem, cudaStream_t stream, Args... args) {
#ifdef DCR_EMULATE
  (void)stream;
  dcr_emu::launch(kernel, static_cast<unsigned>(grid), static_cast<unsigned>(block), smem, static_cast<KArgs>(args)...);
  return 0;
#else
  kernel<<<static_cast<unsigned>(grid), block, smem, stream>>>(static_cast<KArgs>(args)...);
  return cuda_status(cudaGetLastError());
#endif
}

template <class... KArgs, class... Args>
int launch(void (*kernel)(KArgs...), int64_t grid, int block, cudaStream_t stream, Args... args) {
  return launch_smem(kernel, grid, block, 0, stream, args...);
}

// ---------------------------------------------------------------- element types
template <bool C, class A, class B>
struct If { using type = A; };
template <class A, class B>
struct If<false, A, B> { using type = B; };

template <class T>
struct Signed;
template <> struct Signed<unsigned char> { using type = signed char; };
template <> struct Signed<unsigned short> { using type = short; };
template <> struct Signed<unsigned int> { using type = int; };
template <> struct Signed<unsigned long long> { using type = long long; };

// A vector of VB bytes holding E = VB / sizeof(T) elements: VB-byte loads (uint4 for 16) on the
// fast path, one element per "vector" on the scalar path (pointers of different 16-byte phase).
template <class T, int VB>
struct Pack {
  static constexpr int E = VB / static_cast<int>(sizeof(T));
  using V = typename If<VB == 16, uint4,
                        typename If<(VB == 8 && E > 1), uint2, typename If<(VB == 4 && E > 1), unsigned, T>::type>::type>::type;
  union {
    V v;
    T e[E];
  };
};

// Elements of one tile: kBlock threads x kVecs vectors of VB bytes.
template <class T, int VB>
constexpr int64_t kTileElems = int64_t(kBlock) * kVecs * Pack<T, VB>::E;

// The fast path's vector width for elements of `width` bytes (a vector holds at least one).
constexpr int fast_vec_bytes(int width) { return kVecBytes > width ? kVecBytes : width; }

// Whether any bit of two vectors differs: word compares on the 16- and 8-byte paths.
template <class T, int VB>
__device__ __forceinline__ bool differs(const Pack<T, VB>& a, const Pack<T, VB>& b) {
  if constexpr (VB == 16) {
    return ((a.v.x ^ b.v.x) | (a.v.y ^ b.v.y) | (a.v.z ^ b.v.z) | (a.v.w ^ b.v.w)) != 0u;
  } else if constexpr (VB == 8 && Pack<T, VB>::E > 1) {
    return ((a.v.x ^ b.v.x) | (a.v.y ^ b.v.y)) != 0u;
  } else {
    return a.v != b.v;
  }
}

// ---------------------------------------------------------------- ulp transform (as dcr_cpu.cpp)
template <class T>
__device__ __forceinline__ T fkey(T b) {
  using S = typename Signed<T>::type;
  constexpr T sign = static_cast<T>(T(1) << (8 * sizeof(T) - 1));
  return static_cast<T>(b ^ (static_cast<T>(static_cast<S>(b) >> (8 * sizeof(T) - 1)) | sign));
}
template <class T>
__device__ __forceinline__ T funkey(T k) {
  using S = typename Signed<T>::type;
  constexpr T sign = static_cast<T>(T(1) << (8 * sizeof(T) - 1));
  return static_cast<T>(k ^ (static_cast<T>(~(static_cast<S>(k) >> (8 * sizeof(T) - 1))) | sign));
}
template <class T>
__device__ __forceinline__ T unzigzag(T z) {
  return static_cast<T>((z >> 1) ^ static_cast<T>(-static_cast<T>(z & 1)));
}

// ---------------------------------------------------------------- tile status (look-back)
// A status word holds its flag and value together (one 64-bit store), so readers need no
// fence to see them consistent; DCR_FENCE orders the tile's earlier accesses (the overflow
// flag it read) before the store: 1 a full __threadfence, 2 a release store, 0 neither.
__device__ __forceinline__ unsigned long long load_status(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}
__device__ __forceinline__ void store_status(unsigned long long* p, unsigned long long v) {
#if DCR_FENCE == 2 && !defined(DCR_EMULATE)
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
  if (DCR_FENCE == 1) __threadfence();
  *reinterpret_cast<volatile unsigned long long*>(p) = v;
#endif
}

// Warp 0: the exclusive prefix of `tile` from its predecessors' statuses, 32 x DCR_LB_DEPTH at a
// time (lane l reads tile - 1 - 32 q - l for q < depth, all loads in flight together), stopping
// at the nearest inclusive prefix (decoupled look-back). It waits only on predecessors nearer
// than that prefix: a straggler beyond it does not matter.
__device__ __forceinline__ int64_t look_back(const unsigned long long* status, int64_t tile, int lane) {
  constexpr int kDepth = DCR_LB_DEPTH;
  int64_t excl = 0;
  int64_t idx = tile - 1;  // the nearest predecessor not yet summed
  while (true) {
    unsigned long long s[kDepth];
#pragma unroll
    for (int q = 0; q < kDepth; ++q) {
      const int64_t my = idx - 32 * q - lane;
      s[q] = my >= 0 ? load_status(status + my) : kFlagP;  // before tile 0: an inclusive prefix of 0
    }
    bool wait = false;
#pragma unroll
    for (int q = 0; q < kDepth; ++q) {
      const unsigned zero = __ballot_sync(kFull, (s[q] >> 62) == 0);
      const unsigned p = __ballot_sync(kFull, (s[q] >> 62) == 2);
      const int first = p ? __ffs(p) - 1 : 32;  // the nearest inclusive prefix in this group
      const unsigned nearer = first == 32 ? kFull : ((1u << first) - 1u);
      if (zero & nearer) {  // a predecessor nearer than any prefix has not published: retry from here
        wait = true;
        break;
      }
      unsigned long long v = lane <= first ? (s[q] & kValue) : 0;
#pragma unroll
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
      excl += static_cast<int64_t>(v);
      if (p) return excl;
      idx -= 32;
    }
    if (wait && DCR_SLEEP_NS) __nanosleep(DCR_SLEEP_NS);
  }
}

// ---------------------------------------------------------------- delta pass
// One tile = kBlock threads x kVecs vectors x E elements, loaded warp-striped (vector v of
// thread t at v * kBlock + t: each load instruction is coalesced). The logical index j covers
// [lo, hi) = [shift, n + shift) from a 16-byte aligned base, so every vector load is aligned.
// Element order inside a tile is (v, t, e), ascending in j, so ranks from one block scan of
// the four per-vector counts (packed in 16-bit lanes of a u64) give stable ascending output.
// Each tile finds its output offset by decoupled look-back, so the pass reads each byte once.
// Tile ids: blockIdx (DCR_TILE_ORDER 0), an atomic counter in the order tiles start (1), or
// (DCR_PERSIST 1) a grid of resident blocks that each take tile after tile from the counter,
// loading the next tile while the current one scans, looks back and writes. A tile id is only
// ever held by a running block, so the look-back cannot wait on a block that is not scheduled,
// also beside the training's own kernels.
//
// cap bounds the outputs: a tile whose changes do not fit writes nothing and leaves its
// baseline untouched, and so does every later one; result = {changes written, elements done
// from the start}. The caller resumes at `done` (see cuda_kernels.take_delta_cuda).
template <class T, class I>
struct DeltaArgs {
  const T* __restrict__ cur;
  T* __restrict__ base;
  int64_t lo, hi;
  I* __restrict__ pos;
  T* __restrict__ val;
  T* __restrict__ newv;
  int64_t cap;
  unsigned long long* ws;  // [counter, overflow flag, status of each tile]
  int64_t ntiles;
  int64_t* __restrict__ result;
};

// One vector of `p` (a partial first or last vector stays inside its aligned VB bytes).
template <class T, int VB>
__device__ __forceinline__ typename Pack<T, VB>::V load_vec(const T* __restrict__ p, bool stream) {
  using V = typename Pack<T, VB>::V;
  return stream ? __ldcs(reinterpret_cast<const V*>(p)) : *reinterpret_cast<const V*>(p);
}

// Issue the loads of one tile (out-of-range vectors read as equal zeros).
template <class T, int VB>
__device__ __forceinline__ void load_tile(const T* __restrict__ cur, const T* __restrict__ base, int64_t j0,
                                          int64_t hi, Pack<T, VB> (&c)[kVecs], Pack<T, VB> (&b)[kVecs]) {
  using P = Pack<T, VB>;
  constexpr int E = P::E;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int64_t j = j0 + (int64_t(v) * kBlock + threadIdx.x) * E;
    if (j < hi) {
      c[v].v = load_vec<T, VB>(cur + j, !DCR_REREAD);  // (rereads want it kept in L2)
      b[v].v = load_vec<T, VB>(base + j, DCR_STREAM_BASE);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) c[v].e[e] = b[v].e[e] = T(0);
    }
  }
}

// This thread's per-element change masks of its vectors in the tile at j0 (elements outside
// [lo, hi) never count), and their counts packed in 16-bit lanes (<= 16 * kBlock per lane).
template <class T, int VB>
__device__ __forceinline__ unsigned long long tile_masks(int64_t j0, int64_t lo, int64_t hi,
                                                         const Pack<T, VB> (&c)[kVecs], const Pack<T, VB> (&b)[kVecs],
                                                         unsigned (&m)[kVecs]) {
  constexpr int E = Pack<T, VB>::E;
  constexpr int64_t kTile = kTileElems<T, VB>;
  const bool inner = j0 >= lo && j0 + kTile <= hi;
  unsigned long long packed = 0;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int64_t j = j0 + (int64_t(v) * kBlock + threadIdx.x) * E;
    unsigned mv = 0;
    if (!DCR_FAST_MASK || differs(c[v], b[v])) {  // most vectors of a sparse delta are equal
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const bool in = inner || (j + e >= lo && j + e < hi);
        mv |= static_cast<unsigned>(in && (c[v].e[e] != b[v].e[e])) << e;
      }
    }
    m[v] = mv;
    packed += static_cast<unsigned long long>(__popc(mv)) << (16 * v);
  }
  return packed;
}

// Block-wide exclusive scan of x (summed as u64: packed lanes add lane by lane): this thread's
// exclusive prefix, and the block's total in `total`. Reads of its shared words end before the
// caller's next barrier.
__device__ __forceinline__ unsigned long long block_scan(unsigned long long x, unsigned long long& total) {
  __shared__ unsigned long long s_warp[kWarps], s_total;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const unsigned long long mine = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const unsigned long long w = lane < kWarps ? s_warp[lane] : 0;
    unsigned long long wi = w;
#pragma unroll
    for (int o = 1; o < kWarps; o <<= 1) {
      const unsigned long long y = __shfl_up_sync(kFull, wi, o);
      if (lane >= o) wi += y;
    }
    if (lane < kWarps) s_warp[lane] = wi - w;
    if (lane == kWarps - 1) s_total = wi;
  }
  __syncthreads();
  total = s_total;
  return x - mine + s_warp[warp];
}

__device__ __forceinline__ int64_t lane_sum(unsigned long long packed) {
  int64_t n = 0;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) n += static_cast<int64_t>((packed >> (16 * v)) & 0xffff);
  return n;
}

// Thread t's outputs of the tile at j0, from output index `excl` (the tile's) on: positions,
// XORs, new values, and baseline <- current. With DCR_REREAD the changed vectors are loaded
// again (from L2: the tile was just read) rather than kept in registers since the loads.
// (t is passed in: reading threadIdx.x again here cost the shipped kernel a spill.)
template <class T, class I, int VB>
__device__ __forceinline__ void write_tile(const DeltaArgs<T, I>& a, int64_t j0, int64_t excl,
                                           unsigned long long excl_t, unsigned long long total,
                                           const unsigned (&m)[kVecs], const Pack<T, VB> (&c)[kVecs],
                                           const Pack<T, VB> (&b)[kVecs], int t) {
  using P = Pack<T, VB>;
  constexpr int E = P::E;
  const int64_t lo = a.lo, hi = a.hi;
  int64_t r0 = excl;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    int64_t r = r0 + static_cast<int64_t>((excl_t >> (16 * v)) & 0xffff);
    r0 += static_cast<int64_t>((total >> (16 * v)) & 0xffff);
    const unsigned mv = m[v];
    if (!mv) continue;
    const int64_t j = j0 + (int64_t(v) * kBlock + t) * E;
#if DCR_REREAD  // __ldcg: from L2, and never merged with the first loads by the compiler
    P cv, bv;
    cv.v = __ldcg(reinterpret_cast<const typename P::V*>(a.cur + j));
    bv.v = __ldcg(reinterpret_cast<const typename P::V*>(a.base + j));
#else
    const P& cv = c[v];  // (references: copies of the unions cost ptxas registers, docs/CUDA.md)
    const P& bv = b[v];
#endif
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if ((mv >> e) & 1u) {
        a.pos[r] = static_cast<I>(j + e - lo);
        a.val[r] = static_cast<T>(cv.e[e] ^ bv.e[e]);
        if (a.newv) a.newv[r] = cv.e[e];
        ++r;
      }
    }
    if (j >= lo && j + E <= hi) {  // baseline <- current: the whole vector (unchanged lanes are equal)
      if (DCR_STREAM_BASE) __stcs(reinterpret_cast<typename P::V*>(a.base + j), cv.v);
      else *reinterpret_cast<typename P::V*>(a.base + j) = cv.v;
    } else {  // a partial vector: only its own elements
#pragma unroll
      for (int e = 0; e < E; ++e)
        if ((mv >> e) & 1u) a.base[j + e] = cv.e[e];
    }
  }
}

// Everything after the loads: masks, block scan, look-back, outputs, baseline update. Starts
// and ends at a barrier, so a persistent block can reuse the shared variables for its next tile.
template <class T, class I, int VB>
__device__ __forceinline__ void finish_tile(const DeltaArgs<T, I>& a, int64_t tile, const Pack<T, VB> (&c)[kVecs],
                                            const Pack<T, VB> (&b)[kVecs]) {
  constexpr int64_t kTile = kTileElems<T, VB>;
  int* overflow = reinterpret_cast<int*>(a.ws + 1);
  unsigned long long* status = a.ws + 2;
  __shared__ int64_t s_excl;
  __shared__ int s_skip;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t lo = a.lo;

  // Read before this tile's status is published, so a tile that a later one's look-back
  // passes has always read it before the overflow was raised (block_scan's barrier shares it).
  if (t == 0) s_skip = *reinterpret_cast<volatile int*>(overflow);
  const int64_t j0 = tile * kTile;
  unsigned m[kVecs];
  const unsigned long long packed = tile_masks<T, VB>(j0, lo, a.hi, c, b, m);
  unsigned long long total;
  const unsigned long long excl_t = block_scan(packed, total);
  const bool skip = s_skip;
  const int64_t count = lane_sum(total);

  // The tile's output offset: publish the aggregate, look back, publish the inclusive prefix.
  // An earlier tile overflowed cap (skip): this one would too; it only unblocks later ones.
  if (warp == 0) {
    int64_t excl = 0;
    if (skip) {
      if (lane == 0) store_status(status + tile, kFlagP | static_cast<unsigned long long>(a.cap + 1));
    } else if (tile == 0) {
      if (lane == 0) store_status(status, kFlagP | static_cast<unsigned long long>(count));
    } else {
      if (lane == 0) store_status(status + tile, kFlagA | static_cast<unsigned long long>(count));
      excl = look_back(status, tile, lane);
      if (lane == 0) store_status(status + tile, kFlagP | static_cast<unsigned long long>(excl + count));
    }
    if (lane == 0) s_excl = excl;
  }
  __syncthreads();
  const int64_t excl = s_excl;

  if (skip) return;  // (every thread leaves here or at the end, past the same barriers)
  if (excl + count > a.cap) {  // does not fit: write nothing; the first such tile reports
    if (t == 0 && excl <= a.cap) {
      a.result[0] = excl;
      a.result[1] = j0 > lo ? j0 - lo : 0;
      __threadfence();
      atomicExch(overflow, 1);
    }
    return;
  }
  if (t == 0 && tile == a.ntiles - 1) {
    a.result[0] = excl + count;
    a.result[1] = a.hi - lo;
  }
  write_tile<T, I, VB>(a, j0, excl, excl_t, total, m, c, b, t);
}

// One tile per block.
template <class T, class I, int VB>
__global__ void DCR_DELTA_BOUNDS delta_kernel(DeltaArgs<T, I> a) {
  constexpr int64_t kTile = kTileElems<T, VB>;
#if DCR_TILE_ORDER == 1
  __shared__ int64_t s_tile;
  if (threadIdx.x == 0) s_tile = static_cast<int64_t>(atomicAdd(a.ws, 1ull));
  __syncthreads();
  const int64_t tile = s_tile;
#else
  const int64_t tile = blockIdx.x;
#endif
  Pack<T, VB> c[kVecs], b[kVecs];
  load_tile<T, VB>(a.cur, a.base, tile * kTile, a.hi, c, b);
  finish_tile<T, I, VB>(a, tile, c, b);
}

// Resident blocks, each taking tiles from the counter, one tile's loads in flight while the
// previous tile finishes (two register sets, used in turn).
template <class T, class I, int VB>
__global__ void DCR_PERSIST_BOUNDS delta_kernel_persist(DeltaArgs<T, I> a) {
  constexpr int64_t kTile = kTileElems<T, VB>;
  __shared__ int64_t s_next[2];
  if (threadIdx.x == 0) s_next[0] = static_cast<int64_t>(atomicAdd(a.ws, 1ull));
  __syncthreads();
  int64_t tile = s_next[0];
  if (tile >= a.ntiles) return;
  Pack<T, VB> c0[kVecs], b0[kVecs], c1[kVecs], b1[kVecs];
  load_tile<T, VB>(a.cur, a.base, tile * kTile, a.hi, c0, b0);
  for (int k = 1;; k ^= 1) {
    // The next id goes to the other slot: the barriers inside finish_tile separate its write
    // from every thread's read of it, and its reuse two tiles later from that read.
    if (threadIdx.x == 0) s_next[k] = static_cast<int64_t>(atomicAdd(a.ws, 1ull));
    __syncthreads();
    const int64_t next = s_next[k];
    if (k) {
      if (next < a.ntiles) load_tile<T, VB>(a.cur, a.base, next * kTile, a.hi, c1, b1);
      finish_tile<T, I, VB>(a, tile, c0, b0);
    } else {
      if (next < a.ntiles) load_tile<T, VB>(a.cur, a.base, next * kTile, a.hi, c0, b0);
      finish_tile<T, I, VB>(a, tile, c1, b1);
    }
    if (next >= a.ntiles) return;
    tile = next;
  }
}

#if DCR_STAGES
constexpr size_t kStageBytes = size_t(2) * kVecs * kBlock * 16;  // cur and base of one tile
constexpr size_t kStagedSmem = kStageBytes * (kStages > 0 ? kStages : 1);

// Where thread t's vector v of cur (q 0) or base (q 1) sits in stage st, in 16-byte units: the
// one layout stage_tile writes and delta_kernel_staged reads.
__device__ __forceinline__ size_t stage_slot(int st, int q, int v, int t) {
  return ((size_t(st) * 2 + q) * kVecs + v) * kBlock + t;
}

// Start copying this thread's vectors of `tile` into stage `st` (cp.async, one commit group per
// call, empty past the last tile so the group count stays one per stage); vectors past hi are
// zeros, as in load_tile. Each thread copies only the vectors it reads itself, so its own
// wait_prior is all the synchronization the data needs.
template <class T>
__device__ __forceinline__ void stage_tile(uint4* smem, int st, const T* __restrict__ cur, const T* __restrict__ base,
                                           int64_t tile, int64_t ntiles, int64_t hi) {
  constexpr int E = Pack<T, 16>::E;
  constexpr int64_t kTile = kTileElems<T, 16>;
  if (tile < ntiles) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t j = tile * kTile + (int64_t(v) * kBlock + threadIdx.x) * E;
      uint4* dc = smem + stage_slot(st, 0, v, threadIdx.x);
      uint4* db = smem + stage_slot(st, 1, v, threadIdx.x);
      if (j < hi) {
        __pipeline_memcpy_async(dc, cur + j, 16);
        __pipeline_memcpy_async(db, base + j, 16);
      } else {
        *dc = *db = uint4{0, 0, 0, 0};
      }
    }
  }
  __pipeline_commit();
}

// Resident blocks taking tiles from the counter, each tile's cur and base copied into shared
// memory DCR_STAGES tiles ahead of its scan. Tile ids come from the counter in the order blocks
// ask, and a block finishes its oldest tile first, so the oldest unfinished tile of all is
// always being worked on and waits on no one: the look-back cannot deadlock.
template <class T, class I, int VB>
__global__ void DCR_PERSIST_BOUNDS delta_kernel_staged(DeltaArgs<T, I> a) {
  static_assert(VB == 16, "the staged kernel copies 16-byte vectors");
#ifdef DCR_EMULATE
  uint4* smem = reinterpret_cast<uint4*>(dcr_emu::dynamic_smem);
#else
  extern __shared__ uint4 smem[];
#endif
  __shared__ int64_t s_tile[kStages];
  const int t = threadIdx.x;
  if (t == 0)
    for (int st = 0; st < kStages; ++st) s_tile[st] = static_cast<int64_t>(atomicAdd(a.ws, 1ull));
  __syncthreads();
  for (int st = 0; st < kStages; ++st) stage_tile<T>(smem, st, a.cur, a.base, s_tile[st], a.ntiles, a.hi);
  for (int st = 0;; st = st + 1 == kStages ? 0 : st + 1) {
    const int64_t tile = s_tile[st];
    if (tile >= a.ntiles) break;  // (ids only grow: every later stage is past the end too)
    __pipeline_wait_prior(kStages - 1);  // this stage's group (one group per stage since)
    Pack<T, VB> c[kVecs], b[kVecs];
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      c[v].v = smem[stage_slot(st, 0, v, t)];
      b[v].v = smem[stage_slot(st, 1, v, t)];
    }
    __syncthreads();  // every thread has read s_tile[st] before thread 0 replaces it
    if (t == 0) s_tile[st] = static_cast<int64_t>(atomicAdd(a.ws, 1ull));
    finish_tile<T, I, VB>(a, tile, c, b);  // (its barriers publish the new id)
    stage_tile<T>(smem, st, a.cur, a.base, s_tile[st], a.ntiles, a.hi);
  }
}
#endif

#if DCR_TWO_PHASE
// Two-phase pass, phase 1: each tile's change count into its status word (no outputs).
template <class T, class I, int VB>
__global__ void DCR_DELTA_BOUNDS count_kernel(DeltaArgs<T, I> a) {
  constexpr int64_t kTile = kTileElems<T, VB>;
  const int64_t j0 = int64_t(blockIdx.x) * kTile;
  Pack<T, VB> c[kVecs], b[kVecs];
  load_tile<T, VB>(a.cur, a.base, j0, a.hi, c, b);
  unsigned m[kVecs];
  unsigned long long total;
  block_scan(tile_masks<T, VB>(j0, a.lo, a.hi, c, b, m), total);
  if (threadIdx.x == 0) a.ws[2 + blockIdx.x] = static_cast<unsigned long long>(lane_sum(total));
}

// Phase 2, one block: the counts become exclusive prefixes (a contiguous run of tiles per
// thread, one block scan of the runs' sums); the first tile that does not fit under cap is the
// stop (ws[0]) and reports as the one-pass kernel's first overflowing tile does.
template <class T, class I, int VB>
__global__ void DCR_DELTA_BOUNDS prefix_kernel(DeltaArgs<T, I> a) {
  constexpr int64_t kTile = kTileElems<T, VB>;
  __shared__ int s_found;
  unsigned long long* counts = a.ws + 2;
  const int64_t per = (a.ntiles + kBlock - 1) / kBlock;
  const int64_t i0 = threadIdx.x * per < a.ntiles ? threadIdx.x * per : a.ntiles;
  const int64_t i1 = i0 + per < a.ntiles ? i0 + per : a.ntiles;
  if (threadIdx.x == 0) s_found = 0;
  unsigned long long sum = 0;
  for (int64_t i = i0; i < i1; ++i) sum += counts[i];
  unsigned long long total;
  unsigned long long excl = block_scan(sum, total);  // (its barriers also order s_found)
  const unsigned long long cap = static_cast<unsigned long long>(a.cap);
  for (int64_t i = i0; i < i1; ++i) {
    const unsigned long long c = counts[i];
    counts[i] = excl;
    if (excl <= cap && excl + c > cap) {  // prefixes only grow: exactly one tile crosses cap
      const int64_t j0 = i * kTile;
      a.result[0] = static_cast<int64_t>(excl);
      a.result[1] = j0 > a.lo ? j0 - a.lo : 0;
      a.ws[0] = static_cast<unsigned long long>(i);
      s_found = 1;
    }
    excl += c;
  }
  __syncthreads();
  if (threadIdx.x == 0 && !s_found) {
    a.result[0] = static_cast<int64_t>(total);
    a.result[1] = a.hi - a.lo;
    a.ws[0] = static_cast<unsigned long long>(a.ntiles);
  }
}

// Phase 3: each tile below the stop reads its input again and writes at its prefix.
template <class T, class I, int VB>
__global__ void DCR_DELTA_BOUNDS write_kernel(DeltaArgs<T, I> a) {
  constexpr int64_t kTile = kTileElems<T, VB>;
  const int64_t tile = blockIdx.x;
  if (static_cast<unsigned long long>(tile) >= a.ws[0]) return;  // (uniform in the block)
  const int64_t j0 = tile * kTile;
  Pack<T, VB> c[kVecs], b[kVecs];
  load_tile<T, VB>(a.cur, a.base, j0, a.hi, c, b);
  unsigned m[kVecs];
  unsigned long long total;
  const unsigned long long excl_t = block_scan(tile_masks<T, VB>(j0, a.lo, a.hi, c, b, m), total);
  write_tile<T, I, VB>(a, j0, static_cast<int64_t>(a.ws[2 + tile]), excl_t, total, m, c, b, threadIdx.x);
}
#endif

__global__ void write_result(int64_t* result, int64_t a, int64_t b) {
  result[0] = a;
  result[1] = b;
}

// Resident blocks of a kernel on the current device (cached per kernel: one query each).
template <class K>
int64_t resident_blocks(K kernel, size_t smem = 0) {
  static int64_t cached = 0;
  if (cached) return cached;
  int dev = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlock, smem) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  cached = int64_t(sms) * (per_sm > 0 ? per_sm : 1);
  return cached;
}

template <class T, class I, int VB>
int launch_delta(const void* cur, void* base, int64_t n, int64_t shift, void* pos, void* val, void* newv,
                 int64_t cap, void* ws, int64_t ws_bytes, int64_t* result, cudaStream_t stream) {
  constexpr int64_t kTile = kTileElems<T, VB>;
  if (n == 0) return launch(write_result, 1, 1, stream, result, int64_t(0), int64_t(0));
  const int64_t ntiles = (n + shift + kTile - 1) / kTile;
  if (cap < (n < kTile ? n : kTile) || ntiles > 0x7fffffff) return kErrSpace;
  if (ws_bytes < kHeader + 8 * ntiles) return kErrSpace;
  cudaError_t e = cudaMemsetAsync(ws, 0, kHeader + 8 * ntiles, stream);
  if (e != cudaSuccess) return cuda_status(e);
  const DeltaArgs<T, I> a{static_cast<const T*>(cur) - shift, static_cast<T*>(base) - shift, shift, n + shift,
                          static_cast<I*>(pos), static_cast<T*>(val), static_cast<T*>(newv), cap,
                          static_cast<unsigned long long*>(ws), ntiles, result};
#if DCR_TWO_PHASE
  int rc = launch(count_kernel<T, I, VB>, ntiles, kBlock, stream, a);
  if (!rc) rc = launch(prefix_kernel<T, I, VB>, 1, kBlock, stream, a);
  return rc ? rc : launch(write_kernel<T, I, VB>, ntiles, kBlock, stream, a);
#elif DCR_STAGES
  if constexpr (VB == 16) {
    static const cudaError_t attr = cudaFuncSetAttribute(delta_kernel_staged<T, I, VB>,
                                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                         static_cast<int>(kStagedSmem));
    if (attr != cudaSuccess) return cuda_status(attr);
    const int64_t resident = resident_blocks(delta_kernel_staged<T, I, VB>, kStagedSmem);
    if (resident <= 0) return cuda_status(cudaErrorUnknown);
    return launch_smem(delta_kernel_staged<T, I, VB>, ntiles < resident ? ntiles : resident, kBlock, kStagedSmem,
                       stream, a);
  } else {
    return launch(delta_kernel<T, I, VB>, ntiles, kBlock, stream, a);  // (the scalar path)
  }
#elif DCR_PERSIST
  const int64_t resident = resident_blocks(delta_kernel_persist<T, I, VB>);
  if (resident <= 0) return cuda_status(cudaErrorUnknown);
  return launch(delta_kernel_persist<T, I, VB>, ntiles < resident ? ntiles : resident, kBlock, stream, a);
#else
  return launch(delta_kernel<T, I, VB>, ntiles, kBlock, stream, a);
#endif
}

template <class T, class I>
int delta_width(const void* cur, void* base, int64_t n, void* pos, void* val, void* newv, int64_t cap, void* ws,
                int64_t ws_bytes, int64_t* result, int flags, cudaStream_t stream) {
  const auto pc = reinterpret_cast<uintptr_t>(cur), pb = reinterpret_cast<uintptr_t>(base);
  constexpr int VB = fast_vec_bytes(int(sizeof(T)));
  if (pc % VB == pb % VB && !(flags & 1)) {
    const int64_t shift = static_cast<int64_t>(pc % VB) / static_cast<int64_t>(sizeof(T));
    return launch_delta<T, I, VB>(cur, base, n, shift, pos, val, newv, cap, ws, ws_bytes, result, stream);
  }
  return launch_delta<T, I, sizeof(T)>(cur, base, n, 0, pos, val, newv, cap, ws, ws_bytes, result, stream);
}

// ---------------------------------------------------------------- scatter
// Two kernels: every position is checked (strictly increasing, in range) before any thread of
// the second kernel writes, so a refused input leaves the target untouched, as on the CPU.
template <class I>
__global__ void __launch_bounds__(kBlock) check_kernel(const I* __restrict__ pos, int64_t count, int64_t n,
                                                       int* err) {
  const int64_t stride = int64_t(gridDim.x) * kBlock;
  for (int64_t i = int64_t(blockIdx.x) * kBlock + threadIdx.x; i < count; i += stride) {
    const int64_t p = static_cast<int64_t>(pos[i]);
    const int64_t prev = i ? static_cast<int64_t>(pos[i - 1]) : -1;
    if (p <= prev) atomicMin(err, -4);
    if (i == count - 1 && p >= n) atomicMin(err, -2);
  }
}

template <class T, class I, int Op>
__global__ void __launch_bounds__(kBlock) apply_kernel(T* __restrict__ target, const I* __restrict__ pos,
                                                       const T* __restrict__ vals, int64_t count, const int* err,
                                                       int64_t* __restrict__ result) {
  const int e = *reinterpret_cast<const volatile int*>(err);
  if (blockIdx.x == 0 && threadIdx.x == 0) result[0] = e;
  if (e) return;
  const int64_t i0 = int64_t(blockIdx.x) * kBlock * kApplyItems + threadIdx.x;
  int64_t p[kApplyItems];
  T v[kApplyItems];
#pragma unroll
  for (int k = 0; k < kApplyItems; ++k) {  // all loads first: kApplyItems gathers in flight
    const int64_t i = i0 + k * kBlock;
    p[k] = i < count ? static_cast<int64_t>(__ldcs(pos + i)) : -1;
    v[k] = i < count ? __ldcs(vals + i) : T(0);
  }
#pragma unroll
  for (int k = 0; k < kApplyItems; ++k) {
    if (p[k] < 0) continue;
    T& d = target[p[k]];
    if (Op == 0) d ^= v[k];
    else if (Op == 1) d = v[k];
    else d = funkey<T>(static_cast<T>(fkey<T>(d) + unzigzag<T>(v[k])));
  }
}

template <class T, class I>
int launch_scatter(void* target, int64_t n, const void* pos, const void* vals, int64_t count, int op, void* ws,
                   int64_t* result, cudaStream_t stream) {
  if (count == 0) return launch(write_result, 1, 1, stream, result, int64_t(0), int64_t(0));
  int* err = static_cast<int*>(ws);
  cudaError_t e = cudaMemsetAsync(err, 0, sizeof(int), stream);
  if (e != cudaSuccess) return cuda_status(e);
  const int64_t per = int64_t(kBlock) * kApplyItems;
  const int64_t blocks = (count + per - 1) / per;
  if (blocks > 0x7fffffff) return kErrSpace;
  auto* p = static_cast<const I*>(pos);
  int rc = launch(check_kernel<I>, blocks < 65536 ? blocks : 65536, kBlock, stream, p, count, n, err);
  if (rc) return rc;
  auto* t = static_cast<T*>(target);
  auto* v = static_cast<const T*>(vals);
  auto* e_ = static_cast<const int*>(err);
  if (op == 0) return launch(apply_kernel<T, I, 0>, blocks, kBlock, stream, t, p, v, count, e_, result);
  if (op == 1) return launch(apply_kernel<T, I, 1>, blocks, kBlock, stream, t, p, v, count, e_, result);
  return launch(apply_kernel<T, I, 2>, blocks, kBlock, stream, t, p, v, count, e_, result);
}

#define DCR_DISPATCH_WIDTH(width, ...)                         \
  switch (width) {                                             \
    case 1: { using T = unsigned char; __VA_ARGS__; }          \
    case 2: { using T = unsigned short; __VA_ARGS__; }         \
    case 4: { using T = unsigned int; __VA_ARGS__; }           \
    case 8: { using T = unsigned long long; __VA_ARGS__; }     \
    default: return kErrWidth;                                 \
  }

bool aligned(const void* p, int64_t a) { return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(a) == 0; }

}  // namespace

extern "C" {

int dcr_cuda_abi_version() { return 1; }

// Workspace bytes dcr_cuda_delta needs for n elements (any width, either path).
int64_t dcr_cuda_delta_workspace(int64_t n) {
  if (n < 0) return kErrSpace;
  return kHeader + 8 * ((n + 16 + kMinTile - 1) / kMinTile + 1);
}

// The smallest output capacity that always makes progress (one tile of the vector path).
int64_t dcr_cuda_delta_min_cap(int width) {
  if (width != 1 && width != 2 && width != 4 && width != 8) return kErrWidth;
  return int64_t(kBlock) * kVecs * (fast_vec_bytes(width) / width);
}

// Workspace bytes dcr_cuda_scatter needs.
int64_t dcr_cuda_scatter_workspace() { return 16; }

// Fused delta pass on `stream`: for every i with cur[i] != base[i] (bits), in ascending order,
// pos[k] = i, val[k] = cur[i] ^ base[i], newv[k] = cur[i] (newv optional), and base[i] = cur[i].
// pos/val/newv have room for cap elements (cap >= min(n, dcr_cuda_delta_min_cap(width))).
// result (2 int64, device or pinned host memory) gets {count, done}: done == n when all the
// changes fit; else the changes of [0, done) are written, base is updated there only, and the
// call is resumed at done. base may be pinned host memory (read and written through UVA).
// flags: bit 0 forces the scalar (one element per load) path. Returns 0 when launched.
int dcr_cuda_delta(const void* cur, void* base, int64_t n, int width, void* pos, int pos64, void* val, void* newv,
                   int64_t cap, void* workspace, int64_t workspace_bytes, int64_t* result, int flags,
                   void* stream) {
  if (n < 0) return kErrSpace;
  if (width != 1 && width != 2 && width != 4 && width != 8) return kErrWidth;
  if (!aligned(cur, width) || !aligned(base, width) || !aligned(val, width) || (newv && !aligned(newv, width)) ||
      !aligned(pos, pos64 ? 8 : 4) || !aligned(workspace, 8) || !aligned(result, 8))
    return kErrAlign;
  auto s = static_cast<cudaStream_t>(stream);
  if (pos64) {
    DCR_DISPATCH_WIDTH(width, return delta_width<T, long long>(cur, base, n, pos, val, newv, cap, workspace,
                                                              workspace_bytes, result, flags, s));
  }
  DCR_DISPATCH_WIDTH(width, return delta_width<T, int>(cur, base, n, pos, val, newv, cap, workspace,
                                                            workspace_bytes, result, flags, s));
}

// Scatter sorted (pos, vals) into target (n elements) on `stream`: op 0 XOR, 1 overwrite,
// 2 zig-zag ulp add (not for width 1). Every position is validated on the device before any
// write; result[0] (device or pinned host int64) gets 0, or -4 / -2 when refused (target
// untouched). Returns 0 when launched, < 0 for bad arguments (nothing launched).
int dcr_cuda_scatter(void* target, int64_t n, int width, const void* pos, int pos64, const void* vals,
                     int64_t count, int op, void* workspace, int64_t workspace_bytes, int64_t* result,
                     void* stream) {
  if (op < 0 || op > 2 || (op == 2 && width == 1)) return kErrWidth;
  if (count < 0 || n < 0 || workspace_bytes < dcr_cuda_scatter_workspace()) return kErrSpace;
  if (width != 1 && width != 2 && width != 4 && width != 8) return kErrWidth;
  if (!aligned(target, width) || !aligned(vals, width) || !aligned(pos, pos64 ? 8 : 4) ||
      !aligned(workspace, 8) || !aligned(result, 8))
    return kErrAlign;
  auto s = static_cast<cudaStream_t>(stream);
  if (pos64) {
    DCR_DISPATCH_WIDTH(width, return launch_scatter<T, long long>(target, n, pos, vals, count, op, workspace, result, s));
  }
  DCR_DISPATCH_WIDTH(width, return launch_scatter<T, int>(target, n, pos, vals, count, op, workspace, result, s));
}

// The pointer a kernel uses for p: itself for device memory, the mapped address for pinned
// host memory (the same under UVA). -6 for memory the device cannot reach (pageable host).
int dcr_cuda_device_pointer(const void* p, void** out) {
  cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it: not a sticky error
    return cuda_status(e);
  }
  if (a.type == cudaMemoryTypeUnregistered || a.devicePointer == nullptr) return kErrPointer;
  *out = a.devicePointer;
  return 0;
}

// Text for a status code of this library.
const char* dcr_cuda_strerror(int rc) {
  switch (rc) {
    case 0: return "ok";
    case -9: return "bad width or op";
    case -8: return "workspace or output capacity too small";
    case -7: return "misaligned pointer";
    case -6: return "memory the device cannot reach (pageable host memory?)";
    case -4: return "positions not strictly increasing";
    case -2: return "position out of range";
    default: break;
  }
  if (rc <= kErrCuda) return cudaGetErrorString(static_cast<cudaError_t>(kErrCuda - rc));
  return "unknown status";
}

}  // extern "C"
