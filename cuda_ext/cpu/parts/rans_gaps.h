// A part of the one translation unit cuda_ext/cpu/dcr_cpu.cpp, which includes the parts in order
// (they see what the parts before them define). Order-0 rANS encoding, gap stream decoding, and the C ABI of the delta
// pass and the scatter.

namespace {

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
