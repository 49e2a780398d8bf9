// A part of the one translation unit cuda_ext/cpu/dcr_cpu.cpp, which includes the parts in order
// (they see what the parts before them define). The decoder's bitmap walk and the fused context decoder.

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
