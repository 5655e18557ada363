// Decode attention of one work item (a query row's query heads over some of its KV heads), written once for a
// vector ISA: plugin_ops.cpp includes it inside namespace k256 (AVX2) and k512 (AVX-512, its own target), each with
// its `Isa` traits (V: the float vector of L lanes; widen(p): L numbers of a pool row as floats in the pool's unit;
// reduce8: the sums of eight vectors as one __m256) and, from plugin_ops.cpp, Pool, row_scale, num, softmax_rows,
// prefetch_row, Item, Geometry, Scratch and row_offsets in scope.
// Rows: an fp32 pool row whose head_dim is a multiple of L is read in place; any other row is widened to fp32
// ONCE into a small buffer (L1) and the group's query heads then read floats, so an 8-bit row costs one
// conversion however many query heads share it. Widened rows are padded with zeros to a multiple of L (q too),
// so any head_dim runs the same vector loops.

// d numbers of a pool row as floats (the pool's unit) into dst[0, dp), zeros after d
template <typename KV>
inline void widen_row(const KV* row, float* dst, int64_t d, int64_t dp) {
  int64_t j = 0;
  for (; j + Isa::L <= d; j += Isa::L) Isa::store(dst + j, Isa::widen(row + j));
  for (; j < d; ++j) dst[j] = num(row[j]);
  for (; j < dp; ++j) dst[j] = 0.0f;
}

// The row at pool + off as dp floats: in place (an fp32 pool, d == dp), else widened into buf.
template <typename KV>
inline const float* row_floats(const KV* pool, int64_t off, float* buf, int64_t d, int64_t dp) {
  if constexpr (std::is_same_v<KV, float>)
    if (d == dp) return pool + off;
  widen_row(pool + off, buf, d, dp);
  return buf;
}

// acc[c * L ..] += sum over the rows u < n of w[u] * rows[u][c * L ..] for the NV vectors starting at column c0:
// even and odd rows in separate registers (2 * NV independent chains)
template <int NV>
inline void accumulate(float* acc, const float* const* rows, const float* w, int64_t n, int64_t c0) {
  typename Isa::V e[NV], o[NV];
  for (int i = 0; i < NV; ++i) {
    e[i] = Isa::load(acc + c0 + i * Isa::L);
    o[i] = Isa::zero();
  }
  int64_t p = 0;
  for (; p + 2 <= n; p += 2) {
    const typename Isa::V w0 = Isa::set1(w[p]), w1 = Isa::set1(w[p + 1]);
    const float* r0 = rows[p] + c0;
    const float* r1 = rows[p + 1] + c0;
    for (int i = 0; i < NV; ++i) {
      e[i] = Isa::fma(w0, Isa::load(r0 + i * Isa::L), e[i]);
      o[i] = Isa::fma(w1, Isa::load(r1 + i * Isa::L), o[i]);
    }
  }
  if (p < n) {
    const typename Isa::V w0 = Isa::set1(w[p]);
    for (int i = 0; i < NV; ++i) e[i] = Isa::fma(w0, Isa::load(rows[p] + c0 + i * Isa::L), e[i]);
  }
  for (int i = 0; i < NV; ++i) Isa::store(acc + c0 + i * Isa::L, Isa::add(e[i], o[i]));
}

