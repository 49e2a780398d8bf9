// nemo-dcr CPU kernels: the fused delta pass, the codec's stream transforms and the
// receiver's scatter. Plain C ABI over raw pointers (loaded with ctypes), so the library
// does not depend on the torch C++ ABI and works with any torch >= 2.4.
//
// Conventions: `width` is the element size in bytes (1, 2, 4, 8); elements are raw bit
// patterns; positions are int32 (pos64 == 0) or int64 (pos64 != 0), sorted, strictly
// increasing. Every function that reads untrusted input validates it completely before
// it writes anything to a target tensor.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kSlack = 64;  // elements of headroom per output segment

template <class T>
inline T load(const void* p, int64_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(p) + i * sizeof(T), sizeof(T));
  return v;
}

// ---------------------------------------------------------------- delta pass
// One pass over [begin, end): x = cur ^ base; for each changed element write its
// position, XOR value and (if newv) new value; copy the changed words of cur into base.
// Branch-free per lane inside a 64-bit word, one branch per group of four words (most are
// unchanged at realistic rates).
template <class T, class I, bool kNew>
int64_t delta_range(const T* cur, T* base, int64_t begin, int64_t end, I* pos, T* val, T* newv) {
  constexpr int L = 8 / sizeof(T);
  constexpr int B = 8 * sizeof(T);
  int64_t k = 0;
  int64_t i = begin;
  for (; i + 4 * L <= end; i += 4 * L) {
    uint64_t a[4], b[4], x[4];
    std::memcpy(a, cur + i, 32);
    std::memcpy(b, base + i, 32);
    x[0] = a[0] ^ b[0];
    x[1] = a[1] ^ b[1];
    x[2] = a[2] ^ b[2];
    x[3] = a[3] ^ b[3];
    if ((x[0] | x[1] | x[2] | x[3]) == 0) continue;
    std::memcpy(base + i, a, 32);
    for (int w = 0; w < 4; ++w) {
      uint64_t xw = x[w];
      if (xw == 0) continue;
      for (int l = 0; l < L; ++l) {
        T xl = static_cast<T>(B == 64 ? xw : (xw >> (l * B)));
        pos[k] = static_cast<I>(i + w * L + l);
        val[k] = xl;
        if (kNew) newv[k] = static_cast<T>(B == 64 ? a[w] : (a[w] >> (l * B)));
        k += (xl != 0);
      }
    }
  }
  for (; i < end; ++i) {
    T xl = cur[i] ^ base[i];
    if (xl) {
      base[i] = cur[i];
      pos[k] = static_cast<I>(i);
      val[k] = xl;
      if (kNew) newv[k] = cur[i];
      ++k;
    }
  }
  return k;
}

#if defined(__x86_64__)
// AVX-512 (BW + VBMI2) version for 16-bit elements and int32 positions: 32 elements per
// step; changed lanes are compacted with vpcompress (register form: the memory form is
// microcoded on some cores) and stored unaligned. Output stores may run up to 32 elements
// past the count, which stays inside the segment (k <= elements processed so far).
template <bool kNew>
__attribute__((target("avx512f,avx512bw,avx512vbmi2,popcnt")))
int64_t delta_range_avx512(const uint16_t* cur, uint16_t* base, int64_t begin, int64_t end, int32_t* pos,
                           uint16_t* val, uint16_t* newv) {
  int64_t k = 0;
  int64_t i = begin;
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i sixteen = _mm512_set1_epi32(16);
  for (; i + 32 <= end; i += 32) {
    __m512i a = _mm512_loadu_si512(cur + i);
    __m512i b = _mm512_loadu_si512(base + i);
    __m512i x = _mm512_xor_si512(a, b);
    __mmask32 m = _mm512_test_epi16_mask(x, x);
    if (!m) continue;
    _mm512_storeu_si512(base + i, a);
    _mm512_storeu_si512(val + k, _mm512_maskz_compress_epi16(m, x));
    if (kNew) _mm512_storeu_si512(newv + k, _mm512_maskz_compress_epi16(m, a));
    __mmask16 m0 = static_cast<__mmask16>(m), m1 = static_cast<__mmask16>(m >> 16);
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(i)), iota);
    int c0 = __builtin_popcount(m0);
    _mm512_storeu_si512(pos + k, _mm512_maskz_compress_epi32(m0, idx));
    _mm512_storeu_si512(pos + k + c0, _mm512_maskz_compress_epi32(m1, _mm512_add_epi32(idx, sixteen)));
    k += c0 + __builtin_popcount(m1);
  }
  // The last < 32 elements: the portable loop.
  return k + delta_range<uint16_t, int32_t, kNew>(cur, base, i, end, pos + k, val + k, kNew ? newv + k : nullptr);
}

// AVX2 version of the same pass for CPUs without AVX-512 (AMD Zen 2/3, older Intel): 16
// elements per step; the changed lanes of each half are compacted through two tables indexed
// by the half's 8-bit mask (pshufb for the 16-bit values, vpermd for the int32 positions).
// Stores may run up to 8 elements past the count, inside the segment as above.
struct CompactLut {
  alignas(32) uint32_t perm[256][8];
  alignas(16) uint8_t shuf[256][16];
  CompactLut() {
    for (int m = 0; m < 256; ++m) {
      int c = 0;
      for (int j = 0; j < 8; ++j)
        if (m >> j & 1) {
          perm[m][c] = static_cast<uint32_t>(j);
          shuf[m][2 * c] = static_cast<uint8_t>(2 * j);
          shuf[m][2 * c + 1] = static_cast<uint8_t>(2 * j + 1);
          ++c;
        }
      for (int r = c; r < 8; ++r) {
        perm[m][r] = 0;
        shuf[m][2 * r] = shuf[m][2 * r + 1] = 0x80;
      }
    }
  }
};

const CompactLut& compact_lut() {
  static const CompactLut lut;
  return lut;
}

template <bool kNew>
__attribute__((target("avx2,popcnt")))
int64_t delta_range_avx2(const uint16_t* cur, uint16_t* base, int64_t begin, int64_t end, int32_t* pos,
                         uint16_t* val, uint16_t* newv) {
  const CompactLut& lut = compact_lut();
  int64_t k = 0;
  int64_t i = begin;
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i zero = _mm256_setzero_si256();
  for (; i + 16 <= end; i += 16) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cur + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + i));
    __m256i x = _mm256_xor_si256(a, b);
    if (_mm256_testz_si256(x, x)) continue;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + i), a);
    __m256i z = _mm256_cmpeq_epi16(x, zero);  // all ones in the unchanged lanes
    __m128i zb = _mm_packs_epi16(_mm256_castsi256_si128(z), _mm256_extracti128_si256(z, 1));
    unsigned m = ~static_cast<unsigned>(_mm_movemask_epi8(zb)) & 0xFFFFu;
    for (int h = 0; h < 2; ++h) {
      unsigned mh = (m >> (8 * h)) & 0xFFu;
      if (!mh) continue;
      __m128i sh = _mm_load_si128(reinterpret_cast<const __m128i*>(lut.shuf[mh]));
      __m128i xh = h ? _mm256_extracti128_si256(x, 1) : _mm256_castsi256_si128(x);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(val + k), _mm_shuffle_epi8(xh, sh));
      if (kNew) {
        __m128i ah = h ? _mm256_extracti128_si256(a, 1) : _mm256_castsi256_si128(a);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(newv + k), _mm_shuffle_epi8(ah, sh));
      }
      __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i + 8 * h)), iota);
      __m256i pm = _mm256_load_si256(reinterpret_cast<const __m256i*>(lut.perm[mh]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pos + k), _mm256_permutevar8x32_epi32(idx, pm));
      k += __builtin_popcount(mh);
    }
  }
  return k + delta_range<uint16_t, int32_t, kNew>(cur, base, i, end, pos + k, val + k, kNew ? newv + k : nullptr);
}

bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
  return ok;
}

bool have_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2");
  return ok;
}
#endif

template <class F>
void parallel_for(int nthreads, F&& f) {
  if (nthreads <= 1) {
    f(0);
    return;
  }
  std::vector<std::thread> ts;
  ts.reserve(nthreads - 1);
  for (int t = 1; t < nthreads; ++t) ts.emplace_back(f, t);
  f(0);
  for (auto& th : ts) th.join();
}

template <class T, class I>
int64_t delta_mt(const void* cur_, void* base_, int64_t n, void* pos_, void* val_, void* new_,
                 int nthreads) {
  const T* cur = static_cast<const T*>(cur_);
  T* base = static_cast<T*>(base_);
  I* pos = static_cast<I*>(pos_);
  T* val = static_cast<T*>(val_);
  T* newv = static_cast<T*>(new_);
  if (nthreads < 1) nthreads = 1;
  if (n < (int64_t(1) << 20)) nthreads = 1;
  std::vector<int64_t> begin(nthreads + 1), count(nthreads);
  // Split on 64-element boundaries so threads never share a cache line of base.
  for (int t = 0; t <= nthreads; ++t) {
    int64_t b = (n * t / nthreads) & ~int64_t(63);
    begin[t] = (t == nthreads) ? n : b;
  }
  parallel_for(nthreads, [&](int t) {
    int64_t off = begin[t] + t * kSlack;
#if defined(__x86_64__)
    if constexpr (sizeof(T) == 2 && sizeof(I) == 4) {
      using Pass = int64_t (*)(const uint16_t*, uint16_t*, int64_t, int64_t, int32_t*, uint16_t*, uint16_t*);
      Pass with_new = nullptr, plain = nullptr;
      if (have_avx512() && !std::getenv("NEMO_DCR_NO_AVX512")) {
        with_new = delta_range_avx512<true>;
        plain = delta_range_avx512<false>;
      } else if (have_avx2() && !std::getenv("NEMO_DCR_NO_AVX2")) {
        with_new = delta_range_avx2<true>;
        plain = delta_range_avx2<false>;
      }
      if (with_new) {
        auto* c = reinterpret_cast<const uint16_t*>(cur);
        auto* b = reinterpret_cast<uint16_t*>(base);
        auto* p = reinterpret_cast<int32_t*>(pos + off);
        auto* v = reinterpret_cast<uint16_t*>(val + off);
        count[t] = newv ? with_new(c, b, begin[t], begin[t + 1], p, v, reinterpret_cast<uint16_t*>(newv + off))
                        : plain(c, b, begin[t], begin[t + 1], p, v, nullptr);
        return;
      }
    }
#endif
    count[t] = newv ? delta_range<T, I, true>(cur, base, begin[t], begin[t + 1], pos + off, val + off, newv + off)
                    : delta_range<T, I, false>(cur, base, begin[t], begin[t + 1], pos + off, val + off, nullptr);
  });
  int64_t total = count[0];
  for (int t = 1; t < nthreads; ++t) {
    int64_t off = begin[t] + t * kSlack;
    std::memmove(pos + total, pos + off, count[t] * sizeof(I));
    std::memmove(val + total, val + off, count[t] * sizeof(T));
    if (newv) std::memmove(newv + total, newv + off, count[t] * sizeof(T));
    total += count[t];
  }
  return total;
}

// ---------------------------------------------------------------- ulp transform
// A monotone map from IEEE bit patterns to unsigned integers: ordering by value, exact
// for every pattern (NaN, Inf, -0.0, subnormals), so new = unkey(key(old) + d) is exact.
template <class T>
inline T fkey(T b) {  // b | sign if b >= 0 else ~b, branch-free (the sign is a coin flip)
  using S = typename std::make_signed<T>::type;
  constexpr T sign = T(1) << (8 * sizeof(T) - 1);
  return static_cast<T>(b ^ (static_cast<T>(static_cast<S>(b) >> (8 * sizeof(T) - 1)) | sign));
}
template <class T>
inline T funkey(T k) {  // inverse of fkey: k ^ sign if k has the sign bit, else ~k
  using S = typename std::make_signed<T>::type;
  constexpr T sign = T(1) << (8 * sizeof(T) - 1);
  return static_cast<T>(k ^ (static_cast<T>(~(static_cast<S>(k) >> (8 * sizeof(T) - 1))) | sign));
}
template <class T>
inline T zigzag(T d) {  // d is a two's complement difference
  using S = typename std::make_signed<T>::type;
  S s = static_cast<S>(d);
  return static_cast<T>((static_cast<T>(s) << 1) ^ static_cast<T>(s >> (8 * sizeof(T) - 1)));
}
template <class T>
inline T unzigzag(T z) {
  return static_cast<T>((z >> 1) ^ static_cast<T>(-static_cast<T>(z & 1)));
}

template <class I>
inline int64_t posat(const void* p, int64_t i) {
  return static_cast<int64_t>(static_cast<const I*>(p)[i]);
}

// How many changes ahead a scatter prefetches its target line (apply_values, apply_values_dig).
constexpr int64_t kScatterAhead = 128;

// op: 0 = XOR value into target, 1 = overwrite target with value, 2 = value is a zig-zag
// ulp difference against the target's current bits.
template <class T, class I>
void apply_values(T* target, const I* pos, const T* vals, int64_t count, int op) {
  // Irregular gaps defeat the hardware prefetcher at low change rates: prefetch the
  // target line kAhead changes ahead (positions are validated, so the address is in range).
  // 128 rather than 32: at 1-3% changed a line comes from DRAM, and 32 changes (~0.1 us of
  // work) did not cover its latency (cold 268 MB target, 3%: 14.5 -> 10.5 ms).
  constexpr int64_t kAhead = kScatterAhead;
  // The prefetch is spelled out in each loop: behind a lambda GCC 12 dropped it (no
  // prefetchw in dcr_scatter's loops; 16 ms vs the fused apply's 11 for the same scatter).
  if (op == 0) {
    for (int64_t i = 0; i < count; ++i) {
      if (i + kAhead < count) __builtin_prefetch(target + pos[i + kAhead], 1);
      target[pos[i]] ^= vals[i];
    }
  } else if (op == 1) {
    for (int64_t i = 0; i < count; ++i) {
      if (i + kAhead < count) __builtin_prefetch(target + pos[i + kAhead], 1);
      target[pos[i]] = vals[i];
    }
  } else {
    for (int64_t i = 0; i < count; ++i) {
      if (i + kAhead < count) __builtin_prefetch(target + pos[i + kAhead], 1);
      T& t = target[pos[i]];
      t = funkey<T>(static_cast<T>(fkey<T>(t) + unzigzag<T>(vals[i])));
    }
  }
}

template <class I>
int check_positions(const I* pos, int64_t count, int64_t n) {
  int64_t prev = -1;
  for (int64_t i = 0; i < count; ++i) {
    int64_t p = static_cast<int64_t>(pos[i]);
    if (p <= prev) return -4;  // not strictly increasing
    prev = p;
  }
  if (count > 0 && prev >= n) return -2;
  return 0;
}


// ---------------------------------------------------------------- value transforms
template <class T>
inline T ulp_of(T x, T nb) {  // zig-zag ulp difference of a change with XOR x to new bits nb
  return zigzag<T>(static_cast<T>(fkey<T>(nb) - fkey<T>(static_cast<T>(nb ^ x))));
}

// ---------------------------------------------------------------- rANS (order 0)
// Static rANS with 64-bit states and 32-bit renormalisation (after F. Giesen's public-domain
// ryg_rans "rans64"), 12-bit probabilities (the decode table stays in L1), four interleaved
// states (independent chains the CPU overlaps). A state renormalises at most once per
// symbol and rarely (about every 19 symbols here), so its branch is cheap. Stream layout:
//   the frequency table (compact, format 3: below), u64 LE states 0..3, then u32 LE
//   renormalisation words. Symbol i is coded by state i % 4.
// The table: one byte, bits 0-5 the bytes B (0..32) of a presence bitmap of symbols 0..8B-1,
// bit 7 whether symbol 255 occurs (never in the bitmap); the bitmap; then each present
// symbol's frequency - 1 in ascending symbol order, one byte below 128, else two (low 7 bits
// | 0x80, then the rest). A context-coded chunk carries two small streams per class, and the
// format 2 table (a 32-byte bitmap, two bytes a frequency) was 7% of its bytes at 1% changed.
constexpr int kProbBits = 12;
constexpr uint32_t kProbScale = 1u << kProbBits;
constexpr uint64_t kRansL = uint64_t(1) << 31;
constexpr int kStates = 4;

