// A part of the one translation unit cuda_ext/cpu/dcr_cpu.cpp, which includes the parts in order
// (they see what the parts before them define). The C ABI of the codec's streams: context values, exponent histograms,
// batch member tables, ULP tokens, rANS encode/decode, gap encode/decode.

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