// One work item: the query heads of kv heads [it.h, it.h + it.nh) of row it.row over positions [it.lo, it.lo + len).
// part == nullptr: the item covers the row's whole context; its softmax is normalized and the output written.
// Otherwise (a split row): exp(score - max) unnormalized, and per query head max, sum and the weighted sum of the
// values go to part ([heads][d + 2]) for decode_attention to merge. A span of every kv head reads each slot (all
// heads of a position) whole, in position order, which the memory system streams faster than one head's rows.
template <typename Q, typename KV>
void attend_item(const Q* q, const KV* kpool, const KV* vpool, Q* out, float* part, const Item& it,
                 const Geometry& g, float scale, float softcap, Scratch& s) {
  constexpr int L = Isa::L;
  const int64_t d = g.d, group = g.group, len = it.len, heads = it.nh * group;
  const int64_t dp = (d + L - 1) / L * L;
  const int64_t ptile = std::max<int64_t>(8, std::min<int64_t>(32, 2048 / dp));  // V rows per tile (<= 8 KB)
  s.qf.assign(heads * dp, 0.0f);
  s.acc.assign(heads * dp, 0.0f);
  s.scores.resize(heads * len);
  s.ml.resize(2 * heads);
  s.tile.resize(ptile * dp);
  s.weights.resize(ptile);
  s.vscale.resize(ptile);
  s.rows.resize(ptile);
  s.zeros.assign(dp, 0.0f);
  const int64_t* off = row_offsets(it, g, s);   // kv head it.h's rows; head it.h + h's are h * kvrow further
  const int64_t span = it.nh * g.kvrow;         // what one position of the item reads, prefetched as one
  const int64_t q0 = it.row * g.hq + it.h * group;  // the item's first query head
  for (int64_t gi = 0; gi < heads; ++gi)
    for (int64_t j = 0; j < d; ++j) s.qf[gi * dp + j] = to_f(q[(q0 + gi) * d + j]) * scale;
  const float** rows = s.rows.data();
  // scores[gi * len + p] = q_gi . k_{lo+p}: eight positions per tile (rows past len are zeros: score 0, not
  // stored), one transpose-reduce instead of eight horizontal sums
  for (int64_t p0 = 0; p0 < len; p0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - p0);
    for (int64_t u = 0; u < n; ++u)
      if (p0 + u + KV_AHEAD < len) prefetch_row(kpool + off[p0 + u + KV_AHEAD], span);
    for (int64_t h = 0; h < it.nh; ++h) {
      alignas(32) float ks[8] = {1, 1, 1, 1, 1, 1, 1, 1};
      for (int64_t u = 0; u < n; ++u) {
        const int64_t o = off[p0 + u] + h * g.kvrow;
        rows[u] = row_floats(kpool, o, s.tile.data() + u * dp, d, dp);
        ks[u] = row_scale(kpool + o, d);
      }
      for (int64_t u = n; u < 8; ++u) rows[u] = s.zeros.data();
      const __m256 ksv = _mm256_load_ps(ks);
      for (int64_t gi = h * group; gi < (h + 1) * group; ++gi) {
        const float* qg = s.qf.data() + gi * dp;
        typename Isa::V a[8];
        for (int u = 0; u < 8; ++u) a[u] = Isa::zero();
        for (int64_t j = 0; j < dp; j += L) {
          const typename Isa::V qv = Isa::load(qg + j);
          for (int u = 0; u < 8; ++u) a[u] = Isa::fma(qv, Isa::load(rows[u] + j), a[u]);
        }
        __m256 sc8 = Isa::reduce8(a);
        if constexpr (Pool<KV>::quantized) sc8 = _mm256_mul_ps(sc8, ksv);
        float* dst = s.scores.data() + gi * len + p0;
        if (n == 8) {
          _mm256_storeu_ps(dst, sc8);
        } else {
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, sc8);
          for (int64_t u = 0; u < n; ++u) dst[u] = tmp[u];
        }
      }
    }
  }
  softmax_rows(s.scores.data(), heads, len, softcap, part ? s.ml.data() : nullptr);
  // weighted sum of the values, ptile rows at a time (an 8-bit row's weight carries its scale)
  for (int64_t p0 = 0; p0 < len; p0 += ptile) {
    const int64_t n = std::min<int64_t>(ptile, len - p0);
    for (int64_t u = 0; u < n; ++u)
      if (p0 + u + KV_AHEAD < len) prefetch_row(vpool + off[p0 + u + KV_AHEAD], span);
    for (int64_t h = 0; h < it.nh; ++h) {
      for (int64_t u = 0; u < n; ++u) {
        const int64_t o = off[p0 + u] + h * g.kvrow;
        rows[u] = row_floats(vpool, o, s.tile.data() + u * dp, d, dp);
        s.vscale[u] = row_scale(vpool + o, d);
      }
      for (int64_t gi = h * group; gi < (h + 1) * group; ++gi) {
        const float* w = s.scores.data() + gi * len + p0;
        if constexpr (Pool<KV>::quantized) {
          for (int64_t u = 0; u < n; ++u) s.weights[u] = w[u] * s.vscale[u];
          w = s.weights.data();
        }
        float* ag = s.acc.data() + gi * dp;
        int64_t c = 0;
        for (; c + 4 * L <= dp; c += 4 * L) accumulate<4>(ag, rows, w, n, c);
        for (; c < dp; c += L) accumulate<1>(ag, rows, w, n, c);
      }
    }
  }
  if (part != nullptr) {
    for (int64_t gi = 0; gi < heads; ++gi) {
      float* pg = part + gi * (d + 2);
      pg[0] = s.ml[2 * gi];
      pg[1] = s.ml[2 * gi + 1];
      std::copy_n(s.acc.data() + gi * dp, d, pg + 2);
    }
    return;
  }
  for (int64_t gi = 0; gi < heads; ++gi)
    for (int64_t j = 0; j < d; ++j) out[(q0 + gi) * d + j] = from_f<Q>(s.acc[gi * dp + j]);
}