struct EncSym {
  uint64_t x_max, rcp_freq;
  uint32_t bias, cmpl_freq, rcp_shift;
};

void normalize_freqs(const uint64_t* hist, uint32_t* freq) {
  uint64_t total = 0;
  for (int s = 0; s < 256; ++s) total += hist[s];
  uint32_t sum = 0;
  int best = -1;
  for (int s = 0; s < 256; ++s) {
    freq[s] = 0;
    if (!hist[s]) continue;
    uint64_t f = (hist[s] * kProbScale + total / 2) / total;
    freq[s] = static_cast<uint32_t>(f ? f : 1);
    sum += freq[s];
    if (best < 0 || hist[s] > hist[best]) best = s;
  }
  // Give or take the rounding error from the largest symbols, never below 1.
  while (sum != kProbScale) {
    if (sum < kProbScale) {
      freq[best] += kProbScale - sum;
      sum = kProbScale;
    } else {
      uint32_t excess = sum - kProbScale;
      int s_max = -1;
      for (int s = 0; s < 256; ++s)
        if (freq[s] > 1 && (s_max < 0 || freq[s] > freq[s_max])) s_max = s;
      uint32_t take = std::min(excess, freq[s_max] - 1);
      freq[s_max] -= take;
      sum -= take;
    }
  }
}

void enc_init(EncSym& e, uint32_t start, uint32_t freq) {
  e.x_max = ((kRansL >> kProbBits) << 32) * freq;
  e.cmpl_freq = kProbScale - freq;
  if (freq < 2) {  // q = x - 1 with rcp = ~0, so bias absorbs the difference
    e.rcp_freq = ~uint64_t(0);
    e.rcp_shift = 0;
    e.bias = start + kProbScale - 1;
  } else {  // Alverson's reciprocal: q = mulhi(x, rcp) >> shift == x / freq
    uint32_t shift = 0;
    while (freq > (1u << shift)) shift++;
    e.rcp_freq = static_cast<uint64_t>(((static_cast<unsigned __int128>(1) << (shift + 63)) + freq - 1) / freq);
    e.rcp_shift = shift - 1;
    e.bias = start;
  }
}

inline void enc_put(uint64_t& x, uint32_t*& ptr, const EncSym& e) {
  if (x >= e.x_max) {
    *--ptr = static_cast<uint32_t>(x);
    x >>= 32;
  }
  uint64_t q = static_cast<uint64_t>((static_cast<unsigned __int128>(x) * e.rcp_freq) >> 64) >> e.rcp_shift;
  x = x + e.bias + q * e.cmpl_freq;
}

// Upper bound of the rANS output for n symbols (a symbol costs at most 12 bits).
inline int64_t ans_bound(int64_t n) { return 1 + 32 + 2 * 256 + 8 * kStates + n + n / 2 + 64; }

// rANS of n symbols sym(i) whose histogram is hist (counted by the caller: the fused encoder
// has it from its first pass).
template <class Sym>
int64_t ans_encode_with(const uint64_t* hist, int64_t n, Sym&& sym, uint8_t* out, int64_t cap) {
  if (cap < ans_bound(n)) return -1;
  uint32_t freq[256];
  if (n == 0) {
    std::memset(out, 0, 1 + 8 * kStates);
    return 1 + 8 * kStates;
  }
  normalize_freqs(hist, freq);
  int top = -1;
  for (int s = 0; s < 255; ++s)
    if (freq[s]) top = s;
  const int nb = top < 0 ? 0 : top / 8 + 1;  // 0 where only 255 occurs
  out[0] = static_cast<uint8_t>(nb | (freq[255] ? 0x80 : 0));
  std::memset(out + 1, 0, nb);
  int64_t k = 1 + nb;
  EncSym es[256];
  uint32_t cum = 0;
  for (int s = 0; s < 256; ++s) {
    if (freq[s]) {
      if (s < 255) out[1 + (s >> 3)] |= uint8_t(1u << (s & 7));
      const uint32_t v = freq[s] - 1;
      if (v < 128) {
        out[k++] = static_cast<uint8_t>(v);
      } else {
        out[k++] = static_cast<uint8_t>(0x80 | (v & 0x7f));
        out[k++] = static_cast<uint8_t>(v >> 7);
      }
      enc_init(es[s], cum, freq[s]);
    }
    cum += freq[s];
  }
  // rANS is LIFO: encode backwards into a word buffer, then copy behind the table.
  std::vector<uint32_t> words(static_cast<size_t>(n / 2 + 16));
  uint32_t* end = words.data() + words.size();
  uint32_t* ptr = end;
  uint64_t x[kStates];
  for (auto& v : x) v = kRansL;
  for (int64_t i = n - 1; i >= 0 && (i % kStates) != kStates - 1; --i) enc_put(x[i % kStates], ptr, es[sym(i)]);
  for (int64_t i = (n / kStates) * kStates - 1; i >= 0; i -= kStates) {
    enc_put(x[3], ptr, es[sym(i)]);
    enc_put(x[2], ptr, es[sym(i - 1)]);
    enc_put(x[1], ptr, es[sym(i - 2)]);
    enc_put(x[0], ptr, es[sym(i - 3)]);
  }
  for (int j = 0; j < kStates; ++j)
    for (int b = 0; b < 8; ++b) out[k++] = static_cast<uint8_t>(x[j] >> (8 * b));
  int64_t body = (end - ptr) * 4;
  if (k + body > cap) return -1;
  std::memcpy(out + k, ptr, body);  // little-endian host (x86-64, aarch64)
  return k + body;
}

// ---------------------------------------------------------------- gap decoding
// One gap from a symbol reader sym(k), k < m: escape symbols (esc = "add esc, go on") then
// the remainder. Returns the gap, or -1 (stream ends) / -2 (beyond hi: bounds hostile runs).
template <class Sym>
inline int64_t next_gap(Sym&& sym, int64_t& k, int64_t m, uint32_t esc, int64_t hi) {
  int64_t g = 0;
  while (true) {
    if (k >= m) return -1;
    uint32_t s = sym(k++);
    g += s;
    if (s != esc) return g;
    if (g > hi) return -2;
  }
}

// Positions out[i:count] from the gaps, after position prev. Returns 0 or < 0.
template <class I, class Sym>
int64_t gaps_decode(Sym&& sym, int64_t& k, int64_t m, uint32_t esc, int64_t i, int64_t count,
                    int64_t prev, int64_t hi, I* out) {
  for (; i < count; ++i) {
    int64_t g = next_gap(sym, k, m, esc, hi);
    if (g < 0) return g;
    prev += 1 + g;
    if (prev >= hi) return -2;
    out[i] = static_cast<I>(prev);
  }
  return 0;
}

#if defined(__AVX512F__)
// 16 GAP8 bytes, none an escape, -> 16 int32 positions after prev: widened, +1, an inclusive
// prefix sum across the lanes (4 shifted adds), + prev. The caller keeps prev + 16 * 256 below
// hi, so the lanes cannot overflow and no range check is due. False (nothing written) if a
// byte is an escape.
static inline bool gaps8_block16(const uint8_t* in, int32_t* out, int64_t& prev) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  if (_mm_movemask_epi8(_mm_cmpeq_epi8(b, _mm_set1_epi8(-1)))) return false;
  const __m512i z = _mm512_setzero_si512();
  __m512i x = _mm512_add_epi32(_mm512_cvtepu8_epi32(b), _mm512_set1_epi32(1));
  x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, z, 15));  // + the lane 1 below
  x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, z, 14));  // + 2 below
  x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, z, 12));  // + 4 below
  x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, z, 8));   // + 8 below
  x = _mm512_add_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(prev)));
  _mm512_storeu_si512(out, x);
  prev = _mm_extract_epi32(_mm512_extracti32x4_epi32(x, 3), 3);
  return true;
}
#endif

// GAP8, with fast paths: 16 gap bytes at a time into int32 positions (AVX-512, far enough
// below hi), else 8 at a time when none is an escape (255) and 8 more positions are due; one
// range check per block suffices since positions increase.
template <class I>
int64_t gaps8_decode(const uint8_t* in, int64_t len, int64_t count, int64_t lo, int64_t hi, I* out) {
  auto sym = [in](int64_t k) { return static_cast<uint32_t>(in[k]); };
  int64_t prev = lo - 1;
  int64_t k = 0, i = 0;
  while (i + 8 <= count && k + 8 <= len) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<I, int32_t>) {
      if (i + 16 <= count && k + 16 <= len && prev + 16 * 256 < hi && gaps8_block16(in + k, out + i, prev)) {
        i += 16;
        k += 16;
        continue;
      }
    }
#endif
    uint64_t w;
    std::memcpy(&w, in + k, 8);
    uint64_t inv = ~w;  // a 255 byte becomes a zero byte
    if (((inv - 0x0101010101010101ull) & ~inv & 0x8080808080808080ull) != 0) {
      int64_t rc = gaps_decode(sym, k, len, 255, i, i + 1, prev, hi, out);  // one gap, slowly
      if (rc < 0) return rc;
      prev = static_cast<int64_t>(out[i++]);
      continue;
    }
    for (int j = 0; j < 8; ++j) {
      prev += 1 + static_cast<int64_t>((w >> (8 * j)) & 0xff);
      out[i + j] = static_cast<I>(prev);
    }
    if (prev >= hi) return -2;
    i += 8;
    k += 8;
  }
  int64_t rc = gaps_decode(sym, k, len, 255, i, count, prev, hi, out);
  if (rc < 0) return rc;
  return k == len ? 0 : -3;
}

// GAP16: 16-bit symbols stored as two byte planes (low bytes, then high bytes).
template <class I>
int64_t gaps16_decode(const uint8_t* in, int64_t len, int64_t count, int64_t lo, int64_t hi, I* out) {
  if (len % 2) return -3;
  int64_t m = len / 2;
  auto sym = [in, m](int64_t k) { return static_cast<uint32_t>(in[k]) | (static_cast<uint32_t>(in[m + k]) << 8); };
  int64_t k = 0;
  int64_t rc = gaps_decode(sym, k, m, 65535, 0, count, lo - 1, hi, out);
  if (rc < 0) return rc;
  return k == m ? 0 : -3;
}

#define DISPATCH_WIDTH(width, ...)        \
  switch (width) {                        \
    case 1: { using T = uint8_t; __VA_ARGS__; break; }  \
    case 2: { using T = uint16_t; __VA_ARGS__; break; } \
    case 4: { using T = uint32_t; __VA_ARGS__; break; } \
    case 8: { using T = uint64_t; __VA_ARGS__; break; } \
    default: return -9;                   \
  }

}  // namespace

extern "C" {

int dcr_abi_version() { return 4; }

// The SIMD path the run-time dispatch picks for the hot loops (the BF16 delta pass, the encoder):
// 2 AVX-512, 1 AVX2, 0 portable scalar code. The same CPU checks and environment switches as
// delta_mt, read at each call as there. `nemo-dcr doctor` reports it.
int dcr_simd_path() {
#if defined(__x86_64__)
  if (have_avx512() && !std::getenv("NEMO_DCR_NO_AVX512")) return 2;
  if (have_avx2() && !std::getenv("NEMO_DCR_NO_AVX2")) return 1;
#endif
  return 0;
}

// Fused delta pass. pos/val (and newv, optional: the new values, for the encoder) are
// scratch buffers with room for n + 64 * (nthreads + 1) elements. Returns the number of
// changed elements; pos/val/newv[0:count] hold them in order.
int64_t dcr_delta(const void* cur, void* base, int64_t n, int width, void* pos, int pos64,
                  void* val, void* newv, int nthreads) {
  if (pos64) {
    DISPATCH_WIDTH(width, return delta_mt<T, int64_t>(cur, base, n, pos, val, newv, nthreads));
  } else {
    DISPATCH_WIDTH(width, return delta_mt<T, int32_t>(cur, base, n, pos, val, newv, nthreads));
  }
  return -9;
}

// Scatter sorted (pos, val) into target of n elements with op (see apply_values).
// Validates every position first: returns < 0 and writes nothing on bad input.
// One tensor's scatter, in two steps so that many tensors' positions can all be checked
// before any is written (dcr_scatter_many).
static int check_scatter(const void* pos, int pos64, int64_t count, int64_t n) {
  return pos64 ? check_positions(static_cast<const int64_t*>(pos), count, n)
               : check_positions(static_cast<const int32_t*>(pos), count, n);
}

static int64_t apply_scatter(void* target, int width, const void* pos, int pos64, const void* vals, int64_t count,
                             int op) {
  if (pos64) {
    DISPATCH_WIDTH(width, apply_values<T, int64_t>(static_cast<T*>(target), static_cast<const int64_t*>(pos),
                                                    static_cast<const T*>(vals), count, op));
  } else {
    DISPATCH_WIDTH(width, apply_values<T, int32_t>(static_cast<T*>(target), static_cast<const int32_t*>(pos),
                                                    static_cast<const T*>(vals), count, op));
  }
  return 0;
}

int64_t dcr_scatter(void* target, int64_t n, int width, const void* pos, int pos64,
                    const void* vals, int64_t count, int op) {
  int rc = check_scatter(pos, pos64, count, n);
  if (rc) return rc;
  if (op == 2 && width == 1) return -9;
  return apply_scatter(target, width, pos, pos64, vals, count, op);
}

// Many tensors' scatters in one call (a batched chunk's members, a version's small tensors):
// member i writes targets[i] (numels[i] elements) at pos[i][0:counts[i]] with vals[i]. A
// ctypes call per tensor cost more than the writes of a small one. Every member's positions
// are checked before anything is written: a bad one leaves every target as it was.
int64_t dcr_scatter_many(int64_t m, void* const* targets, const int64_t* numels, const void* const* pos,
                         const void* const* vals, const int64_t* counts, int width, int pos64, int op) {
  if (op == 2 && width == 1) return -9;
  for (int64_t i = 0; i < m; ++i) {
    if (counts[i] < 0) return -10;
    int rc = check_scatter(pos[i], pos64, counts[i], numels[i]);
    if (rc) return rc;
  }
  for (int64_t i = 0; i < m; ++i) {
    int64_t rc = apply_scatter(targets[i], width, pos[i], pos64, vals[i], counts[i], op);
    if (rc) return rc;
  }
  return 0;
}

}  // extern "C"

namespace {

// Each segment of a walk's range (a batch's members one after another) as typed elements,
// with its offset in the range.
template <class F>
static void each_segment(const void* const* segs, const int64_t* lens, int64_t nseg, int width, F&& f) {
  int64_t base = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    if (width == 1) {
      f(static_cast<const uint8_t*>(segs[s]), lens[s], base);
    } else if (width == 2) {
      f(static_cast<const uint16_t*>(segs[s]), lens[s], base);
    } else {
      f(static_cast<const uint32_t*>(segs[s]), lens[s], base);
    }
    base += lens[s];
  }
}

struct CtxWalk {
  int64_t cnt[16] = {0}, nxt[16], j[16];
  const int64_t* ranks;
  const int64_t* rs;
  int64_t* pos_out;
  int64_t* src_out;
  int64_t t = 0;
  inline void advance(int c) {
    ++j[c];
    nxt[c] = j[c] < rs[c + 1] ? ranks[j[c]] : INT64_MAX;
  }
};

