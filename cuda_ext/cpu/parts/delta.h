// A part of the one translation unit cuda_ext/cpu/dcr_cpu.cpp, which includes the parts in order
// (they see what the parts before them define). The delta pass (XOR against the baseline, AVX-512/AVX2/portable, threaded), the
// receiver's scatter of values, the ULP and value transforms.

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
// One branch per group of four words and one per changed word (most are unchanged at
// realistic rates); the lanes of a changed word are written without a branch.
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

}  // namespace
