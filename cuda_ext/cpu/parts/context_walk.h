// A part of the one translation unit cuda_ext/cpu/dcr_cpu.cpp, which includes the parts in order
// (they see what the parts before them define). Context coding's position walk: each changed position as its rank among
// the positions of its exponent class (scalar, AVX-512, GFNI).

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
// popcount; a change inside the block takes its class's count below it from the mask, one
// change per turn of a loop that ends at the first change past the block (a block with no
// change costs only the counts). pos, cold and cnew hold 4 sentinel entries past count, so
// reading the entry after the last change stays in bounds.
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