template <class T>
static void ctx_scalar(CtxWalk& w, const T* v, int64_t lo, int64_t hi, int64_t base, int shift, uint32_t mask,
                       const uint8_t* cls_map) {
  for (int64_t i = lo; i < hi; ++i) {
    const int c = cls_map[(static_cast<uint32_t>(v[i]) >> shift) & mask];
    if (__builtin_expect(w.cnt[c] == w.nxt[c], 0)) {
      w.pos_out[w.t] = base + i;
      w.src_out[w.t++] = w.j[c];
      w.advance(c);
    }
    ++w.cnt[c];
  }
}

#if defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__BMI2__)
// 64 elements at a time: their exponent bytes, their classes by two 128-entry byte
// permutes, and per class one compare and a popcount; only a class whose next rank falls
// inside the block is looked at bit by bit (pdep selects the rank's bit). The scalar walk's
// counter chain (a load and store per element) cost about 2 ns an element.
template <class T>
static inline __m512i ctx_exps64(const T* v, int shift, uint32_t mask) {
  if constexpr (sizeof(T) == 1) {  // exponent bytes read off a device (shift 0)
    return _mm512_and_si512(_mm512_loadu_si512(v), _mm512_set1_epi8(static_cast<char>(mask)));
  } else if constexpr (sizeof(T) == 2) {
    const __m512i m = _mm512_set1_epi16(static_cast<int16_t>(mask));
    const __m512i a = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(v), _mm_cvtsi32_si128(shift)), m);
    const __m512i b = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(v + 32), _mm_cvtsi32_si128(shift)), m);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)), _mm512_cvtepi16_epi8(b), 1);
  } else {
    const __m512i m = _mm512_set1_epi32(static_cast<int32_t>(mask));
    __m128i q[4];
    for (int k = 0; k < 4; ++k) {
      const __m512i x = _mm512_and_si512(_mm512_srl_epi32(_mm512_loadu_si512(v + 16 * k), _mm_cvtsi32_si128(shift)), m);
      q[k] = _mm512_cvtepi32_epi8(x);
    }
    __m512i r = _mm512_castsi128_si512(q[0]);
    r = _mm512_inserti32x4(r, q[1], 1);
    r = _mm512_inserti32x4(r, q[2], 2);
    return _mm512_inserti32x4(r, q[3], 3);
  }
}

// The block's classes from its exponents by two 128-entry byte permutes (the tables passed
// by value: as members of a struct they were reloaded after every int64 store).
static inline __m512i class_bytes(__m512i e, __m512i t0, __m512i t1, __m512i t2, __m512i t3, int nbits) {
  __m512i cls = _mm512_permutex2var_epi8(t0, e, t1);  // entries 0..127 (e & 127)
  if (nbits > 7) cls = _mm512_mask_blend_epi8(_mm512_movepi8_mask(e), cls, _mm512_permutex2var_epi8(t2, e, t3));
  return cls;
}

// Class c's ranks that fall in a block whose class-c lanes are m (lo: the class's count
// before the block): their bits into emit, the class's next rank and index moved on.
static inline void emit_class(uint64_t m, int64_t lo, int64_t& nxt, int64_t& j, int64_t end, const int64_t* ranks,
                              uint64_t& emit) {
  const int64_t pc = __builtin_popcountll(m);
  int64_t r = nxt - lo;
  while (r >= 0 && r < pc) {
    emit |= _pdep_u64(1ULL << r, m);
    ++j;
    nxt = j < end ? ranks[j] : INT64_MAX;
    r = nxt - lo;
  }
}

// The emitted positions of a block in order, each one's source the next index of its class.
static inline int64_t emit_positions(uint64_t emit, __m512i cls, int64_t at, int64_t* js, int64_t* pos_out,
                                     int64_t* src_out, int64_t t) {
  alignas(64) uint8_t cb[64];
  _mm512_store_si512(cb, cls);
  for (uint64_t e = emit; e; e &= e - 1) {
    const int b = __builtin_ctzll(e);
    pos_out[t] = at + b;
    src_out[t++] = js[cb[b]]++;
  }
  return t;
}

template <class T>
static int64_t ctx_simd(CtxWalk& w, int k, const T* v, int64_t n, int64_t base, int shift, int nbits,
                        const uint8_t* map256) {
  const __m512i t0 = _mm512_loadu_si512(map256), t1 = _mm512_loadu_si512(map256 + 64);
  const __m512i t2 = _mm512_loadu_si512(map256 + 128), t3 = _mm512_loadu_si512(map256 + 192);
  const uint32_t mask = (1u << nbits) - 1;
  // The walk's state in locals: stores to the int64 outputs could alias the struct's int64
  // arrays, which made the compiler reload every counter after each emission.
  int64_t cnt[16], nxt[16], j[16], end[16];
  for (int c = 0; c < k; ++c) {
    cnt[c] = w.cnt[c];
    nxt[c] = w.nxt[c];
    j[c] = w.j[c];
    end[c] = w.rs[c + 1];
  }
  const int64_t* __restrict ranks = w.ranks;
  int64_t* __restrict pos_out = w.pos_out;
  int64_t* __restrict src_out = w.src_out;
  int64_t t = w.t;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i cls = class_bytes(ctx_exps64(v + i, shift, mask), t0, t1, t2, t3, nbits);
    // Which classes have a rank in this block, without a branch per class (a mispredicted
    // one per emitting class cost more than the compares); then one 64-bit mask of the
    // emitted positions, read in position order, each one's source the next index of its class.
    uint64_t ms[16];
    uint32_t hit = 0;
    for (int c = 0; c < k; ++c) {
      ms[c] = _mm512_cmpeq_epi8_mask(cls, _mm512_set1_epi8(static_cast<char>(c)));
      const int64_t r = nxt[c] - cnt[c];
      hit |= static_cast<uint32_t>(r >= 0 && r < __builtin_popcountll(ms[c])) << c;
    }
    if (hit) {
      uint64_t emit = 0;
      int64_t js[16];
      for (uint32_t h = hit; h; h &= h - 1) {
        const int c = __builtin_ctz(h);
        js[c] = j[c];
        emit_class(ms[c], cnt[c], nxt[c], j[c], end[c], ranks, emit);
      }
      t = emit_positions(emit, cls, base + i, js, pos_out, src_out, t);
    }
    for (int c = 0; c < k; ++c) cnt[c] += __builtin_popcountll(ms[c]);
  }
  for (int c = 0; c < k; ++c) {
    w.cnt[c] = cnt[c];
    w.nxt[c] = nxt[c];
    w.j[c] = j[c];
  }
  w.t = t;
  return i;
}

#if defined(__GFNI__) && defined(__AVX512BITALG__)
// Every class's count of a 64-element block at once, for up to 8 classes: each element's
// class as a one-hot byte, an 8x8 bit transpose per 8 elements (gf2p8affine with the data as
// the matrix: byte c of each qword then holds which of its 8 elements are of class c), byte
// popcounts, and a sum over the 8 qwords. Against a compare, a mask move, a popcount and an
// add per class, the block costs about half as many instructions at 8 classes; each class's
// distance to its next rank is kept in a vector, and only a block where one falls inside takes
// the per-class code.
// A block's count of each of classes 0..7 (one int64 lane each): each element's class as a
// one-hot byte, an 8x8 bit transpose per qword (gf2p8affine), byte popcounts, a sum over the qwords.
static inline __m512i class_counts8(__m512i cls, __m512i onehot, __m512i rows) {
  const __m512i tr = _mm512_gf2p8affine_epi64_epi8(rows, _mm512_shuffle_epi8(onehot, cls), 0);
  const __m512i pc = _mm512_popcnt_epi8(tr);
  const __m256i s4 = _mm256_add_epi8(_mm512_castsi512_si256(pc), _mm512_extracti64x4_epi64(pc, 1));
  const __m128i s2 = _mm_add_epi8(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
  return _mm512_cvtepu8_epi64(_mm_add_epi8(s2, _mm_unpackhi_epi64(s2, s2)));
}

template <class T>
static int64_t ctx_simd8(CtxWalk& w, int k, const T* v, int64_t n, int64_t base, int shift, int nbits,
                         const uint8_t* map256) {
  const __m512i t0 = _mm512_loadu_si512(map256), t1 = _mm512_loadu_si512(map256 + 64);
  const __m512i t2 = _mm512_loadu_si512(map256 + 128), t3 = _mm512_loadu_si512(map256 + 192);
  const uint32_t mask = (1u << nbits) - 1;
  const __m512i onehot = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 0, 0, 0, 0, 0, 0, 0, 0));
  const __m512i rows = _mm512_set1_epi64(0x8040201008040201LL);
  int64_t nxt[16], j[16], end[16];
  alignas(64) int64_t cnt[8], rem[8];
  for (int c = 0; c < 8; ++c) {
    const bool live = c < k;
    cnt[c] = live ? w.cnt[c] : 0;
    nxt[c] = live ? w.nxt[c] : INT64_MAX;
    j[c] = live ? w.j[c] : 0;
    end[c] = live ? w.rs[c + 1] : 0;
    rem[c] = live ? nxt[c] - cnt[c] : INT64_MAX;
  }
  __m512i cntv = _mm512_load_si512(cnt), remv = _mm512_load_si512(rem);
  const int64_t* __restrict ranks = w.ranks;
  int64_t* __restrict pos_out = w.pos_out;
  int64_t* __restrict src_out = w.src_out;
  int64_t t = w.t;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i cls = class_bytes(ctx_exps64(v + i, shift, mask), t0, t1, t2, t3, nbits);
    const __m512i counts = class_counts8(cls, onehot, rows);
    const __m512i after = _mm512_sub_epi64(remv, counts);
    const __mmask8 hit = _mm512_cmplt_epi64_mask(after, _mm512_setzero_si512());
    if (!hit) {
      remv = after;
      cntv = _mm512_add_epi64(cntv, counts);
      continue;
    }
    _mm512_store_si512(cnt, cntv);
    _mm512_store_si512(rem, after);
    uint64_t emit = 0;
    int64_t js[16];
    for (uint32_t h = hit; h; h &= h - 1) {
      const int c = __builtin_ctz(h);
      const uint64_t m = _mm512_cmpeq_epi8_mask(cls, _mm512_set1_epi8(static_cast<char>(c)));
      js[c] = j[c];
      emit_class(m, cnt[c], nxt[c], j[c], end[c], ranks, emit);
      rem[c] = nxt[c] == INT64_MAX ? INT64_MAX : nxt[c] - (cnt[c] + __builtin_popcountll(m));
    }
    remv = _mm512_load_si512(rem);
    cntv = _mm512_add_epi64(cntv, counts);
    t = emit_positions(emit, cls, base + i, js, pos_out, src_out, t);
  }
  _mm512_store_si512(cnt, cntv);
  for (int c = 0; c < k; ++c) {
    w.cnt[c] = cnt[c];
    w.nxt[c] = nxt[c];
    w.j[c] = j[c];
  }
  w.t = t;
  return i;
}
#endif

#endif

}  // namespace

extern "C" {

// Context-coded positions (codec/context.py): each changed position is sent as its rank
// among the positions of its class, the class being cls_map[old exponent]. One walk over
// the old bits (segs: the chunk's range, a batch's members one after another) counts every
// class's positions; where class c's count reaches its next rank, that position is emitted.
// Emitted in increasing position order, each with src: its index in the ranks (class by
// class, rank_starts[c]..rank_starts[c + 1]), which also indexes the class's tokens.
// Returns the number emitted, or -(c + 1) if class c's ranks are not all found (one beyond
// its population, or not increasing). class_counts gets each population. Width 1: the
// segments are the exponents themselves (shift 0), as a GPU receiver copies them to the host.
int64_t dcr_ctx_positions(const void* const* segs, const int64_t* lens, int64_t nseg, int width, int shift,
                          int nbits, const uint8_t* cls_map, int k, const int64_t* ranks, const int64_t* rank_starts,
                          int64_t* pos_out, int64_t* src_out, int64_t* class_counts) {
  if (k < 1 || k > 16 || (width != 1 && width != 2 && width != 4) || nbits < 1 || nbits > 8) return -100;
  CtxWalk w;
  w.ranks = ranks;
  w.rs = rank_starts;
  w.pos_out = pos_out;
  w.src_out = src_out;
  for (int c = 0; c < k; ++c) {
    w.j[c] = rank_starts[c];
    w.nxt[c] = w.j[c] < rank_starts[c + 1] ? ranks[w.j[c]] : INT64_MAX;
  }
  uint8_t map256[256] = {0};
  std::memcpy(map256, cls_map, size_t{1} << nbits);
  const uint32_t mask = (1u << nbits) - 1;
  each_segment(segs, lens, nseg, width, [&](const auto* v, int64_t len, int64_t base) {
    int64_t done = 0;
#if defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__BMI2__)
    if (!std::getenv("NEMO_DCR_NO_AVX512")) {
#if defined(__GFNI__) && defined(__AVX512BITALG__)
      if (k <= 8 && !std::getenv("NEMO_DCR_NO_GFNI")) {
        done = ctx_simd8(w, k, v, len, base, shift, nbits, map256);
      } else {
        done = ctx_simd(w, k, v, len, base, shift, nbits, map256);
      }
#else
      done = ctx_simd(w, k, v, len, base, shift, nbits, map256);
#endif
    }
#endif
    ctx_scalar(w, v, done, len, base, shift, mask, map256);
  });
  for (int c = 0; c < k; ++c) {
    class_counts[c] = w.cnt[c];
    if (w.j[c] != rank_starts[c + 1]) return -(c + 1);
  }
  return w.t;
}

}  // extern "C"

namespace {

// The sender's side of context coding (ctx_ranks_walk below, for dcr_ctx_encode): the walk
// reads the NEW bits of a chunk's range (the sender's baseline after the step, so no copy of
// the old tensor is made) and ranks each change among the positions of its class in those
// bits. Only a change whose old and new classes differ makes the old bits' counts differ:
// class c's count of old values before p is the new bits' count plus, over changed q < p,
// +1 where q's old class is c and -1 where its new class is. Such changes are rare (an
// exponent moves at a binade's edge), so the walk leaves them to a pass after it.
struct RankWalk {
  int64_t cnt[16] = {0};
  const int64_t* pos;
  const uint8_t* cold;
  const uint8_t* cnew;
  int64_t count, j = 0;
  int64_t* ranks;
};

template <class T>
static bool rank_scalar(RankWalk& w, const T* v, int64_t lo, int64_t hi, int shift, uint32_t mask,
                        const uint8_t* cls_map) {
  for (int64_t i = lo; i < hi; ++i) {
    const int c = cls_map[(static_cast<uint32_t>(v[i]) >> shift) & mask];
    if (w.j < w.count && w.pos[w.j] == i) {
      if (w.cnew[w.j] != c) return false;  // the caller's new class disagrees with the bits
      w.ranks[w.j] = w.cnt[w.cold[w.j]];
      ++w.j;
    }
    ++w.cnt[c];
  }
  return true;
}

#if defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__BMI2__)
// 64 elements a step, as ctx_simd: the classes by byte permutes, per class a compare and a
// popcount; a change inside the block takes its class's count below it from the mask. The
// changes of a block are ranked four at a time without a branch per change (a block holds
// about 3 at 5%, and the data-dependent loop exit was most of the walk's cost): the four
// after the last one ranked are all computed, and the ones past the block are written again
// when their block comes (pos, cold and cnew hold 4 sentinel entries past count, ranks room
// for them).
template <class T>
static int64_t rank_simd(RankWalk& w, int k, const T* v, int64_t n, int shift, int nbits, const uint8_t* map256) {
  const __m512i t0 = _mm512_loadu_si512(map256), t1 = _mm512_loadu_si512(map256 + 64);
  const __m512i t2 = _mm512_loadu_si512(map256 + 128), t3 = _mm512_loadu_si512(map256 + 192);
  const uint32_t mask = (1u << nbits) - 1;
  int64_t cnt[16];
  for (int c = 0; c < 16; ++c) cnt[c] = w.cnt[c];
  const int64_t* __restrict pos = w.pos;
  const uint8_t* __restrict cold = w.cold;
  const uint8_t* __restrict cnew = w.cnew;
  int64_t* __restrict ranks = w.ranks;
  int64_t j = w.j;
  uint64_t bad = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i cls = class_bytes(ctx_exps64(v + i, shift, mask), t0, t1, t2, t3, nbits);
    const int64_t end = i + 64;
    if (pos[j] >= end) {  // no change in the block: only the counts
      for (int c = 0; c < k; ++c)
        cnt[c] += __builtin_popcountll(_mm512_cmpeq_epi8_mask(cls, _mm512_set1_epi8(static_cast<char>(c))));
      continue;
    }
    uint64_t m[16];
    for (int c = 0; c < k; ++c) m[c] = _mm512_cmpeq_epi8_mask(cls, _mm512_set1_epi8(static_cast<char>(c)));
    int64_t next = pos[j];
    do {
      const int off = static_cast<int>(next - i);
      const int co = cold[j];
      bad |= ~(m[cnew[j]] >> off);  // the caller's new class disagrees with the bits
      ranks[j] = cnt[co] + __builtin_popcountll(m[co] & ((uint64_t{1} << off) - 1));
      next = pos[++j];
    } while (next < end);
    for (int c = 0; c < k; ++c) cnt[c] += __builtin_popcountll(m[c]);
  }
  for (int c = 0; c < 16; ++c) w.cnt[c] = cnt[c];
  w.j = j;
  return (bad & 1) ? -1 : i;
}

