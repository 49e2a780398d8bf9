// A part of the one translation unit cuda_ext/cpu/dcr_cpu.cpp, which includes the parts in order
// (they see what the parts before them define). The additive digest, the fused XOR-chunk encoder, the affine placement map
// and a slice's chunks in one call.

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
