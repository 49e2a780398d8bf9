// A part of the one translation unit cuda_ext/cpu/dcr_cpu.cpp, which includes the parts in order
// (they see what the parts before them define). The fused context encoder (class choice, the rank walk, per-class streams).

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