#if defined(__GFNI__) && defined(__AVX512BITALG__)
// rank_simd for up to 8 classes: every class's count of a block at once, as the decoder's
// ctx_simd8 counts them (one-hot bytes, an 8x8 bit transpose, byte popcounts), and one compare
// per change for its own class's lanes. rank_simd's compare and popcount per class and block
// were most of the sender's walk, and the class estimate now picks 6-8 classes at 1%.
template <class T>
static int64_t rank_simd8(RankWalk& w, const T* v, int64_t n, int shift, int nbits, const uint8_t* map256) {
  const __m512i t0 = _mm512_loadu_si512(map256), t1 = _mm512_loadu_si512(map256 + 64);
  const __m512i t2 = _mm512_loadu_si512(map256 + 128), t3 = _mm512_loadu_si512(map256 + 192);
  const uint32_t mask = (1u << nbits) - 1;
  const __m512i onehot = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 0, 0, 0, 0, 0, 0, 0, 0));
  const __m512i rows = _mm512_set1_epi64(0x8040201008040201LL);
  alignas(64) int64_t cnt[8];
  for (int c = 0; c < 8; ++c) cnt[c] = w.cnt[c];
  __m512i cntv = _mm512_load_si512(cnt);
  const int64_t* __restrict pos = w.pos;
  const uint8_t* __restrict cold = w.cold;
  const uint8_t* __restrict cnew = w.cnew;
  int64_t* __restrict ranks = w.ranks;
  int64_t j = w.j;
  uint64_t bad = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i cls = class_bytes(ctx_exps64(v + i, shift, mask), t0, t1, t2, t3, nbits);
    const __m512i counts = class_counts8(cls, onehot, rows);
    const int64_t end = i + 64;
    if (pos[j] < end) {
      _mm512_store_si512(cnt, cntv);
      int64_t next = pos[j];
      do {
        const int off = static_cast<int>(next - i);
        const int co = cold[j];
        const uint64_t mo = _mm512_cmpeq_epi8_mask(cls, _mm512_set1_epi8(static_cast<char>(co)));
        const uint64_t mn = _mm512_cmpeq_epi8_mask(cls, _mm512_set1_epi8(static_cast<char>(cnew[j])));
        bad |= ~(mn >> off);  // the caller's new class disagrees with the bits
        ranks[j] = cnt[co] + __builtin_popcountll(mo & ((uint64_t{1} << off) - 1));
        next = pos[++j];
      } while (next < end);
    }
    cntv = _mm512_add_epi64(cntv, counts);
  }
  _mm512_store_si512(cnt, cntv);
  for (int c = 0; c < 8; ++c) w.cnt[c] = cnt[c];
  w.j = j;
  return (bad & 1) ? -1 : i;
}
#endif
#endif

// Context coding, the sender's walk: for each changed position pos[j] (increasing, relative
// to the range) its rank among the positions of its OLD class, the class being cls_map[old
// exponent], read from the range's bits `cur` (the new ones: the sender's baseline) and the
// classes of the changed positions (cold: of the old value, cnew: of the new one). pos, cold
// and cnew hold 4 entries past count (pos: >= n), ranks room for count + 4. class_counts
// gets each old class's population. Returns 0, or -1 if the positions are not increasing
// inside [0, n) or a new class disagrees with cur. Arguments otherwise unchecked: the fused
// encoder (dcr_ctx_encode) makes the classes itself.
static int64_t ctx_ranks_walk(const void* cur, int64_t n, int width, int shift, int nbits, const uint8_t* cls_map,
                              int k, const int64_t* pos, const uint8_t* cold, const uint8_t* cnew, int64_t count,
                              int64_t* ranks, int64_t* class_counts) {
  if (count && (pos[0] < 0 || pos[count - 1] >= n)) return -1;
  bool unordered = false;
  for (int64_t j = 1; j < count; ++j) unordered |= pos[j] <= pos[j - 1];
  if (unordered) return -1;
  RankWalk w;
  w.pos = pos;
  w.cold = cold;
  w.cnew = cnew;
  w.count = count;
  w.ranks = ranks;
  uint8_t map256[256] = {0};
  std::memcpy(map256, cls_map, size_t{1} << nbits);
  const uint32_t mask = (1u << nbits) - 1;
  auto walk = [&](const auto* v) -> bool {
    int64_t done = 0;
#if defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__BMI2__)
    if (!std::getenv("NEMO_DCR_NO_AVX512")) {
#if defined(__GFNI__) && defined(__AVX512BITALG__)
      if (k <= 8 && !std::getenv("NEMO_DCR_NO_GFNI")) {
        done = rank_simd8(w, v, n, shift, nbits, map256);
      } else {
        done = rank_simd(w, k, v, n, shift, nbits, map256);
      }
#else
      done = rank_simd(w, k, v, n, shift, nbits, map256);
#endif
      if (done < 0) return false;
    }
#endif
    return rank_scalar(w, v, done, n, shift, mask, map256);
  };
  const bool ok = width == 2 ? walk(static_cast<const uint16_t*>(cur)) : walk(static_cast<const uint32_t*>(cur));
  if (!ok || w.j != count) return -1;
  // the changes whose class moved: each shifts the ranks of the later changes of both classes
  int64_t corr[16] = {0};
  int64_t first = 0;
  while (first < count && cold[first] == cnew[first]) ++first;
  for (int64_t j = first; j < count; ++j) {
    const int co = cold[j], cn = cnew[j];
    ranks[j] += corr[co];
    if (__builtin_expect(co != cn, 0)) {  // rare: no read-modify-write chain through corr per change
      ++corr[co];
      --corr[cn];
    }
  }
  for (int c = 0; c < k; ++c) class_counts[c] = w.cnt[c] + corr[c];
  return 0;
}

}  // namespace

extern "C" {

// Context coding, the decoder's values: the walk emits positions in order with src, each one's
// index into the classes' tokens (toks, class by class); a token below 255 is the value, 255
// takes the next escape (escapes are in position order). Returns 0, or -1 if the escapes
// do not add up.
int64_t dcr_ctx_values(const int64_t* src, int64_t count, const uint8_t* toks, const void* esc, int64_t n_esc,
                       int width, void* out) {
  int64_t e = 0;
  auto run = [&](auto* o, const auto* x) -> bool {
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t t = toks[src[i]];
      if (t != 255) {
        o[i] = t;
      } else {
        if (e >= n_esc) return false;
        o[i] = x[e++];
      }
    }
    return true;
  };
  bool ok;
  if (width == 2) {
    ok = run(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(esc));
  } else if (width == 4) {
    ok = run(static_cast<uint32_t*>(out), static_cast<const uint32_t*>(esc));
  } else {
    return -100;
  }
  return ok && e == n_esc ? 0 : -1;
}

// Exponent histogram of a sample of v: `block` elements every `every` (the sender chooses its
// classes from it; the decoder never sees it, so a sample only costs a little compression).
int64_t dcr_exp_hist(const void* v, int64_t n, int width, int shift, int nbits, int64_t block, int64_t every,
                     int64_t* hist) {
  if ((width != 2 && width != 4) || nbits < 1 || nbits > 8 || block < 1 || every < block) return -100;
  const uint32_t mask = (1u << nbits) - 1;
  int64_t h[4][256] = {{0}};
  int64_t seen = 0;
  auto run = [&](const auto* x) {
    for (int64_t s = 0; s < n; s += every) {
      const int64_t e = std::min(n, s + block);
      int64_t i = s;
      for (; i + 4 <= e; i += 4) {
        ++h[0][(static_cast<uint32_t>(x[i]) >> shift) & mask];
        ++h[1][(static_cast<uint32_t>(x[i + 1]) >> shift) & mask];
        ++h[2][(static_cast<uint32_t>(x[i + 2]) >> shift) & mask];
        ++h[3][(static_cast<uint32_t>(x[i + 3]) >> shift) & mask];
      }
      for (; i < e; ++i) ++h[0][(static_cast<uint32_t>(x[i]) >> shift) & mask];
      seen += e - s;
    }
  };
  if (width == 2) {
    run(static_cast<const uint16_t*>(v));
  } else {
    run(static_cast<const uint32_t*>(v));
  }
  for (int e = 0; e < (1 << nbits); ++e) hist[e] = h[0][e] + h[1][e] + h[2][e] + h[3][e];
  return seen;
}

// A batch's member table (codec/format.py member_table): m entries of var prefix, var
// suffix length, the suffix, var numel, var count. Fills out[5 * i ..] with prefix, suffix
// length, the suffix's offset, numel and count, checking every field that needs no name;
// the caller builds the names. Returns 0, or -(i + 1) for a malformed or truncated entry i
// (-(m + 1): trailing bytes); the caller's own parser then names the problem.
static bool table_varint(const uint8_t* buf, int64_t len, int64_t& p, int64_t& v) {
  uint64_t n = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (p >= len) return false;
    const uint8_t b = buf[p++];
    n |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (b < 0x80) {
      if (n > static_cast<uint64_t>(INT64_MAX)) return false;
      v = static_cast<int64_t>(n);
      return true;
    }
  }
  return false;
}

int64_t dcr_member_table(const uint8_t* buf, int64_t len, int64_t m, int64_t max_name, int64_t* out) {
  int64_t p = 0, prev = 0;
  for (int64_t i = 0; i < m; ++i) {
    int64_t k, s, numel, c;
    if (!table_varint(buf, len, p, k) || !table_varint(buf, len, p, s)) return -(i + 1);
    if (k > prev || s > max_name || k + s > max_name || s > len - p) return -(i + 1);
    const int64_t off = p;
    p += s;
    if (!table_varint(buf, len, p, numel) || !table_varint(buf, len, p, c) || c > numel) return -(i + 1);
    int64_t* o = out + 5 * i;
    o[0] = k; o[1] = s; o[2] = off; o[3] = numel; o[4] = c;
    prev = k + s;
  }
  return p == len ? 0 : -(m + 1);
}

// Zig-zag ulp differences of XOR values, given the new values at the same positions.
int64_t dcr_ulp_encode(const void* vals, const void* newv, int64_t count, int width, void* out) {
  if (width == 1) return -9;
  DISPATCH_WIDTH(width, {
    const T* v = static_cast<const T*>(vals);
    const T* nv = static_cast<const T*>(newv);
    T* o = static_cast<T*>(out);
    for (int64_t i = 0; i < count; ++i) o[i] = ulp_of<T>(v[i], nv[i]);
  });
  return 0;
}

// Values (as zig-zag ulp differences if ulp; newv holds the new values) -> one byte token
// each (min(v, 255)) plus the full value of every v >= 255 in esc. hist (optional, 512
// counters) gets the token histograms of the raw coding [0:256] and, with newv, of the ulp
// coding [256:512], for the encoder's choice (bin 255 counts escapes). Returns #escapes.
int64_t dcr_tokens(const void* vals, const void* newv, int64_t count, int width, int ulp,
                   uint8_t* tok, void* esc, uint64_t* hist) {
  if ((ulp || newv) && width == 1) return -9;
  if (ulp && !newv) return -9;
  if (hist) std::memset(hist, 0, sizeof(uint64_t) * 512);
  // four banks of counters, summed at the end: a float delta's tokens are mostly one or two
  // values, and one bank would make every increment wait on the one before
  uint32_t banks[4][512] = {};
  int64_t e = 0;
  DISPATCH_WIDTH(width, {
    const T* v = static_cast<const T*>(vals);
    const T* nv = static_cast<const T*>(newv);
    T* out = static_cast<T*>(esc);
    for (int64_t i = 0; i < count; ++i) {
      T raw = v[i];
      T z = nv ? ulp_of<T>(raw, nv[i]) : T(0);
      T x = ulp ? z : raw;
      bool big = x >= T(255);
      tok[i] = big ? uint8_t(255) : static_cast<uint8_t>(x);
      out[e] = x;
      e += big;
      if (hist) {
        uint32_t* b = banks[i & 3];
        b[raw >= T(255) ? 255 : raw]++;
        if (nv) b[256 + (z >= T(255) ? 255 : z)]++;
      }
      if ((i & 0x3fffffff) == 0x3fffffff && hist) {  // flush before a 32-bit counter could wrap
        for (auto& bk : banks)
          for (int s = 0; s < 512; ++s) hist[s] += bk[s], bk[s] = 0;
      }
    }
  });
  if (hist)
    for (auto& bk : banks)
      for (int s = 0; s < 512; ++s) hist[s] += bk[s];
  return e;
}

// Upper bound of dcr_ans_encode's output for n symbols.
int64_t dcr_ans_bound(int64_t n) { return ans_bound(n); }

// Order-0 rANS of n bytes. Returns the stream length, or -1 if cap is too small.
int64_t dcr_ans_encode(const uint8_t* sym, int64_t n, uint8_t* out, int64_t cap) {
  uint64_t hist[256] = {0};
  for (int64_t i = 0; i < n; ++i) hist[sym[i]]++;
  return ans_encode_with(hist, n, [sym](int64_t i) { return sym[i]; }, out, cap);
}

}  // extern "C"

