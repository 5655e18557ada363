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

// For GB query heads g of one kv head at once: acc[g * dp + c0 ..] += sum over the rows u < n of
// w[g][u] * rows[u][c0 ..], the NV vectors from column c0. Each row's vectors are loaded once for the GB heads
// (GB * NV accumulators: as many independent chains), not once per head.
template <int NV, int GB>
inline void accumulate_heads(float* acc, int64_t dp, const float* const* rows, const float* const* w, int64_t n,
                             int64_t c0) {
  typename Isa::V a[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = Isa::load(acc + g * dp + c0 + i * Isa::L);
  for (int64_t u = 0; u < n; ++u) {
    const float* r = rows[u] + c0;
    typename Isa::V x[NV];
    for (int i = 0; i < NV; ++i) x[i] = Isa::load(r + i * Isa::L);
    for (int g = 0; g < GB; ++g) {
      const typename Isa::V wv = Isa::set1(w[g][u]);
      for (int i = 0; i < NV; ++i) a[g][i] = Isa::fma(wv, x[i], a[g][i]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < NV; ++i) Isa::store(acc + g * dp + c0 + i * Isa::L, a[g][i]);
}

// accumulate_heads over every column of the rows (dp floats): blocks of 4 vectors, then single vectors
template <int GB>
inline void accumulate_rows(float* acc, int64_t dp, const float* const* rows, const float* const* w, int64_t n) {
  int64_t c = 0;
  for (; c + 4 * Isa::L <= dp; c += 4 * Isa::L) accumulate_heads<4, GB>(acc, dp, rows, w, n, c);
  for (; c < dp; c += Isa::L) accumulate_heads<1, GB>(acc, dp, rows, w, n, c);
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
  s.weights.resize(Isa::GB * ptile);
  s.vscale.resize(ptile);
  s.rows.resize(ptile);
  s.zeros.assign(dp, 0.0f);
  // the buffers as plain pointers: s is often the caller's thread_local, and every access through it in the loops
  // below would be a __tls_get_addr call (the library is position-independent)
  float* const qf = s.qf.data();
  float* const acc = s.acc.data();
  float* const scores = s.scores.data();
  float* const tile = s.tile.data();
  float* const weights = s.weights.data();
  float* const vscale = s.vscale.data();
  const float* const zeros = s.zeros.data();
  const float** const rows = s.rows.data();
  const int64_t* off = row_offsets(it, g, s);   // kv head it.h's rows; head it.h + h's are h * kvrow further
  const int64_t span = it.nh * g.kvrow;         // what one position of the item reads, prefetched as one
  const int64_t q0 = it.row * g.hq + it.h * group;  // the item's first query head
  for (int64_t gi = 0; gi < heads; ++gi)
    for (int64_t j = 0; j < d; ++j) qf[gi * dp + j] = to_f(q[(q0 + gi) * d + j]) * scale;
  // scores[gi * len + p] = q_gi . k_{lo+p}: eight positions per tile (rows past len are zeros: score 0, not
  // stored), one transpose-reduce instead of eight horizontal sums
  for (int64_t p0 = 0; p0 < len; p0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - p0);
    for (int64_t u = 0; u < n; ++u)
      if (p0 + u + KV_AHEAD < len) prefetch_row(kpool + off[p0 + u + KV_AHEAD], span, it.nh > 1);
    for (int64_t h = 0; h < it.nh; ++h) {
      alignas(32) float ks[8] = {1, 1, 1, 1, 1, 1, 1, 1};
      for (int64_t u = 0; u < n; ++u) {
        const int64_t o = off[p0 + u] + h * g.kvrow;
        rows[u] = row_floats(kpool, o, tile + u * dp, d, dp);
        if constexpr (Pool<KV>::quantized) ks[u] = row_scale(kpool + o, d);
      }
      for (int64_t u = n; u < 8; ++u) rows[u] = zeros;
      for (int64_t gi = h * group; gi < (h + 1) * group; ++gi) {
        const float* qg = qf + gi * dp;
        typename Isa::V a[8];
        for (int u = 0; u < 8; ++u) a[u] = Isa::zero();
        for (int64_t j = 0; j < dp; j += L) {
          const typename Isa::V qv = Isa::load(qg + j);
          for (int u = 0; u < 8; ++u) a[u] = Isa::fma(qv, Isa::load(rows[u] + j), a[u]);
        }
        __m256 sc8 = Isa::reduce8(a);
        if constexpr (Pool<KV>::quantized) sc8 = _mm256_mul_ps(sc8, _mm256_load_ps(ks));
        float* dst = scores + gi * len + p0;
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
  softmax_rows(scores, heads, len, softcap, part ? s.ml.data() : nullptr);
  // weighted sum of the values, ptile rows at a time (an 8-bit row's weight carries its scale)
  for (int64_t p0 = 0; p0 < len; p0 += ptile) {
    const int64_t n = std::min<int64_t>(ptile, len - p0);
    for (int64_t u = 0; u < n; ++u)
      if (p0 + u + KV_AHEAD < len) prefetch_row(vpool + off[p0 + u + KV_AHEAD], span, it.nh > 1);
    for (int64_t h = 0; h < it.nh; ++h) {
      for (int64_t u = 0; u < n; ++u) {
        const int64_t o = off[p0 + u] + h * g.kvrow;
        rows[u] = row_floats(vpool, o, tile + u * dp, d, dp);
        if constexpr (Pool<KV>::quantized) vscale[u] = row_scale(vpool + o, d);
      }
      // the group's query heads Isa::GB at a time (the rest one by one), each with its weights of these rows
      for (int64_t g0 = h * group; g0 < (h + 1) * group; g0 += Isa::GB) {
        const int64_t gn = std::min<int64_t>(Isa::GB, (h + 1) * group - g0);
        const float* w[Isa::GB];
        for (int64_t g = 0; g < gn; ++g) {
          w[g] = scores + (g0 + g) * len + p0;
          if constexpr (Pool<KV>::quantized) {
            float* wq = weights + g * ptile;
            for (int64_t u = 0; u < n; ++u) wq[u] = w[g][u] * vscale[u];
            w[g] = wq;
          }
        }
        if (gn == Isa::GB)
          accumulate_rows<Isa::GB>(acc + g0 * dp, dp, rows, w, n);
        else
          for (int64_t g = 0; g < gn; ++g) accumulate_rows<1>(acc + (g0 + g) * dp, dp, rows, w + g, n);
      }
    }
  }
  if (part != nullptr) {
    for (int64_t gi = 0; gi < heads; ++gi) {
      float* pg = part + gi * (d + 2);
      pg[0] = s.ml[2 * gi];
      pg[1] = s.ml[2 * gi + 1];
      std::copy_n(acc + gi * dp, d, pg + 2);
    }
    return;
  }
  for (int64_t gi = 0; gi < heads; ++gi)
    for (int64_t j = 0; j < d; ++j) out[(q0 + gi) * d + j] = from_f<Q>(acc[gi * dp + j]);
}