namespace {
// Decode n symbols into sink(i, symbol); validates the table, every read and the final
// states. Returns 0, or < 0 (-1: truncated, -5: bad frequency table, -6: corrupt stream).
template <class Sink>
int64_t ans_decode(const uint8_t* in, int64_t len, int64_t n, Sink&& sink) {
  if (len < 1) return -1;
  const int nb = in[0] & 0x3f;
  if (nb > 32 || (in[0] & 0x40)) return -5;
  if (1 + nb > len) return -1;
  if (nb == 32 && (in[32] & 0x80)) return -5;  // symbol 255 is flagged in the first byte only
  uint32_t freq[256], cumf[256];
  int64_t k = 1 + nb;
  uint32_t cum = 0;
  for (int s = 0; s < 256; ++s) {
    freq[s] = 0;
    const bool present = s == 255 ? (in[0] & 0x80) != 0 : s < 8 * nb && (in[1 + (s >> 3)] & (1u << (s & 7)));
    if (present) {
      if (k >= len) return -1;
      uint32_t v = in[k++];
      if (v & 0x80) {
        if (k >= len) return -1;
        v = (v & 0x7f) | (uint32_t(in[k++]) << 7);
      }
      if (v >= kProbScale) return -5;
      freq[s] = v + 1;
    }
    cumf[s] = cum;
    cum += freq[s];
  }
  if (n == 0) return (cum == 0 && k + 8 * kStates == len) ? 0 : -6;
  if (cum != kProbScale) return -5;
  // Packed per-slot entry: symbol (8 bits) | freq - 1 (12 bits) | slot - cum (12 bits).
  uint32_t tab[kProbScale];
  for (int s = 0; s < 256; ++s)
    for (uint32_t j = 0; j < freq[s]; ++j) tab[cumf[s] + j] = uint32_t(s) | ((freq[s] - 1) << 8) | (j << 20);
  if (k + 8 * kStates > len) return -1;
  if ((len - k - 8 * kStates) % 4) return -6;
  uint64_t x[kStates];
  for (int j = 0; j < kStates; ++j) {
    uint64_t v = 0;
    for (int b = 0; b < 8; ++b) v |= uint64_t(in[k + 8 * j + b]) << (8 * b);
    if (v < kRansL) return -6;
    x[j] = v;
  }
  const uint8_t* p = in + k + 8 * kStates;
  const uint8_t* end = in + len;
  constexpr uint64_t mask = kProbScale - 1;
  auto step = [&](uint64_t& st, int64_t i) -> bool {
    const uint32_t e = tab[st & mask];
    sink(i, static_cast<uint8_t>(e));
    st = (((e >> 8) & mask) + 1) * (st >> kProbBits) + (e >> 20);
    if (st < kRansL) {
      if (end - p < 4) return false;
      uint32_t w;
      std::memcpy(&w, p, 4);
      p += 4;
      st = (st << 32) | w;
    }
    return true;
  };
  // Fast loop while every state can renormalise without a bounds check.
  int64_t i = 0;
  for (; i + kStates <= n && end - p >= 4 * kStates; i += kStates) {
    for (int j = 0; j < kStates; ++j) {
      uint64_t& st = x[j];
      const uint32_t e = tab[st & mask];
      sink(i + j, static_cast<uint8_t>(e));
      st = (((e >> 8) & mask) + 1) * (st >> kProbBits) + (e >> 20);
      if (st < kRansL) {
        uint32_t w;
        std::memcpy(&w, p, 4);
        p += 4;
        st = (st << 32) | w;
      }
    }
  }
  for (; i < n; ++i)
    if (!step(x[i % kStates], i)) return -1;
  if (p != end) return -6;
  for (int j = 0; j < kStates; ++j)
    if (x[j] != kRansL) return -6;
  return 0;
}
}  // namespace

extern "C" {

// Decode n symbols (bytes) into out.
int64_t dcr_ans_decode(const uint8_t* in, int64_t len, uint8_t* out, int64_t n) {
  return ans_decode(in, len, n, [out](int64_t i, uint8_t s) { out[i] = s; });
}

// Decode a TOKENS value stream straight into values: token t < 255 is the value t, token
// 255 takes the next escaped value. -7 if the escapes do not match the tokens.
int64_t dcr_ans_decode_values(const uint8_t* in, int64_t len, int64_t n, const void* esc,
                              int64_t n_esc, int width, void* vals) {
  int64_t e = 0;
  int64_t rc = -9;
  DISPATCH_WIDTH(width, {
    T* v = static_cast<T*>(vals);
    const T* ev = static_cast<const T*>(esc);
    rc = ans_decode(in, len, n, [&](int64_t i, uint8_t s) {
      if (s != 255) {
        v[i] = static_cast<T>(s);
      } else {
        v[i] = e < n_esc ? ev[e] : T(0);
        ++e;
      }
    });
  });
  if (rc < 0) return rc;
  return e == n_esc ? 0 : -7;
}

// Gap coding of sorted positions in [lo, hi): gap g = p - prev - 1 (prev starts at lo - 1).
// mode 0: bytes, each g as floor(g / 255) bytes of 255 then g % 255.
// mode 1: 16-bit symbols (65535 repeats), stored as two planes (low bytes, then high bytes).
// Returns bytes written, or < 0 (-1: cap too small, -2: position out of range/order).
int64_t dcr_gaps_encode(const void* pos, int pos64, int64_t count, int64_t lo, int64_t hi,
                        int mode, uint8_t* out, int64_t cap) {
  int64_t prev = lo - 1;
  if (mode == 0) {
    int64_t k = 0;
    for (int64_t i = 0; i < count; ++i) {
      int64_t p = pos64 ? posat<int64_t>(pos, i) : posat<int32_t>(pos, i);
      if (p <= prev || p >= hi) return -2;
      int64_t g = p - prev - 1;
      prev = p;
      int64_t reps = g / 255;
      if (k + reps + 1 > cap) return -1;
      if (reps) {
        std::memset(out + k, 255, reps);
        k += reps;
      }
      out[k++] = static_cast<uint8_t>(g - reps * 255);
    }
    return k;
  }
  if (mode == 1) {
    int64_t m = 0;
    for (int64_t i = 0; i < count; ++i) {
      int64_t p = pos64 ? posat<int64_t>(pos, i) : posat<int32_t>(pos, i);
      if (p <= prev || p >= hi) return -2;
      m += (p - prev - 1) / 65535 + 1;
      prev = p;
    }
    if (2 * m > cap) return -1;
    prev = lo - 1;
    int64_t k = 0;
    for (int64_t i = 0; i < count; ++i) {
      int64_t p = pos64 ? posat<int64_t>(pos, i) : posat<int32_t>(pos, i);
      int64_t g = p - prev - 1;
      prev = p;
      while (g >= 65535) {
        out[k] = 255;
        out[m + k] = 255;
        ++k;
        g -= 65535;
      }
      out[k] = static_cast<uint8_t>(g & 255);
      out[m + k] = static_cast<uint8_t>(g >> 8);
      ++k;
    }
    return 2 * m;
  }
  return -9;
}

// Inverse of dcr_gaps_encode, validating everything: exactly `count` positions, every one
// in [lo, hi), the stream consumed exactly. Returns 0, or < 0 (-1: stream ends early,
// -2: position out of range, -3: trailing bytes).
int64_t dcr_gaps_decode(const uint8_t* in, int64_t len, int mode, int64_t count, int64_t lo,
                        int64_t hi, void* pos_out, int pos64) {
  if (mode == 0) {
    return pos64 ? gaps8_decode(in, len, count, lo, hi, static_cast<int64_t*>(pos_out))
                 : gaps8_decode(in, len, count, lo, hi, static_cast<int32_t*>(pos_out));
  }
  if (mode == 1) {
    return pos64 ? gaps16_decode(in, len, count, lo, hi, static_cast<int64_t*>(pos_out))
                 : gaps16_decode(in, len, count, lo, hi, static_cast<int32_t*>(pos_out));
  }
  return -9;
}

}  // extern "C"

// ---------------------------------------------------------------- additive digest
// sum over elements of mix(p * K ^ v) mod 2^64 (v: the element's bits, p: its position, either
// base + i or pos[i]). Additive, so per-rank slices sum to the tensor's digest and a version's
// digest updates from its changes alone (docs/PROTOCOL.md).
static inline uint64_t dcr_mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// One element's digest term: position p holding bits v.
static inline uint64_t dcr_term(uint64_t p, uint64_t v) { return dcr_mix64((p * 0xD6E8FEB86659FD93ull) ^ v); }

// Sum over threads of f(lo, hi) on an even split of [0, n).
template <class F>
static uint64_t parallel_sum(int nthreads, int64_t n, F&& f) {
  std::vector<uint64_t> part(std::max(nthreads, 1), 0);
  parallel_for(nthreads, [&](int t) { part[t] = f(n * t / nthreads, n * (t + 1) / nthreads); });
  uint64_t acc = 0;
  for (uint64_t x : part) acc += x;
  return acc;
}

template <class T>
static uint64_t sum64_t(const T* v, const int64_t* pos, int64_t base, int64_t lo, int64_t hi) {
  uint64_t acc = 0;
  for (int64_t i = lo; i < hi; ++i) {
    acc += dcr_term(pos ? static_cast<uint64_t>(pos[i]) : static_cast<uint64_t>(base + i), v[i]);
  }
  return acc;
}

extern "C" uint64_t dcr_sum64(const void* vals, int width, const int64_t* pos, int64_t base, int64_t n,
                              int nthreads) {
  if (n < (1 << 20)) nthreads = 1;
  return parallel_sum(nthreads, n, [&](int64_t lo, int64_t hi) {
    switch (width) {
      case 1: return sum64_t(static_cast<const uint8_t*>(vals), pos, base, lo, hi);
      case 2: return sum64_t(static_cast<const uint16_t*>(vals), pos, base, lo, hi);
      case 4: return sum64_t(static_cast<const uint32_t*>(vals), pos, base, lo, hi);
      default: return sum64_t(static_cast<const uint64_t*>(vals), pos, base, lo, hi);
    }
  });
}

// The digest terms of a tensor's elements at the given positions, read in place (a receiver
// checks its own weights around an apply without gathering them first).
template <class T, class I>
static uint64_t sum64_at_t(const T* t, const I* pos, int64_t lo, int64_t hi) {
  uint64_t acc = 0;
  for (int64_t i = lo; i < hi; ++i) acc += dcr_term(static_cast<uint64_t>(pos[i]), t[pos[i]]);
  return acc;
}

template <class I>
static uint64_t sum64_at_w(const void* t, int width, const I* pos, int64_t lo, int64_t hi) {
  switch (width) {
    case 1: return sum64_at_t(static_cast<const uint8_t*>(t), pos, lo, hi);
    case 2: return sum64_at_t(static_cast<const uint16_t*>(t), pos, lo, hi);
    case 4: return sum64_at_t(static_cast<const uint32_t*>(t), pos, lo, hi);
    default: return sum64_at_t(static_cast<const uint64_t*>(t), pos, lo, hi);
  }
}

extern "C" uint64_t dcr_sum64_at(const void* t, int width, const void* pos, int pos64, int64_t count,
                                 int nthreads) {
  if (count < (1 << 18)) nthreads = 1;
  return parallel_sum(nthreads, count, [&](int64_t lo, int64_t hi) {
    return pos64 ? sum64_at_w(t, width, static_cast<const int64_t*>(pos), lo, hi)
                 : sum64_at_w(t, width, static_cast<const int32_t*>(pos), lo, hi);
  });
}

// The receiver's apply with its digest check fused in: one pass that reads each target
// element, accumulates its digest term before and after the write, and writes it.
template <class T, class I>
static void apply_values_dig(T* target, const I* pos, const T* vals, int64_t count, int op, uint64_t* sums) {
  constexpr int64_t kAhead = kScatterAhead;
  uint64_t before = 0, after = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (i + kAhead < count) __builtin_prefetch(target + pos[i + kAhead], 1);
    const uint64_t p = static_cast<uint64_t>(pos[i]);
    T& t = target[pos[i]];
    before += dcr_term(p, t);
    if (op == 0) t ^= vals[i];
    else if (op == 1) t = vals[i];
    else t = funkey<T>(static_cast<T>(fkey<T>(t) + unzigzag<T>(vals[i])));
    after += dcr_term(p, t);
  }
  sums[0] += before;
  sums[1] += after;
}

extern "C" int64_t dcr_scatter_digest(void* target, int64_t n, int width, const void* pos, int pos64,
                                      const void* vals, int64_t count, int op, uint64_t* sums) {
  int rc = pos64 ? check_positions(static_cast<const int64_t*>(pos), count, n)
                 : check_positions(static_cast<const int32_t*>(pos), count, n);
  if (rc) return rc;
  if (op == 2 && width == 1) return -9;
  if (pos64) {
    DISPATCH_WIDTH(width, apply_values_dig<T, int64_t>(static_cast<T*>(target), static_cast<const int64_t*>(pos),
                                                        static_cast<const T*>(vals), count, op, sums));
  } else {
    DISPATCH_WIDTH(width, apply_values_dig<T, int32_t>(static_cast<T*>(target), static_cast<const int32_t*>(pos),
                                                        static_cast<const T*>(vals), count, op, sums));
  }
  return 0;
}

// ---------------------------------------------------------------- fused XOR-chunk encoder
// codec.encode_chunk's per-change work for an XOR chunk of float values, in two passes over
// the changes instead of one call (and one pass) per stream: (1) the GAP8 stream, the token
// histograms of both value codings, the ulp coding's tokens and escapes and the digest terms
// of the changed elements (old = new ^ xor); (2) rANS of the chosen coding's tokens. The
// bytes are those of gaps_encode + tokens + ans_encode; the choice is the codec's (ulp only
// if its estimate is strictly smaller). Zstd of the gap and escape streams stays with the
// caller.
static double entropy_bits(const uint64_t* h) {
  double n = 0, acc = 0;
  for (int s = 0; s < 256; ++s) n += static_cast<double>(h[s]);
  if (n == 0) return 0;
  for (int s = 0; s < 256; ++s)
    if (h[s]) acc -= static_cast<double>(h[s]) * std::log2(static_cast<double>(h[s]) / n);
  return acc;
}

// One change's GAP8 bytes after prev (255 = "add 255 and go on"). 0, or -2 (not after prev
// or not below hi) / -1 (no room in gaps).
static inline int64_t gap8_put(int64_t p, int64_t& prev, int64_t hi, uint8_t* gaps, int64_t gaps_cap, int64_t& k) {
  if (p <= prev || p >= hi) return -2;
  const int64_t g = p - prev - 1;
  const int64_t reps = g / 255;
  if (k + reps + 1 > gaps_cap) return -1;
  if (reps) {
    std::memset(gaps + k, 255, reps);
    k += reps;
  }
  gaps[k++] = static_cast<uint8_t>(g - reps * 255);
  prev = p;
  return 0;
}

#if defined(__x86_64__)
// encode_xor_t's first pass for 16-bit floats, 16 changes per step (AVX-512): the GAP8 bytes
// of a block whose gaps are all < 255 in one store, the ulp coding (fkey, difference,
// zig-zag) and both codings' tokens in vector registers, escapes by compress-store. The
// histogram counts stay scalar. A block with a long gap (or bad positions, or no room)
// takes the scalar gap code, which makes the same bytes and the same errors. Returns the
// changes done (a multiple of 16), or < 0 as encode_xor_t.
template <class I>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt")))
static int64_t encode_xor_avx512(const I* pos, const uint16_t* v, const uint16_t* nv, int64_t count, int64_t hi,
                                 int gap8, uint8_t* gaps, int64_t gaps_cap, int64_t& k, int64_t& prev,
                                 uint32_t (&part)[2][4][256], uint8_t* tok, uint16_t* esc, int64_t& ne) {
  const __m256i sign = _mm256_set1_epi16(static_cast<int16_t>(0x8000));
  const __m256i c255 = _mm256_set1_epi16(255);
  alignas(16) uint8_t rt[16];
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    if (gap8) {
      bool fast = k + 16 <= gaps_cap && static_cast<int64_t>(pos[i + 15]) < hi;
      if (fast) {
        if constexpr (sizeof(I) == 4) {
          const __m512i p = _mm512_loadu_si512(pos + i);
          const __m512i sh = _mm512_alignr_epi32(p, _mm512_set1_epi32(static_cast<int32_t>(prev)), 15);
          const __m512i g = _mm512_sub_epi32(_mm512_sub_epi32(p, sh), _mm512_set1_epi32(1));
          fast = _mm512_cmplt_epu32_mask(g, _mm512_set1_epi32(255)) == 0xFFFF;
          if (fast) _mm_storeu_si128(reinterpret_cast<__m128i*>(gaps + k), _mm512_cvtepi32_epi8(g));
        } else {
          const __m512i p0 = _mm512_loadu_si512(pos + i), p1 = _mm512_loadu_si512(pos + i + 8);
          const __m512i one = _mm512_set1_epi64(1), lim = _mm512_set1_epi64(255);
          const __m512i g0 = _mm512_sub_epi64(_mm512_sub_epi64(p0, _mm512_alignr_epi64(p0, _mm512_set1_epi64(prev), 7)), one);
          const __m512i g1 = _mm512_sub_epi64(_mm512_sub_epi64(p1, _mm512_alignr_epi64(p1, p0, 7)), one);
          fast = _mm512_cmplt_epu64_mask(g0, lim) == 0xFF && _mm512_cmplt_epu64_mask(g1, lim) == 0xFF;
          if (fast) {
            _mm_storel_epi64(reinterpret_cast<__m128i*>(gaps + k), _mm512_cvtepi64_epi8(g0));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(gaps + k + 8), _mm512_cvtepi64_epi8(g1));
          }
        }
        if (fast) {
          k += 16;
          prev = static_cast<int64_t>(pos[i + 15]);
        }
      }
      if (!fast) {
        for (int64_t j = i; j < i + 16; ++j)
          if (const int64_t rc = gap8_put(static_cast<int64_t>(pos[j]), prev, hi, gaps, gaps_cap, k)) return rc;
      }
    }
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nv + i));
    const __m256i old = _mm256_xor_si256(x, b);
    const __m256i kb = _mm256_xor_si256(b, _mm256_or_si256(_mm256_srai_epi16(b, 15), sign));
    const __m256i ko = _mm256_xor_si256(old, _mm256_or_si256(_mm256_srai_epi16(old, 15), sign));
    const __m256i d = _mm256_sub_epi16(kb, ko);
    const __m256i z = _mm256_xor_si256(_mm256_slli_epi16(d, 1), _mm256_srai_epi16(d, 15));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(tok + i), _mm256_cvtepi16_epi8(_mm256_min_epu16(z, c255)));
    _mm_store_si128(reinterpret_cast<__m128i*>(rt), _mm256_cvtepi16_epi8(_mm256_min_epu16(x, c255)));
    const __mmask16 m = _mm256_cmpge_epu16_mask(z, c255);
    if (m) {
      _mm256_mask_compressstoreu_epi16(esc + ne, m, z);
      ne += __builtin_popcount(m);
    }
    const uint8_t* t = tok + i;
    for (int j = 0; j < 16; ++j) {
      part[0][j & 3][rt[j]]++;
      part[1][j & 3][t[j]]++;
    }
  }
  return i;
}
#endif

template <class T, class I>
static int64_t encode_xor_t(const I* pos, const T* v, const T* nv, int64_t count, int64_t lo, int64_t hi,
                            int gap8, uint8_t* gaps, int64_t gaps_cap, uint8_t* ans, int64_t ans_cap, T* esc,
                            int64_t* info, uint64_t* dig) {
  // Four striped copies of each histogram: the few common tokens (0, 1, 2) would otherwise
  // chain every increment through one counter's store-to-load latency.
  uint32_t part[2][4][256] = {{{0}}};
  int64_t k = 0, prev = lo - 1, ne = 0;
  std::vector<uint8_t> tokv(static_cast<size_t>(count));
  uint8_t* tok = tokv.data();
  uint64_t before = 0, after = 0;
  int64_t i0 = 0;
#if defined(__x86_64__)
  if constexpr (sizeof(T) == 2) {
    if (have_avx512() && !std::getenv("NEMO_DCR_NO_AVX512")) {
      i0 = encode_xor_avx512<I>(pos, reinterpret_cast<const uint16_t*>(v), reinterpret_cast<const uint16_t*>(nv),
                                count, hi, gap8, gaps, gaps_cap, k, prev, part, tok, reinterpret_cast<uint16_t*>(esc),
                                ne);
      if (i0 < 0) return i0;
    }
  }
#endif
  for (int64_t i = i0; i < count; ++i) {
    if (gap8)
      if (const int64_t rc = gap8_put(static_cast<int64_t>(pos[i]), prev, hi, gaps, gaps_cap, k)) return rc;
    const T x = v[i], b = nv[i];
    const T z = ulp_of<T>(x, b);
    part[0][i & 3][x >= T(255) ? 255 : x]++;
    part[1][i & 3][z >= T(255) ? 255 : z]++;
    tok[i] = static_cast<uint8_t>(z >= T(255) ? 255 : z);
    esc[ne] = z;
    ne += z >= T(255);
  }
  if (dig) {  // a loop of its own: the compiler vectorizes its multiplies (8 lanes with AVX-512)
    for (int64_t i = 0; i < count; ++i) {
      const uint64_t pk = static_cast<uint64_t>(static_cast<int64_t>(pos[i])) * 0xD6E8FEB86659FD93ull;
      before += dcr_mix64(pk ^ static_cast<T>(nv[i] ^ v[i]));
      after += dcr_mix64(pk ^ nv[i]);
    }
    dig[0] += before;
    dig[1] += after;
  }
  uint64_t hist[2][256];
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 256; ++s)
      hist[h][s] = uint64_t(part[h][0][s]) + part[h][1][s] + part[h][2][s] + part[h][3][s];
  const double w = sizeof(T);
  const double est_raw = entropy_bits(hist[0]) / 8 + static_cast<double>(hist[0][255]) * w;
  const double est_ulp = entropy_bits(hist[1]) / 8 + static_cast<double>(hist[1][255]) * w;
  const int ulp = est_ulp < est_raw;
  info[0] = k;
  info[3] = ulp;
  info[2] = static_cast<int64_t>(hist[ulp][255]);
  if (hist[ulp][255] * 16 > static_cast<uint64_t>(std::max<int64_t>(count, 1))) return -10;  // planes may win
  if (!ulp) {  // the raw coding's tokens and escapes (rare for float deltas: their XORs are mostly small)
    ne = 0;
    for (int64_t i = 0; i < count; ++i) {
      tok[i] = static_cast<uint8_t>(v[i] >= T(255) ? 255 : v[i]);
      esc[ne] = v[i];
      ne += v[i] >= T(255);
    }
  }
  const int64_t n = ans_encode_with(hist[ulp], count, [tok](int64_t i) { return tok[i]; }, ans, ans_cap);
  if (n < 0) return -1;
  info[1] = n;
  return 0;
}

// pos: sorted positions in [lo, hi) (int32 or int64); vals: XOR values; newv: the new values
// (width 2, 4 or 8). gap8 != 0 writes the GAP8 stream into gaps (else positions are only
// read, for the digest). ans (cap >= dcr_ans_bound(count)) gets the token stream, esc
// (room for count values) the escapes. info: [gap bytes, rANS bytes, escapes, ulp?].
// dig (optional): [sum of the changed elements' old terms, sum of their new terms] added to.
// Returns 0; -10 when escapes are many (info and dig are filled; the caller encodes the
// values another way); < 0 on bad input (-2 positions, -1 capacity, -9 width).
extern "C" int64_t dcr_encode_xor(const void* pos, int pos64, const void* vals, const void* newv, int64_t count,
                                  int width, int64_t lo, int64_t hi, int gap8, uint8_t* gaps, int64_t gaps_cap,
                                  uint8_t* ans, int64_t ans_cap, void* esc, int64_t* info, uint64_t* dig) {
  if (width == 1 || !newv) return -9;
  if (pos64) {
    DISPATCH_WIDTH(width, return encode_xor_t<T, int64_t>(static_cast<const int64_t*>(pos), static_cast<const T*>(vals),
                                                          static_cast<const T*>(newv), count, lo, hi, gap8, gaps,
                                                          gaps_cap, ans, ans_cap, static_cast<T*>(esc), info, dig));
  } else {
    DISPATCH_WIDTH(width, return encode_xor_t<T, int32_t>(static_cast<const int32_t*>(pos), static_cast<const T*>(vals),
                                                          static_cast<const T*>(newv), count, lo, hi, gap8, gaps,
                                                          gaps_cap, ans, ans_cap, static_cast<T*>(esc), info, dig));
  }
}

// ---------------------------------------------------------------- placement
// One segment of a placement's affine map over sorted positions p = pos[i] + add:
// out[i] = offset + ((p - start) / row_len) * stride + (p - start) % row_len. Positions are
// sorted, so the row is tracked incrementally (no division); row_len == stride is a shift.
// Returns 0, or -2 if a position lies before start (the caller passes the segment's slice).
template <class I>
static int64_t affine_t(const I* pos, int64_t count, int64_t add, int64_t start, int64_t row_len, int64_t stride,
                        int64_t offset, int64_t* out) {
  if (count == 0) return 0;
  if (static_cast<int64_t>(pos[0]) + add < start) return -2;
  if (row_len == stride) {
    const int64_t shift = offset + add - start;
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int64_t>(pos[i]) + shift;
    return 0;
  }
  const int64_t first = static_cast<int64_t>(pos[0]) + add - start;
  int64_t row_lo = (first / row_len) * row_len;  // local offset of the current row's start
  int64_t canon = offset + (first / row_len) * stride;  // its canonical start
  for (int64_t i = 0; i < count; ++i) {
    const int64_t p = static_cast<int64_t>(pos[i]) + add - start;
    if (p - row_lo >= row_len) {
      const int64_t rows = (p - row_lo) / row_len;
      row_lo += rows * row_len;
      canon += rows * stride;
    }
    out[i] = canon + (p - row_lo);
  }
  return 0;
}

extern "C" int64_t dcr_affine(const void* pos, int pos64, int64_t count, int64_t add, int64_t start, int64_t row_len,
                              int64_t stride, int64_t offset, int64_t* out) {
  if (row_len <= 0) return -9;
  return pos64 ? affine_t(static_cast<const int64_t*>(pos), count, add, start, row_len, stride, offset, out)
               : affine_t(static_cast<const int32_t*>(pos), count, add, start, row_len, stride, offset, out);
}

// ---------------------------------------------------------------- a slice's chunks in one call
// The worker's hot path for one parameter slice's XOR delta (16/32/64-bit floats): the
// placement's affine maps (per canonical tensor, its segments in order: sorted canonical
// positions, values gathered alongside), the chunk ranges of `span` positions, and per chunk
// the fused encoder (dcr_encode_xor) into shared output buffers. The same chunks, streams and
// digest terms as Placement.project + codec.encode_sparse, without Python per segment and
// chunk. seg: nseg rows of (local_start, length, row_len, canon_id, canon_offset,
// canon_stride); canon_numel: per canon_id. rec: per chunk kRecFields int64 (below).
// Returns the chunk count; -11 where a chunk needs the generic coding (mean gap >= 512 or
// many escapes: the caller encodes the slice the generic way), -1 when a buffer is short
// (likewise), -2 on positions out of order or outside the segments.
namespace {
constexpr int kRecFields = 13;  // canon_id, lo, hi, count, ulp, gap off, gap len, ans off, ans len,
                                // esc off (elements), escapes, digest old, digest new

template <class T, class I>
int64_t encode_slice_t(const I* pos, int64_t count, int64_t add, const T* xv, const T* nv, int64_t nseg,
                       const int64_t* seg, int64_t ncanon, const int64_t* canon_numel, int64_t span, int64_t* spos,
                       T* sxor, T* snew, int64_t scap, uint8_t* gaps, int64_t gaps_cap, uint8_t* ans, int64_t ans_cap,
                       T* esc, int64_t esc_cap, int64_t* rec, int64_t rec_cap) {
  if (span <= 0) return -9;
  std::vector<int64_t> a(nseg), b(nseg);
  const auto first_at = [pos, count](int64_t v) {  // the first position >= v
    return std::lower_bound(pos, pos + count, v, [](I p, int64_t x) { return static_cast<int64_t>(p) < x; }) - pos;
  };
  for (int64_t s = 0; s < nseg; ++s) {  // this slice's positions in each segment (positions + add)
    a[s] = first_at(seg[6 * s] - add);
    b[s] = first_at(seg[6 * s] + seg[6 * s + 1] - add);
  }
  std::vector<char> done(static_cast<size_t>(ncanon), 0);
  int64_t nrec = 0, goff = 0, aoff = 0, eoff = 0;
  for (int64_t s0 = 0; s0 < nseg; ++s0) {  // canonical tensors in order of their first segment
    const int64_t cid = seg[6 * s0 + 3];
    if (a[s0] == b[s0] || done[cid]) continue;
    if (cid < 0 || cid >= ncanon) return -2;
    done[cid] = 1;
    int64_t n = 0;
    for (int64_t s = s0; s < nseg; ++s) {
      if (seg[6 * s + 3] != cid || a[s] == b[s]) continue;
      const int64_t m = b[s] - a[s];
      if (n + m > scap) return -1;
      if (affine_t(pos + a[s], m, add, seg[6 * s], seg[6 * s + 2], seg[6 * s + 5], seg[6 * s + 4], spos + n)) return -2;
      std::memcpy(sxor + n, xv + a[s], m * sizeof(T));
      std::memcpy(snew + n, nv + a[s], m * sizeof(T));
      n += m;
    }
    const int64_t numel = canon_numel[cid];
    int64_t start = 0;
    for (int64_t lo = 0; lo < numel && start < n; lo += span) {
      const int64_t hi = std::min(numel, lo + span);
      const int64_t end = hi >= numel ? n : std::lower_bound(spos + start, spos + n, hi) - spos;
      const int64_t c = end - start;
      if (c == 0) continue;
      if (hi - lo >= 512 * c) return -11;  // codec.encode_chunk: GAP8 alone only below a mean gap of 512
      if (nrec >= rec_cap || eoff + c > esc_cap) return -1;
      int64_t info[4] = {0, 0, 0, 0};
      uint64_t dig[2] = {0, 0};
      const int64_t rc = encode_xor_t<T, int64_t>(spos + start, sxor + start, snew + start, c, lo, hi, 1, gaps + goff,
                                                  gaps_cap - goff, ans + aoff, ans_cap - aoff, esc + eoff, info, dig);
      if (rc == -10) return -11;
      if (rc < 0) return rc;
      int64_t* r = rec + kRecFields * nrec++;
      r[0] = cid, r[1] = lo, r[2] = hi, r[3] = c, r[4] = info[3];
      r[5] = goff, r[6] = info[0], r[7] = aoff, r[8] = info[1], r[9] = eoff, r[10] = info[2];
      r[11] = static_cast<int64_t>(dig[0]), r[12] = static_cast<int64_t>(dig[1]);
      goff += info[0], aoff += info[1], eoff += info[2];
      start = end;
    }
    if (start != n) return -2;  // canonical positions beyond the tensor
  }
  return nrec;
}
}  // namespace

extern "C" int64_t dcr_encode_slice(const void* pos, int pos64, int64_t count, int64_t add, const void* xv,
                                    const void* nv, int width, int64_t nseg, const int64_t* seg, int64_t ncanon,
                                    const int64_t* canon_numel, int64_t span, int64_t* spos, void* sxor, void* snew,
                                    int64_t scap, uint8_t* gaps, int64_t gaps_cap, uint8_t* ans, int64_t ans_cap,
                                    void* esc, int64_t esc_cap, int64_t* rec, int64_t rec_cap) {
  if (width == 1) return -9;
  if (pos64) {
    DISPATCH_WIDTH(width, return encode_slice_t<T, int64_t>(
        static_cast<const int64_t*>(pos), count, add, static_cast<const T*>(xv), static_cast<const T*>(nv), nseg, seg,
        ncanon, canon_numel, span, spos, static_cast<T*>(sxor), static_cast<T*>(snew), scap, gaps, gaps_cap, ans,
        ans_cap, static_cast<T*>(esc), esc_cap, rec, rec_cap));
  } else {
    DISPATCH_WIDTH(width, return encode_slice_t<T, int32_t>(
        static_cast<const int32_t*>(pos), count, add, static_cast<const T*>(xv), static_cast<const T*>(nv), nseg, seg,
        ncanon, canon_numel, span, spos, static_cast<T*>(sxor), static_cast<T*>(snew), scap, gaps, gaps_cap, ans,
        ans_cap, static_cast<T*>(esc), esc_cap, rec, rec_cap));
  }
  return -9;
}

// ---------------------------------------------------------------- fused context encoder
// codec/encode.py _ctx_streams in one call: the sampled exponent counts, the class choice
// (codec/context.py choose_classes: the same cuts, candidates and estimate), the walk for
// each change's rank in its old class, a counting sort by class, and per class its GAP8
// stream and both rANS streams. The numpy version spent most of its time in per-chunk
// array work around the walk, not in it (docs/PERFORMANCE.md). Zstd of the class map, of
// the escapes and of a gap stream that rANS does not shrink stays with the caller.
namespace {

constexpr int kCtxCandidates[] = {1, 2, 3, 4, 6, 8, 12, 16};
// A class's tables, as the estimate counts them (context.py CLASS_BYTES, FREQ_BYTES): its two
// streams' fixed parts and its token frequencies. Measured, not derived: these values gave
// the smallest versions of the refit benchmark's policy at 1% and 3% (docs/PERFORMANCE.md).
// More than 8 classes leave the decoder's walk that counts every class at once, so they are
// chosen only where they save kWideGain of the best estimate with at most 8 (context.py WIDE_GAIN).
constexpr double kClassBytes = 80, kFreqBytes = 1.1;
constexpr double kWideGain = 0.03;
constexpr int kNCand = 8;

// -sum h log2(h / total) over a histogram's nonzero bins, in bits (context.py _rows_bits).
template <class H>
static double hist_bits(const H* h, int m) {
  double tot = 0, acc = 0;
  for (int s = 0; s < m; ++s) tot += static_cast<double>(h[s]);
  if (tot <= 0) return 0;
  for (int s = 0; s < m; ++s)
    if (h[s] > 0) acc += static_cast<double>(h[s]) * std::log2(static_cast<double>(h[s]) / tot);
  return -acc;
}

// x log2 x for the small counts of a token histogram: the class choice weighs 8 candidates of
// up to 16 classes of 256 tokens per chunk, and a log2 per bin was most of its time.
constexpr int kXlogN = 4096;
static const double* xlog2x_table() {
  static const std::vector<double> t = [] {
    std::vector<double> v(kXlogN, 0.0);
    for (int x = 1; x < kXlogN; ++x) v[x] = x * std::log2(static_cast<double>(x));
    return v;
  }();
  return t.data();
}

// hist_bits of integer token counts: tot log2 tot - sum h log2 h.
static double token_bits(const uint32_t* h, const double* xl, int& nz) {
  uint64_t tot = 0;
  double acc = 0;
  nz = 0;
  for (int s = 0; s < 256; ++s) {
    const uint32_t x = h[s];
    tot += x;
    nz += x != 0;
    acc += x < kXlogN ? xl[x] : x * std::log2(static_cast<double>(x));
  }
  return tot ? static_cast<double>(tot) * std::log2(static_cast<double>(tot)) - acc : 0.0;
}

// choose_classes: n per exponent (estimated), c changes per exponent, th token histograms of
// the exponents that changed (row[e] >= 0 names th's row). Writes each exponent's class.
static void ctx_choose(const double* n_in, const int64_t* c, const uint32_t* th, const int* row, int size,
                       uint8_t* out, double& est, double& one) {
  int present[256], np_ = 0;
  double logit[256], n[256];
  for (int e = 0; e < size; ++e) {
    n[e] = std::max(n_in[e], static_cast<double>(c[e]));
    out[e] = 0;
    if (n[e] > 0) present[np_++] = e;
  }
  est = one = 0;
  if (!np_) return;
  double lo = 0, hi = 0;
  for (int i = 0; i < np_; ++i) {
    const int e = present[i];
    logit[i] = std::log2((c[e] + 0.5) / (n[e] - c[e] + 0.5));
    if (i == 0 || logit[i] < lo) lo = logit[i];
    if (i == 0 || logit[i] > hi) hi = logit[i];
  }
  double best_cost = 0, narrow_cost = 0;
  int best = -1, best_k = 0, narrow = -1;
  uint8_t cls[kNCand][256];
  const double* xl = xlog2x_table();
  for (int ci = 0; ci < kNCand; ++ci) {
    const int kc = kCtxCandidates[ci];
    int raw[256];
    bool used[16] = {false};
    for (int i = 0; i < np_; ++i) {
      raw[i] = hi - lo < 1e-9 ? 0 : std::min(static_cast<int>((logit[i] - lo) / (hi - lo) * kc), kc - 1);
      used[raw[i]] = true;
    }
    int dense[16], kk = 0;
    for (int j = 0; j < 16; ++j) dense[j] = used[j] ? kk++ : -1;
    double nk[16] = {0}, ck[16] = {0};
    alignas(64) uint32_t tk[16][256];
    std::memset(tk, 0, sizeof(uint32_t) * 256 * kk);
    for (int i = 0; i < np_; ++i) {
      const int e = present[i], j = dense[raw[i]];
      cls[ci][i] = static_cast<uint8_t>(j);
      nk[j] += n[e];
      ck[j] += static_cast<double>(c[e]);
      if (row[e] >= 0) {
        const uint32_t* t = th + 256 * static_cast<int64_t>(row[e]);
        for (int s = 0; s < 256; ++s) tk[j][s] += t[s];
      }
    }
    double cost = 0;
    for (int j = 0; j < kk; ++j) {
      const double pc[2] = {ck[j], nk[j] - ck[j]};
      int nz = 0;
      const double tb = token_bits(tk[j], xl, nz);
      cost += hist_bits(pc, 2) + tb + 8.0 * (kClassBytes + kFreqBytes * nz);
    }
    if (ci == 0) one = cost;
    if (best < 0 || cost < best_cost) {
      best_cost = cost;
      best = ci;
      best_k = kk;
    }
    if (kk <= 8 && (narrow < 0 || cost < narrow_cost)) {
      narrow_cost = cost;
      narrow = ci;
    }
  }
  if (best_k > 8 && best_cost > (1 - kWideGain) * narrow_cost) {
    best = narrow;
    best_cost = narrow_cost;
  }
  est = best_cost;
  for (int i = 0; i < np_; ++i) out[present[i]] = cls[best][i];
}

template <class T, class I>
static void ctx_exps(const I* pos, const T* vals, const T* newv, int64_t count, int64_t lo, int shift, uint32_t mask,
                     int64_t* rel, uint8_t* e_old, uint8_t* e_new) {
  for (int64_t j = 0; j < count; ++j) {
    rel[j] = static_cast<int64_t>(pos[j]) - lo;
    e_old[j] = static_cast<uint8_t>((static_cast<uint32_t>(newv[j] ^ vals[j]) >> shift) & mask);
    e_new[j] = static_cast<uint8_t>((static_cast<uint32_t>(newv[j]) >> shift) & mask);
  }
}

}  // namespace

// The context coding of one XOR chunk's changes. cur: the range's n bits, the old ones
// (is_old) or the current ones (old except at the changes, where old = new ^ xor); pos:
// the changes' absolute positions in [lo, lo + n), increasing; tok: their value tokens.
// Builds the streams only where the estimate is at most min_gain x one class's. Writes
// cls_map (2^nbits), est[0..1] (the estimate, one class's), and into out per class its GAP8
// bytes, their rANS coding (where smaller), its token stream; meta[0] = classes, then per
// class 4 values: GAP8 bytes, rANS bytes (0: none), tokens, token bytes stored (rANS-coded
// where smaller than the tokens, else the tokens). The caller weighs the gaps' rANS against
// zstd: rANS's table costs more than zstd's on a short stream. Returns 0 (coded), 1 (not
// worth it), -1 (positions out of order or outside the range, or bits that disagree with
// the new values), -2 (no room in out), -100 (bad arguments).
extern "C" int64_t dcr_ctx_encode(const void* cur, int64_t n, int width, int shift, int nbits, int is_old,
                                  const void* pos, int pos64, int64_t count, int64_t lo, const void* vals,
                                  const void* newv, const uint8_t* tok, double min_gain, int64_t block,
                                  int64_t every, uint8_t* cls_map, double* est, uint8_t* out, int64_t cap,
                                  int64_t* meta) {
  if ((width != 2 && width != 4) || nbits < 1 || nbits > 8 || count < 1 || n < 1) return -100;
  const int size = 1 << nbits;
  const uint32_t mask = static_cast<uint32_t>(size - 1);
  // per-thread scratch, reached through plain pointers: a thread_local in a shared library
  // costs a __tls_get_addr call per use, and the loops below run once per change
  thread_local std::vector<int64_t> rel_v, ranks_v, sranks_v;
  thread_local std::vector<uint8_t> bytes_v, gbuf_v;
  thread_local std::vector<uint32_t> th_v;
  // rel, cold and cnew with 4 sentinel entries past count, ranks with room for them (the walk's)
  rel_v.resize(count + 4);
  ranks_v.resize(count + 4);
  sranks_v.resize(count);
  bytes_v.resize(5 * count + 8);
  int64_t* const rel = rel_v.data();
  int64_t* const ranks = ranks_v.data();
  int64_t* const sranks = sranks_v.data();
  uint8_t* const e_old = bytes_v.data();
  uint8_t* const e_new = e_old + count;
  uint8_t* const cold = e_new + count;
  uint8_t* const cnew = cold + count + 4;
  uint8_t* const stok = cnew + count + 4;
  for (int t = 0; t < 4; ++t) rel[count + t] = n, cold[count + t] = 0, cnew[count + t] = 0;
  auto exps = [&](const auto* v, const auto* nv) {
    if (pos64) {
      ctx_exps(static_cast<const int64_t*>(pos), v, nv, count, lo, shift, mask, rel, e_old, e_new);
    } else {
      ctx_exps(static_cast<const int32_t*>(pos), v, nv, count, lo, shift, mask, rel, e_old, e_new);
    }
  };
  if (width == 2) {
    exps(static_cast<const uint16_t*>(vals), static_cast<const uint16_t*>(newv));
  } else {
    exps(static_cast<const uint32_t*>(vals), static_cast<const uint32_t*>(newv));
  }
  // Positions per exponent (from a sample of the walked bits, moved to the old bits' counts
  // where those are the current ones), changes per exponent, and token histograms.
  int64_t hist[256] = {0}, c[256] = {0}, c_new[256] = {0};
  const int64_t seen = dcr_exp_hist(cur, n, width, shift, nbits, block, every, hist);
  if (seen < 0) return -100;
  int row[256], rows = 0;
  for (int e = 0; e < size; ++e) row[e] = -1;
  // The histograms below count into two banks (even and odd changes), summed after: most
  // changes share a few exponents and tokens, and one bank makes each increment wait on the last.
  {
    int64_t c2[256] = {0}, cn2[256] = {0};
    int64_t j = 0;
    for (; j + 1 < count; j += 2) {
      ++c[e_old[j]];
      ++c_new[e_new[j]];
      ++c2[e_old[j + 1]];
      ++cn2[e_new[j + 1]];
    }
    for (; j < count; ++j) {
      ++c[e_old[j]];
      ++c_new[e_new[j]];
    }
    for (int e = 0; e < 256; ++e) c[e] += c2[e], c_new[e] += cn2[e];
  }
  for (int e = 0; e < size; ++e)
    if (c[e]) row[e] = rows++;
  th_v.assign(static_cast<size_t>(rows) * 512, 0);
  uint32_t* const th = th_v.data();
  {
    uint32_t* const th2 = th + static_cast<int64_t>(rows) * 256;
    int64_t j = 0;
    for (; j + 1 < count; j += 2) {
      ++th[256 * static_cast<int64_t>(row[e_old[j]]) + tok[j]];
      ++th2[256 * static_cast<int64_t>(row[e_old[j + 1]]) + tok[j + 1]];
    }
    for (; j < count; ++j) ++th[256 * static_cast<int64_t>(row[e_old[j]]) + tok[j]];
    for (int64_t i = 0; i < static_cast<int64_t>(rows) * 256; ++i) th[i] += th2[i];
  }
  double nest[256];
  const double scale = static_cast<double>(n) / static_cast<double>(std::max<int64_t>(seen, 1));
  for (int e = 0; e < size; ++e) {
    nest[e] = static_cast<double>(hist[e]) * scale;
    if (!is_old) nest[e] += static_cast<double>(c[e] - c_new[e]);
    nest[e] = std::max(nest[e], 0.0);
  }
  ctx_choose(nest, c, th, row, size, cls_map, est[0], est[1]);
  if (est[0] > min_gain * est[1]) return 1;
  int k = 1;
  for (int e = 0; e < size; ++e) k = std::max(k, cls_map[e] + 1);
  // each change's old and new class, and the classes' change counts (the sort's starts) in the
  // first half of the changes and in the second, counted side by side: most changes fall in a
  // few classes, and one count per class made each increment wait on the last (as the sort below)
  const int64_t half = count / 2;
  int64_t start[17] = {0}, first_half[17] = {0};
  auto classes = [&](int64_t j, int64_t* counts) {
    const uint8_t co = cls_map[e_old[j]];
    cold[j] = co;
    cnew[j] = is_old ? co : cls_map[e_new[j]];
    ++counts[co + 1];
  };
  for (int64_t j = 0; j < half; ++j) {
    classes(j, first_half);
    classes(j + half, start);
  }
  if (count & 1) classes(count - 1, start);
  for (int c = 1; c <= k; ++c) start[c] += first_half[c];
  int64_t pops[16] = {0};
  if (ctx_ranks_walk(cur, n, width, shift, nbits, cls_map, k, rel, cold, cnew, count, ranks, pops) != 0) return -1;
  // Counting sort by old class, each class in position order, with each class's token histogram:
  // the two halves of the changes side by side, each class's first-half changes placed before
  // its second-half ones (two chains of increments, and two histogram banks).
  for (int j = 0; j < k; ++j) start[j + 1] += start[j];
  int64_t at[2][16];
  for (int c = 0; c < 16; ++c) {
    at[0][c] = start[c];
    at[1][c] = start[c] + first_half[c + 1];
  }
  thread_local std::vector<uint64_t> tokh_v;
  tokh_v.assign(static_cast<size_t>(k) * 512, 0);
  uint64_t* const tokh = tokh_v.data();
  auto place = [&](int64_t j, int bank) {
    const int co = cold[j];
    const int64_t d = at[bank][co]++;
    sranks[d] = ranks[j];
    stok[d] = tok[j];
    ++tokh[256 * (2 * co + bank) + tok[j]];
  };
  for (int64_t j = 0; j < half; ++j) {
    place(j, 0);
    place(j + half, 1);
  }
  if (count & 1) place(count - 1, 1);
  for (int j = 0; j < k; ++j)  // bank 0 of class j ends up at 256 j, where the coder reads it
    for (int s = 0; s < 256; ++s) tokh[256 * j + s] = tokh[512 * j + s] + tokh[512 * j + 256 + s];
  meta[0] = k;
  int64_t o = 0;
  for (int j = 0; j < k; ++j) {
    const int64_t a = start[j], b = start[j + 1], m = b - a;
    // GAP8 of the class's ranks, written straight into out, with its histogram; a rank never
    // repeats or leaves [0, population)
    const int64_t room = m + pops[j] / 255 + 16;
    gbuf_v.resize(static_cast<size_t>(room));
    uint8_t* const gbuf = gbuf_v.data();
    uint64_t h[256] = {0}, h2[256] = {0};  // two banks, as above
    int64_t g = 0, prev = -1;
    for (int64_t i = a; i < b; ++i) {
      const int64_t p = sranks[i];
      if (p <= prev || p >= pops[j]) return -1;
      int64_t gap = p - prev - 1;
      prev = p;
      if (gap >= 255) {
        const int64_t reps = gap / 255;
        std::memset(gbuf + g, 255, reps);
        g += reps;
        h[255] += reps;
        gap -= reps * 255;
      }
      gbuf[g++] = static_cast<uint8_t>(gap);
      ++(i & 1 ? h2 : h)[gap];
    }
    for (int s = 0; s < 256; ++s) h[s] += h2[s];
    int64_t* mt = meta + 1 + 4 * j;
    if (cap - o < g) return -2;
    std::memcpy(out + o, gbuf, g);
    o += g;
    mt[0] = g;
    int64_t r = g ? ans_encode_with(h, g, [gbuf](int64_t i) { return gbuf[i]; }, out + o, cap - o) : -1;
    mt[1] = r >= 0 && r < g ? r : 0;
    o += mt[1];
    // the class's tokens, rANS-coded where smaller (encode.py _token_stream)
    mt[2] = m;
    const uint8_t* ts = stok + a;
    r = m ? ans_encode_with(tokh + 256 * j, m, [ts](int64_t i) { return ts[i]; }, out + o, cap - o) : -1;
    if (r >= 0 && r < m) {
      mt[3] = r;
    } else {
      if (cap - o < m) return -2;
      std::memcpy(out + o, ts, m);
      mt[3] = m;
    }
    o += mt[3];
  }
  return 0;
}

// ---------------------------------------------------------------- the decoder's bitmap walk
// Where changes are dense (a few per 64-element block), the rank walk above spends its time
// in branches it cannot predict: which classes have a rank in the block, and how many.
// Here each class's ranks are first set as bits of a bitmap over the class's positions;
// the walk then takes, for every class and every block, the class's next popcount bits and
// deposits them onto its lanes (pdep), and expands the class's next tokens onto those lanes:
// the same work in every block, no branch on the data. The emitted positions and their
// tokens leave the block compressed, in position order; the values follow from the tokens.
namespace {

#if defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512VBMI2__) && defined(__BMI2__)
constexpr bool kBitmapWalk = true;
// Changes per 64 positions from which the bitmap walk is the faster (between the 1% and 4% of
// the real pairs; docs/PERFORMANCE.md).
constexpr double kBitmapPer64 = 1.28;

struct BitmapWalk {
  int64_t off[16], js[16], woff[16], lim[16];  // bits taken, tokens taken, bitmap start, first zero word
  const uint64_t* bm;
  const uint8_t* toks;
  int64_t* pos_out;
  uint8_t* tok_out;  // 64 bytes of headroom past the total, as has pos_out
  int64_t t = 0;
};

template <class T>
static void bitmap_scalar(BitmapWalk& w, const T* v, int64_t lo, int64_t hi, int64_t base, int shift, uint32_t mask,
                          const uint8_t* cls_map) {
  for (int64_t i = lo; i < hi; ++i) {
    const int c = cls_map[(static_cast<uint32_t>(v[i]) >> shift) & mask];
    const int64_t o = w.off[c]++;
    const int64_t wi = std::min(w.woff[c] + (o >> 6), w.lim[c]);
    if ((w.bm[wi] >> (o & 63)) & 1) {
      w.pos_out[w.t] = base + i;
      w.tok_out[w.t++] = w.toks[w.js[c]++];
    }
  }
}

template <class T>
static int64_t bitmap_simd(BitmapWalk& w, int k, const T* v, int64_t n, int64_t base, int shift, int nbits,
                           const uint8_t* map256) {
  const __m512i t0 = _mm512_loadu_si512(map256), t1 = _mm512_loadu_si512(map256 + 64);
  const __m512i t2 = _mm512_loadu_si512(map256 + 128), t3 = _mm512_loadu_si512(map256 + 192);
  const uint32_t mask = (1u << nbits) - 1;
  alignas(64) uint8_t iota[64];
  for (int b = 0; b < 64; ++b) iota[b] = static_cast<uint8_t>(b);
  const __m512i lanes = _mm512_load_si512(iota);
  int64_t off[16], js[16], woff[16], lim[16];
  for (int c = 0; c < k; ++c) {
    off[c] = w.off[c];
    js[c] = w.js[c];
    woff[c] = w.woff[c];
    lim[c] = w.lim[c];
  }
  const uint64_t* __restrict bm = w.bm;
  const uint8_t* __restrict toks = w.toks;
  int64_t* __restrict pos_out = w.pos_out;
  uint8_t* __restrict tok_out = w.tok_out;
  int64_t t = w.t;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i cls = class_bytes(ctx_exps64(v + i, shift, mask), t0, t1, t2, t3, nbits);
    uint64_t emit = 0;
    __m512i tv = _mm512_setzero_si512();
    for (int c = 0; c < k; ++c) {
      const uint64_t m = _mm512_cmpeq_epi8_mask(cls, _mm512_set1_epi8(static_cast<char>(c)));
      const int64_t o = off[c];
      const int64_t wi = std::min(woff[c] + (o >> 6), lim[c]);  // past the last rank: zero words
      const unsigned __int128 two = (static_cast<unsigned __int128>(bm[wi + 1]) << 64) | bm[wi];
      const int pc = __builtin_popcountll(m);
      const uint64_t em = _pdep_u64(_bzhi_u64(static_cast<uint64_t>(two >> (o & 63)), pc), m);
      tv = _mm512_mask_expandloadu_epi8(tv, em, toks + js[c]);
      js[c] += __builtin_popcountll(em);
      off[c] = o + pc;
      emit |= em;
    }
    const int ne = __builtin_popcountll(emit);
    _mm512_storeu_si512(tok_out + t, _mm512_maskz_compress_epi8(emit, tv));
    alignas(64) uint8_t idx[64];
    _mm512_store_si512(idx, _mm512_maskz_compress_epi8(emit, lanes));
    const __m512i at = _mm512_set1_epi64(base + i);
    int g = 0;
    do {  // 8 positions per store; those past ne are overwritten by the next block's
      const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(idx + g));
      _mm512_storeu_si512(pos_out + t + g, _mm512_add_epi64(_mm512_cvtepu8_epi64(b8), at));
      g += 8;
    } while (g < ne);
    t += ne;
  }
  for (int c = 0; c < k; ++c) {
    w.off[c] = off[c];
    w.js[c] = js[c];
  }
  w.t = t;
  return i;
}

// The bitmap walk's whole decode from the classes' ranks (each class's increasing, below n):
// positions into pos_out and values into values_out, both with 64 elements of headroom.
// Returns as dcr_ctx_decode does.
static int64_t ctx_bitmap_decode(const void* const* segs, const int64_t* lens, int64_t nseg, int width, int shift,
                                 int nbits, const uint8_t* cls_map, int k, const int64_t* ranks,
                                 const int64_t* starts, const uint8_t* toks, const void* esc, int64_t n_esc,
                                 int vwidth, int64_t* pos_out,
                                 void* values_out, int64_t* class_counts, int64_t* err) {
  thread_local std::vector<uint64_t> bits;
  thread_local std::vector<uint8_t> tok_out;
  BitmapWalk w;
  int64_t words = 0;
  for (int c = 0; c < k; ++c) {
    const int64_t m = starts[c + 1] - starts[c];
    const int64_t nw = m ? (ranks[starts[c + 1] - 1] >> 6) + 1 : 0;
    w.woff[c] = words;
    w.lim[c] = words + nw;
    words += nw + 2;  // two zero words past the last rank: the walk reads a pair
    w.off[c] = 0;
    w.js[c] = starts[c];
  }
  bits.assign(static_cast<size_t>(words), 0);
  for (int c = 0; c < k; ++c)
    for (int64_t j = starts[c]; j < starts[c + 1]; ++j)
      bits[w.woff[c] + (ranks[j] >> 6)] |= uint64_t{1} << (ranks[j] & 63);
  const int64_t total = starts[k];
  tok_out.resize(static_cast<size_t>(total + 64));
  w.bm = bits.data();
  w.toks = toks;
  w.pos_out = pos_out;
  w.tok_out = tok_out.data();
  uint8_t map256[256] = {0};
  std::memcpy(map256, cls_map, size_t{1} << nbits);
  const uint32_t mask = (1u << nbits) - 1;
  each_segment(segs, lens, nseg, width, [&](const auto* v, int64_t len, int64_t base) {
    bitmap_scalar(w, v, bitmap_simd(w, k, v, len, base, shift, nbits, map256), len, base, shift, mask, map256);
  });
  for (int c = 0; c < k; ++c) {
    class_counts[c] = w.off[c];
    if (w.js[c] != starts[c + 1]) {  // a rank at or past the class's population
      err[0] = c;
      return -4;
    }
  }
  int64_t e = 0;
  auto values = [&](auto* o, const auto* x) -> bool {
    const uint8_t* tk = tok_out.data();
    for (int64_t i = 0; i < total; ++i) {
      if (__builtin_expect(tk[i] == 255, 0)) {
        if (e >= n_esc) return false;
        o[i] = x[e++];
      } else {
        o[i] = tk[i];
      }
    }
    return e == n_esc;
  };
  const bool ok = vwidth == 2 ? values(static_cast<uint16_t*>(values_out), static_cast<const uint16_t*>(esc))
                              : values(static_cast<uint32_t*>(values_out), static_cast<const uint32_t*>(esc));
  return ok ? total : -6;
}
#else
constexpr bool kBitmapWalk = false;
constexpr double kBitmapPer64 = 0;
static int64_t ctx_bitmap_decode(const void* const*, const int64_t*, int64_t, int, int, int, const uint8_t*, int,
                                 const int64_t*, const int64_t*, const uint8_t*, const void*, int64_t, int, int64_t*,
                                 void*,
                                 int64_t*, int64_t*) {
  return -100;
}
#endif

}  // namespace

// The walks' positions (int64, from the range's start) as the caller keeps them: + lo (a
// tensor's chunk after its first), as int32 in place where the tensor's positions fit (the
// narrowing writes 4 bytes at 4i while reading 8 at 8i, so it never overtakes its reads).
// Here rather than as two torch passes, each with its own allocation.
static void narrow_positions(int64_t* pos, int64_t count, int64_t lo, int pos32) {
  if (pos32) {
    char* b = reinterpret_cast<char*>(pos);  // the same bytes as both widths: memcpy, not casts
    for (int64_t i = 0; i < count; ++i) {
      int64_t v;
      std::memcpy(&v, b + 8 * i, 8);
      const int32_t w = static_cast<int32_t>(v + lo);
      std::memcpy(b + 4 * i, &w, 4);
    }
  } else if (lo) {
    for (int64_t i = 0; i < count; ++i) pos[i] += lo;
  }
}

// ---------------------------------------------------------------- fused context decoder
// A context-coded chunk's classes decoded in one call (codec/context.py join_coded): per class
// its gap stream (rANS undone, GAP8 to ranks) and its tokens (rANS undone), then the walk over
// the old bits (dcr_ctx_positions) and the values (dcr_ctx_values). Python's share was a call
// or three per stream, per chunk: most of the time on models of many small tensors.
// desc: per class 8 int64: gap stream address, stored bytes, raw bytes, rANS-coded (else the
// raw bytes), token stream address, stored bytes, tokens, rANS-coded. pos_out and
// values_out hold the tokens' total (pos_out 64 more); positions come out + lo, as int32 in
// pos_out's first half where pos32. Returns the changes decoded, or < 0 with err[0] the class (or count)
// and err[1] the stream's own code: -1 gap rANS, -2 gap decode, -3 token rANS, -4 a class's
// ranks beyond its population, -5 ranks that name fewer positions than changes, -6 escapes
// that do not match the tokens, -100 bad arguments.
extern "C" int64_t dcr_ctx_decode(const void* const* segs, const int64_t* lens, int64_t nseg, int width, int shift,
                                  int nbits, const uint8_t* cls_map, int k, const int64_t* desc, const void* esc,
                                  int64_t n_esc, int vwidth, int64_t* pos_out, void* values_out,
                                  int64_t* class_counts, int64_t* err, int64_t lo, int pos32) {
  if (k < 1 || k > 16 || (vwidth != 2 && vwidth != 4)) return -100;
  int64_t n = 0;
  for (int64_t s = 0; s < nseg; ++s) n += lens[s];
  int64_t starts[17] = {0};
  for (int j = 0; j < k; ++j) {
    const int64_t m = desc[8 * j + 6];
    if (m < 0 || m > n) return -100;
    starts[j + 1] = starts[j] + m;
  }
  const int64_t total = starts[k];
  thread_local std::vector<int64_t> ranks, src;
  thread_local std::vector<uint8_t> gbuf, toks;
  ranks.resize(static_cast<size_t>(std::max<int64_t>(total, 1)));
  src.resize(static_cast<size_t>(std::max<int64_t>(total, 1)));
  toks.resize(static_cast<size_t>(std::max<int64_t>(total, 1)));
  for (int j = 0; j < k; ++j) {
    const int64_t* d = desc + 8 * j;
    const uint8_t* g = reinterpret_cast<const uint8_t*>(d[0]);
    int64_t glen = d[1];
    if (d[3]) {  // rANS: the raw GAP8 bytes first
      if (d[2] < 0 || d[2] > 2 * n + 64) return -100;
      gbuf.resize(static_cast<size_t>(std::max<int64_t>(d[2], 1)));
      uint8_t* gb = gbuf.data();
      const int64_t rc = ans_decode(g, glen, d[2], [gb](int64_t i, uint8_t s) { gb[i] = s; });
      if (rc < 0) {
        err[0] = j;
        err[1] = rc;
        return -1;
      }
      g = gb;
      glen = d[2];
    }
    const int64_t m = starts[j + 1] - starts[j];
    const int64_t rc = gaps8_decode(g, glen, m, 0, std::max<int64_t>(n, 1), ranks.data() + starts[j]);
    if (rc < 0) {
      err[0] = j;
      err[1] = rc;
      return -2;
    }
    const uint8_t* t = reinterpret_cast<const uint8_t*>(d[4]);
    uint8_t* to = toks.data() + starts[j];
    if (d[7]) {
      const int64_t rt = ans_decode(t, d[5], m, [to](int64_t i, uint8_t s) { to[i] = s; });
      if (rt < 0) {
        err[0] = j;
        err[1] = rt;
        return -3;
      }
    } else {
      if (d[5] != m) return -100;
      std::memcpy(to, t, static_cast<size_t>(m));
    }
  }
  // NEMO_DCR_BITMAP / NEMO_DCR_NO_BITMAP force the choice either way (the tests run both walks).
  const bool bitmap = kBitmapWalk && !std::getenv("NEMO_DCR_NO_AVX512") && !std::getenv("NEMO_DCR_NO_BITMAP") &&
                      (std::getenv("NEMO_DCR_BITMAP") ||
                       static_cast<double>(total) * 64 >= static_cast<double>(n) * kBitmapPer64);
  if (bitmap) {
    const int64_t rc = ctx_bitmap_decode(segs, lens, nseg, width, shift, nbits, cls_map, k, ranks.data(), starts,
                                         toks.data(), esc, n_esc, vwidth, pos_out, values_out, class_counts, err);
    if (rc >= 0) narrow_positions(pos_out, rc, lo, pos32);
    return rc;
  }
  const int64_t found = dcr_ctx_positions(segs, lens, nseg, width, shift, nbits, cls_map, k, ranks.data(), starts,
                                          pos_out, src.data(), class_counts);
  if (found < 0) {
    err[0] = found == -100 ? -1 : -found - 1;
    return found == -100 ? -100 : -4;
  }
  if (found != total) {
    err[0] = found;
    return -5;
  }
  if (dcr_ctx_values(src.data(), total, toks.data(), esc, n_esc, vwidth, values_out) != 0) return -6;
  narrow_positions(pos_out, total, lo, pos32);
  return total;
}
