// The panel-layout GEMM kernels, written once for any vector width: linear_kernels.cpp includes this file
// once per instruction set (AVX2 + FMA, AVX-512), inside a namespace that first defines `struct Isa`
// (the vector type and the few operations below) and under that instruction set's `#pragma GCC target`.
// So: no include guard, and nothing here may name an intrinsic directly.
//
// Layout (kiln_kernels.h, KILN_PANEL = 16 output rows per panel; N % 16 == 0):
//   fp32        [N/16][K][16]          element (n, k) at ((n/16) * K + k) * 16 + n % 16
//   bf16, int8  [N/16][K/2][16][2]     (K even) element (n, k) at ((n/16) * K/2 + k/2) * 32 + (n%16) * 2 + k%2
// A panel is one sequential stream; each of its steps holds the 16 outputs' weights for one k (fp32) or
// two consecutive k (bf16 and int8 pairs), so the kernels never reduce across lanes: y[m, n0:n0+16] +=
// x[m, k] * W[n0:n0+16, k] with x[m, k] broadcast, and the same code serves one row of x (decode) and
// thousands (prefill).
//
// Register blocking (the micro-kernels below take MR rows of x and NP panels):
//   float path (fp32 and bf16 weights, and int8 weights when x holds NaN/inf): MR x NP*16 fp32
//     accumulators; the weights of a step are decoded once (bf16: a shift or a mask; int8: widen and
//     convert) and used by MR fused multiply-adds each.
//   int path (int8 weights): x quantised per row to int16 (kiln's usual scheme, error <= max|x_row| /
//     65534), int16 weight pairs times a broadcast pair of x into int32 lanes (AVX-512 VNNI vpdpwssd, or
//     vpmaddwd + vpaddd), flushed to fp32 every FLUSH_PAIRS pairs; row and channel scales at the end.
//     One row of x (decode) runs panel_int8_row: a panel at a time, one sequential stream per thread.
// Tiles for the threads: MC rows of x (kept in L2) x NP panels (kept in L1/L2 while the MC rows pass).
// Batched decode (M <= SMALL_M): each tile's weights come from memory once, so the first pass over a tile
// prefetches ahead (tuning().small_prefetch bytes); on AVX-512, 13..16 rows run in a single pass (panel_float with KMAJOR,
// panel_bf16dot_kmajor).

constexpr int VP = 16 / Isa::L;  // vectors per panel step

// ---- weight steps -----------------------------------------------------------------------------------
// decode(p, s, v): the fp32 vector v (lanes n = v*L .. v*L+L-1) of sub-step s (k + s) of the step at p

struct PanelF32 {
  using T = float;
  static constexpr int S = 1;             // k per step
  static constexpr int64_t STEP = 16;     // elements per step
  static inline Isa::V decode(const float* p, int, int v) { return Isa::load(p + v * Isa::L); }
};

struct PanelBf16 {
  using T = uint16_t;
  static constexpr int S = 2;
  static constexpr int64_t STEP = 32;
  static inline Isa::V decode(const uint16_t* p, int s, int v) { return Isa::bf16_pair(p + v * 2 * Isa::L, s); }
};

struct PanelInt8 {
  using T = int8_t;
  static constexpr int S = 2;
  static constexpr int64_t STEP = 32;
  static inline Isa::V decode(const int8_t* p, int s, int v) { return Isa::i8_pair(p + v * 2 * Isa::L, s); }
};

// ---- epilogue -----------------------------------------------------------------------------------------
// One output row segment of 16 * NP values: times the row scale and the channel scales, plus the bias,
// stored as fp32 or as bf16 (rounded to nearest even, as torch rounds).
struct Epilogue {
  const float* wscale;  // [N] channel scales (int8) or null
  const float* bias;    // [N] or null
  float* y;             // [M][N] fp32 output, or null
  uint16_t* yb;         // [M][N] bf16 output, or null
  int64_t N;
  inline void store(int64_t m, int64_t n0, const Isa::V* acc, int nvec, float rscale) const {
    for (int j = 0; j < nvec; ++j) {
      const int64_t n = n0 + int64_t(j) * Isa::L;
      Isa::V v = acc[j];
      if (rscale != 1.0f) v = Isa::mul(v, Isa::set1(rscale));
      if (wscale) v = Isa::mul(v, Isa::load(wscale + n));
      if (bias) v = Isa::add(v, Isa::load(bias + n));
      if (y) Isa::store(y + m * N + n, v);
      else Isa::store_bf16(yb + m * N + n, v);
    }
  }
};

// ---- float path ---------------------------------------------------------------------------------------

// PF: prefetch pf bytes ahead in each panel (the pass that streams a tile from memory: tuning().small_prefetch for a
// batched decode, tuning().bf16_row_prefetch for a bf16 one-row decode).
// KMAJOR: x packed k-major (x[k][MR], rows >= `rows` zero; ldx unused), so the MR broadcasts of a step read one
// cache line, where MR rows of x K * 4 bytes apart share one L1 set when K is a multiple of 1024 (K = 1024: 12 or
// 16 rows against 12 ways); it stores the first `rows` rows. Used by the batched decode's one pass of 13..16 rows
// (AVX-512: all rows in one pass over the weights, so the FMAs overlap the weight stream from memory instead of a
// second pass re-reading each tile from L2 while memory idles; PF with tuning().onepass_prefetch) and by prefill
// tiles (tile_float_kmajor).
template <class W, int MR, int NP, bool PF = false, bool KMAJOR = false>
inline void panel_float(const typename W::T* w, int64_t pstride, const float* x, int64_t ldx, int64_t K,
                        const Epilogue& ep, int64_t m0, int64_t n0, int rows = MR, int64_t pf = 0) {
  Isa::V acc[MR][NP][VP];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < VP; ++v) acc[i][p][v] = Isa::zero();
  const int64_t steps = K / W::S;
  for (int64_t t = 0; t < steps; ++t) {
    const typename W::T* q = w + t * W::STEP;
    if constexpr (PF)
      for (int p = 0; p < NP; ++p) prefetch_line(reinterpret_cast<const char*>(q + p * pstride) + pf);
    for (int s = 0; s < W::S; ++s) {
      Isa::V wv[NP][VP];
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < VP; ++v) wv[p][v] = W::decode(q + p * pstride, s, v);
      const int64_t k = t * W::S + s;
      const float* xk = KMAJOR ? x + k * MR : x + k;
#pragma GCC unroll 32
      for (int i = 0; i < MR; ++i) {
        const Isa::V xb = Isa::bcast(xk + (KMAJOR ? i : i * ldx));
        for (int p = 0; p < NP; ++p)
          for (int v = 0; v < VP; ++v) acc[i][p][v] = Isa::fma(xb, wv[p][v], acc[i][p][v]);
      }
    }
  }
  for (int i = 0; i < rows; ++i) ep.store(m0 + i, n0, &acc[i][0][0], NP * VP, 1.0f);
}

// The batched decode's 13..16 rows over a pair of panels (AVX-512, tuning().onepass_split): for each chunk of KC k
// (2 panels x KC steps, in L1) rows 0..11 first, streaming the weights from memory (prefetching pf bytes ahead in
// both panels), then rows 12..15 over the same lines from L1; each pass parks its accumulators in `part` between
// chunks. Against panel_float's 16 rows x 1 panel (a weight vector and 16 broadcasts loaded for 16 multiply-adds,
// one stream a thread) the 12-row pass loads 14 for 24 from two streams: on Sapphire Rapids the 16-row kernel
// overlaps its multiply-adds with the weight stream only in part, the 12-row pass keeps the stream at the read rate
// (docs/benchmarks.md, "fp32 batched decode"). xp: x packed k-major [K][16] (pack_kmajor), rows >= `rows` zero.
template <class W, int KC>
inline void panel_pair_float_12_4(const typename W::T* w, int64_t pstride, const float* xp, int64_t K,
                                  const Epilogue& ep, int64_t n0, int rows, int64_t pf) {
  constexpr int NP = 2, MRALL = 16;
  static_assert(KC % W::S == 0);
  alignas(64) float part[MRALL][NP * VP * Isa::L];
  for (int i = 0; i < MRALL; ++i)
    for (int j = 0; j < NP * VP; ++j) Isa::store(part[i] + j * Isa::L, Isa::zero());
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t t0 = k0 / W::S, t1 = std::min(K, k0 + KC) / W::S;
    const auto pass = [&](auto r0, auto mr) {
      constexpr int R0 = decltype(r0)::value, MR = decltype(mr)::value;
      constexpr bool STREAMS = R0 == 0;   // the first pass brings the chunk from memory
      Isa::V acc[MR][NP][VP];
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
        for (int p = 0; p < NP; ++p)
          for (int v = 0; v < VP; ++v) acc[i][p][v] = Isa::load(part[R0 + i] + (p * VP + v) * Isa::L);
      for (int64_t t = t0; t < t1; ++t) {
        const typename W::T* q = w + t * W::STEP;
        if constexpr (STREAMS)
          for (int p = 0; p < NP; ++p) prefetch_line(reinterpret_cast<const char*>(q + p * pstride) + pf);
        for (int s = 0; s < W::S; ++s) {
          Isa::V wv[NP][VP];
          for (int p = 0; p < NP; ++p)
            for (int v = 0; v < VP; ++v) wv[p][v] = W::decode(q + p * pstride, s, v);
          const float* xk = xp + (t * W::S + s) * MRALL + R0;
#pragma GCC unroll 16
          for (int i = 0; i < MR; ++i) {
            const Isa::V xb = Isa::bcast(xk + i);
            for (int p = 0; p < NP; ++p)
              for (int v = 0; v < VP; ++v) acc[i][p][v] = Isa::fma(xb, wv[p][v], acc[i][p][v]);
          }
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
        for (int p = 0; p < NP; ++p)
          for (int v = 0; v < VP; ++v) Isa::store(part[R0 + i] + (p * VP + v) * Isa::L, acc[i][p][v]);
    };
    pass(std::integral_constant<int, 0>{}, std::integral_constant<int, 12>{});
    pass(std::integral_constant<int, 12>{}, std::integral_constant<int, 4>{});
  }
  for (int i = 0; i < rows; ++i) {
    Isa::V out[NP * VP];
    for (int j = 0; j < NP * VP; ++j) out[j] = Isa::load(part[i] + j * Isa::L);
    ep.store(i, n0, out, NP * VP, 1.0f);
  }
}

// rows (<= MR) rows of x [rows][K] -> xp [K][MR] (rows rows.. zero), in blocks of 64 k so that the rows are read in
// order and the block's lines of xp stay in L1. T: float (fp32 x) or int32_t (pairs of bf16 x).
template <class T>
inline void pack_block_kmajor(const T* x, int64_t rows, int64_t K, int MR, T* xp) {
  for (int64_t k0 = 0; k0 < K; k0 += 64) {
    const int64_t k1 = std::min(K, k0 + 64);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t k = k0; k < k1; ++k) xp[k * MR + i] = x[i * K + k];
    for (int64_t i = rows; i < MR; ++i)
      for (int64_t k = k0; k < k1; ++k) xp[k * MR + i] = T(0);
  }
}

// x [M][K] (M <= MR) packed into this thread's buffer.
template <class T>
inline const T* pack_kmajor(const T* x, int64_t M, int64_t K, int MR) {
  thread_local std::vector<T> buf;
  buf.resize(size_t(MR * K));
  pack_block_kmajor(x, M, K, MR, buf.data());
  return buf.data();
}

// A prefetch `off` bytes into panel p of a tile (NP panels of pb bytes from w). Past the panel's end it goes to the
// same offset of panel p in the thread's next tile (wnext; nothing after its last tile): a one-row decode thread
// reads a contiguous run of tiles (for_tile_runs), and without this each tile's streams started from the few
// lines of their own first prefetches (docs/benchmarks.md, session 30).
inline void prefetch_run(const void* w, const void* wnext, int64_t p, int64_t pb, int64_t off, bool nta) {
  if (off < pb) prefetch_once(static_cast<const char*>(w) + p * pb + off, nta);
  else if (wnext) prefetch_once(static_cast<const char*>(wnext) + p * pb + (off - pb), nta);
}

// ---- int path (int8 weights) ---------------------------------------------------------------------------
// xq: [M][K] int16 (row m scaled by sx[m]); read as int32 words, each a (k even, k odd) pair.
constexpr int64_t FLUSH_PAIRS = 128;  // 128 pairs x 2 x 127 x 32767 < 2^31

template <int MR, int NP, bool PF = false>
inline void panel_int8(const int8_t* w, int64_t pstride, const int32_t* xq, int64_t ldxq, const float* sx,
                       int64_t K, const Epilogue& ep, int64_t m0, int64_t n0, int64_t pfd,
                       const int8_t* wnext = nullptr) {
  const bool nta = MR == 1 && tuning().row_nta;   // one row of x: the weights are read once
  Isa::V facc[MR][NP][VP];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < VP; ++v) facc[i][p][v] = Isa::zero();
  const int64_t pairs = K / 2;
  for (int64_t t0 = 0; t0 < pairs; t0 += FLUSH_PAIRS) {
    const int64_t t1 = std::min(pairs, t0 + FLUSH_PAIRS);
    Isa::VI acc[MR][NP][VP];
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < VP; ++v) acc[i][p][v] = Isa::izero();
    for (int64_t t = t0; t < t1; ++t) {
      if constexpr (PF)
        if ((t & 1) == 0)  // a step is 32 bytes: one prefetch per 64-byte line
          for (int p = 0; p < NP; ++p) prefetch_run(w, wnext, p, pstride, t * 32 + pfd, nta);
      Isa::VI wv[NP][VP];
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < VP; ++v) wv[p][v] = Isa::i16_pairs(w + p * pstride + t * 32 + v * 2 * Isa::L);
      for (int i = 0; i < MR; ++i) {
        const Isa::VI xb = Isa::iset1(xq[i * ldxq + t]);
        for (int p = 0; p < NP; ++p)
          for (int v = 0; v < VP; ++v) acc[i][p][v] = Isa::dot_pairs(acc[i][p][v], wv[p][v], xb);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < VP; ++v) facc[i][p][v] = Isa::add(facc[i][p][v], Isa::cvt(acc[i][p][v]));
  }
  for (int i = 0; i < MR; ++i) ep.store(m0 + i, n0, &facc[i][0][0], NP * VP, sx[i]);
}

// Decode (one row of x), one panel: its K/2 pair steps dealt in turn to ROW_CHAINS independent int32
// accumulators per vector, which are summed (exactly, in int32) before each flush, so the result is
// bitwise that of panel_int8<1, NP>. panel_gemm_int8 gives each thread a contiguous run of panels, so
// that a thread reads one sequential stream: the hardware prefetcher keeps far more of it in flight than
// of 4 interleaved panel streams, and the chains keep the loop issuing loads as fast as they arrive.
// Software prefetch `pf` bytes ahead on top (tuning().row_prefetch: 2 KiB was the best of 1-8 KiB on Zen 5
// with either vector width) keeps still more in flight, also across the start of the next panel.
constexpr int ROW_CHAINS = 4;
static_assert(ROW_CHAINS * 32 == 2 * 64, "one prefetch per 64-byte line of a ROW_CHAINS-step iteration");

inline void panel_int8_row(const int8_t* w, const int32_t* xq, float sx, int64_t K, const Epilogue& ep,
                           int64_t n0, int64_t pf) {
  const bool nta = tuning().row_nta;
  Isa::V facc[VP];
  for (int v = 0; v < VP; ++v) facc[v] = Isa::zero();
  const int64_t pairs = K / 2;
  for (int64_t t0 = 0; t0 < pairs; t0 += FLUSH_PAIRS) {
    const int64_t t1 = std::min(pairs, t0 + FLUSH_PAIRS);
    Isa::VI acc[ROW_CHAINS][VP];
    for (int c = 0; c < ROW_CHAINS; ++c)
      for (int v = 0; v < VP; ++v) acc[c][v] = Isa::izero();
    int64_t t = t0;
    for (; t + ROW_CHAINS <= t1; t += ROW_CHAINS) {
      // the ROW_CHAINS steps' two 64-byte lines, pf bytes ahead (into the next panel at the end)
      prefetch_once(w + t * 32 + pf, nta);
      prefetch_once(w + t * 32 + 64 + pf, nta);
      for (int c = 0; c < ROW_CHAINS; ++c) {
        const Isa::VI xb = Isa::iset1(xq[t + c]);
        for (int v = 0; v < VP; ++v)
          acc[c][v] = Isa::dot_pairs(acc[c][v], Isa::i16_pairs(w + (t + c) * 32 + v * 2 * Isa::L), xb);
      }
    }
    for (; t < t1; ++t) {
      const Isa::VI xb = Isa::iset1(xq[t]);
      for (int v = 0; v < VP; ++v)
        acc[0][v] = Isa::dot_pairs(acc[0][v], Isa::i16_pairs(w + t * 32 + v * 2 * Isa::L), xb);
    }
    for (int c = 1; c < ROW_CHAINS; ++c)
      for (int v = 0; v < VP; ++v) acc[0][v] = Isa::iadd(acc[0][v], acc[c][v]);
    for (int v = 0; v < VP; ++v) facc[v] = Isa::add(facc[v], Isa::cvt(acc[0][v]));
  }
  ep.store(0, n0, facc, VP, sx);
}

// ---- bf16 dot path (bf16 weights, bf16 x, CPUs with AVX512_BF16) ---------------------------------------
// xp: [M][K] bf16 read as int32 words, each a (k even, k odd) pair; one vdpbf16ps per step and row adds
// both products of the pair to 16 fp32 lanes (products exact, fp32 accumulation).

template <int MR, int NP, bool PF = false>
inline void panel_bf16dot(const uint16_t* w, int64_t pstride, const int32_t* xp, int64_t ldxp, int64_t K,
                          const Epilogue& ep, int64_t m0, int64_t n0, int64_t pfd) {
  Isa::V acc[MR][NP][VP];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < VP; ++v) acc[i][p][v] = Isa::zero();
  const int64_t pairs = K / 2;
  for (int64_t t = 0; t < pairs; ++t) {
    if constexpr (PF)
      for (int p = 0; p < NP; ++p) prefetch_line(reinterpret_cast<const char*>(w + p * pstride + t * 32) + pfd);
    Isa::VI wv[NP][VP];
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < VP; ++v) wv[p][v] = Isa::iload(w + p * pstride + t * 32 + v * 2 * Isa::L);
    for (int i = 0; i < MR; ++i) {
      const Isa::VI xb = Isa::iset1(xp[i * ldxp + t]);
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < VP; ++v) acc[i][p][v] = Isa::dot_bf16(acc[i][p][v], wv[p][v], xb);
    }
  }
  for (int i = 0; i < MR; ++i) ep.store(m0 + i, n0, &acc[i][0][0], NP * VP, 1.0f);
}

// The one-pass batched-decode kernel of the bf16 dot path (as panel_float with KMAJOR): xp [K/2][MR] bf16 pairs.
template <int MR>
inline void panel_bf16dot_kmajor(const uint16_t* w, const int32_t* xp, int64_t K, const Epilogue& ep, int64_t m0,
                                 int64_t n0, int rows) {
  Isa::V acc[MR][VP];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < VP; ++v) acc[i][v] = Isa::zero();
  const int64_t pairs = K / 2;
  const int64_t pfd = tuning().onepass_prefetch;
  for (int64_t t = 0; t < pairs; ++t) {
    prefetch_line(reinterpret_cast<const char*>(w + t * 32) + pfd);
    Isa::VI wv[VP];
    for (int v = 0; v < VP; ++v) wv[v] = Isa::iload(w + t * 32 + v * 2 * Isa::L);
    const int32_t* xk = xp + t * MR;
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      const Isa::VI xb = Isa::iset1(xk[i]);
      for (int v = 0; v < VP; ++v) acc[i][v] = Isa::dot_bf16(acc[i][v], wv[v], xb);
    }
  }
  for (int i = 0; i < rows; ++i) ep.store(m0 + i, n0, &acc[i][0], VP, 1.0f);
}

// ---- tiles and threads -----------------------------------------------------------------------------------

// Rows m0..m1 in blocks for the micro-kernels: MRB rows at a time, then the tail in 4, 2 and 1;
// f(std::integral_constant<int, rows>, first row of the block).
template <int MRB, class F>
inline void for_row_blocks(int64_t m0, int64_t m1, F&& f) {
  int64_t m = m0;
  for (; m + MRB <= m1; m += MRB) f(std::integral_constant<int, MRB>{}, m);
  if constexpr (MRB > 4) for (; m + 4 <= m1; m += 4) f(std::integral_constant<int, 4>{}, m);
  if constexpr (MRB > 2) for (; m + 2 <= m1; m += 2) f(std::integral_constant<int, 2>{}, m);
  for (; m < m1; ++m) f(std::integral_constant<int, 1>{}, m);
}

// Rows m0..m1 of x against panels g*NP .. g*NP+NP-1 (for_row_blocks).
// PF: the first pass over the tile (the one that streams its weights from memory) prefetches.
template <class W, int NP, int MRB, bool PF = false>
inline void tile_float(const typename W::T* w, int64_t K, const float* x, int64_t m0, int64_t m1, int64_t g,
                       const Epilogue& ep, int64_t pf = 0) {
  const int64_t pstride = (K / W::S) * W::STEP;  // elements per panel
  const typename W::T* wp = w + g * NP * pstride;
  const int64_t n0 = g * NP * 16;
  const auto pass = [&](auto rows, int64_t m) {
    constexpr int R = decltype(rows)::value;
    if (PF && m == m0) panel_float<W, R, NP, PF>(wp, pstride, x + m * K, K, K, ep, m, n0, R, pf);
    else panel_float<W, R, NP>(wp, pstride, x + m * K, K, K, ep, m, n0);
  };
  for_row_blocks<MRB>(m0, m1, pass);
}

// Prefill tiles of the float path where rows of x K * 4 bytes apart share L1 sets: with K a multiple of 512 the MR
// rows of a micro-kernel fall in at most 2 of the 64 sets (K = 1024: all in one, against 12 ways), and the weights
// streaming past evict them. Such a tile reads x packed k-major in blocks of MR rows (pack_row_block: [MR blocks]
// [K][MR], the last block's missing rows zero), so that panel_float's MR broadcasts of a step read one line
// (KMAJOR). Each thread packs the row block of its tile once per call (call: the GEMM's sequence number) and keeps
// it while its tiles share that block (for_tiles deals them row-block major). Where the sets do not collide
// (K = 2816) the packing only costs (measured 5-10% slower there), so those tiles read x in place.
inline bool rows_share_l1_sets(int64_t K) { return K % 512 == 0; }
// Sequence numbers of the GEMMs that pack (one counter for every weight type: the packed blocks are shared).
inline std::atomic<uint64_t> pack_calls{0};

template <int MR>
inline const float* pack_row_block(const float* x, int64_t K, int64_t m0, int64_t m1, uint64_t call) {
  thread_local std::vector<float> buf;  // the largest row block this thread has packed: MC rows x K
  thread_local uint64_t packed_call = 0;
  thread_local int64_t packed_m0 = -1;
  if (packed_call == call && packed_m0 == m0) return buf.data();
  const int64_t blocks = (m1 - m0 + MR - 1) / MR;
  buf.resize(size_t(blocks * K * MR));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r0 = m0 + b * MR;
    pack_block_kmajor(x + r0 * K, std::min<int64_t>(MR, m1 - r0), K, MR, buf.data() + b * K * MR);
  }
  packed_call = call;
  packed_m0 = m0;
  return buf.data();
}

// Rows m0..m1 of x (one row block) against panels g*NP .. g*NP+NP-1, from the packed row block.
template <class W, int NP, int MR>
inline void tile_float_kmajor(const typename W::T* w, int64_t K, const float* x, int64_t m0, int64_t m1, int64_t g,
                              const Epilogue& ep, uint64_t call) {
  const int64_t pstride = (K / W::S) * W::STEP;
  const typename W::T* wp = w + g * NP * pstride;
  const float* xp = pack_row_block<MR>(x, K, m0, m1, call);
  for (int64_t m = m0; m < m1; m += MR)
    panel_float<W, MR, NP, false, true>(wp, pstride, xp + (m - m0) * K, 0, K, ep, m, g * NP * 16,
                                        int(std::min<int64_t>(MR, m1 - m)));
}

template <int NP, int MRB, bool PF = false>
inline void tile_int8(const int8_t* w, int64_t K, const int32_t* xq, const float* sx, int64_t m0, int64_t m1,
                      int64_t g, const Epilogue& ep) {
  const int64_t pstride = K * 16;
  const int8_t* wp = w + g * NP * pstride;
  const int64_t n0 = g * NP * 16;
  const int64_t ld = K / 2;
  const auto pass = [&](auto rows, int64_t m) {
    constexpr int R = decltype(rows)::value;
    if (PF && m == m0) panel_int8<R, NP, PF>(wp, pstride, xq + m * ld, ld, sx + m, K, ep, m, n0, tuning().small_prefetch);
    else panel_int8<R, NP>(wp, pstride, xq + m * ld, ld, sx + m, K, ep, m, n0, 0);
  };
  for_row_blocks<MRB>(m0, m1, pass);
}

template <int NP, int MRB, bool PF = false>
inline void tile_bf16dot(const uint16_t* w, int64_t K, const int32_t* xp, int64_t m0, int64_t m1, int64_t g,
                         const Epilogue& ep, int64_t pf = 0) {
  const int64_t pstride = K * 16;
  const uint16_t* wp = w + g * NP * pstride;
  const int64_t n0 = g * NP * 16;
  const int64_t ld = K / 2;
  const auto pass = [&](auto rows, int64_t m) {
    constexpr int R = decltype(rows)::value;
    if (PF && m == m0) panel_bf16dot<R, NP, PF>(wp, pstride, xp + m * ld, ld, K, ep, m, n0, pf);
    else panel_bf16dot<R, NP>(wp, pstride, xp + m * ld, ld, K, ep, m, n0, 0);
  };
  for_row_blocks<MRB>(m0, m1, pass);
}

// ---- int4 panels --------------------------------------------------------------------------------------
// Layout (KILN_W_INT4_PANEL): [N/16][K/8][64] bytes. Block b of a panel holds k = 8b .. 8b+7 of its 16 rows in one
// 64-byte line, as 32 little-endian 16-bit words: word i (0..31), nibble c (bits 4c..4c+3) is the unsigned value
// u (0..15) of element (n = i/2, k = 8b + 2c + i%2). So (word >> 4c) & 15 are the int16 pairs (k even, k odd) of
// pair step 4b + c for 16 outputs: one load and a shift + mask per step give what vpmaddwd / vpdpwssd multiply
// with a broadcast pair of x, for either vector width (AVX2 reads the line as two 32-byte halves, rows 0-7 and
// 8-15). Per group of gs k (gs % 8 == 0), each row has an fp16 scale and a zero point z (uint8, or 8 for all when
// the weight has none): w = (u - z) * scale. The int32 sums start at -z * sum(x in the group) (exact), so a
// group's sum is sum((u - z) * x) before one conversion and one FMA with its scale.
// Sums stay exact within INT4_CHUNK blocks (1024 k: 128 x 2 x 15 x 32767 per chain, four chains < 2^31); the
// one-row kernel's chunk is the same (its bound is tighter), so that both flush at the same k and agree bitwise.
constexpr int64_t INT4_CHUNK = 128;

struct Int4W {
  const uint8_t* w;     // [N/16][K/8][64]
  const uint16_t* s;    // [N/16][G][16] fp16 bits
  const uint8_t* z;     // [N/16][G][16] or null
  int64_t K, gs;
  int64_t groups() const { return K / gs; }
  int64_t pbytes() const { return (K / 8) * 64; }
  const uint8_t* panel(int64_t p) const { return w + p * pbytes(); }
  const uint16_t* pscales(int64_t p) const { return s + p * groups() * 16; }
  const uint8_t* pzeros(int64_t p) const { return z ? z + p * groups() * 16 : nullptr; }
};

// x of an int4 call, as its kernels read it. int16 x (the default): xq [M][K/2] int32 words, each an int16 pair
// (k even, k odd), and sx [M] the rows' scales. int8 x ("x8" below): xq [M][K/4] int32 words of 4 int8 (a block's
// low-nibble word 2b, high-nibble word 2b+1), and sx [M][G] the groups' scales (max |x| / 127). Both: xs [M][G] the
// groups' sums of xq.
struct Int4X {
  const int32_t* xq;
  const float* sx;
  const int32_t* xs;
};

// The int32 start of a group's sums for vector v of a panel: -zero * xsum.
inline Isa::VI int4_start(const uint8_t* zg, int v, int32_t xsum) {
  if (!zg) return Isa::iset1(-8 * xsum);
  return Isa::imul(Isa::u8_to_i32(zg + v * Isa::L), Isa::iset1(-xsum));
}

// Decode (one row of x), one panel: four int32 chains (one per pair step of a block), one sequential stream.
// One row has no rows of x to share a weight vector's decode with, so the decode is what the kernel spends its
// vector ops on (on AVX-512 the shifts and the dot products share one port): a 64-byte block takes one shift and
// four ANDs. Nibbles 1 and 3 are masked in place, i.e. left times 16 (up to 240, still an int16 pair lane), and
// their chains are divided by 16 (exactly: every term is a multiple of 16) before they join the others. Those two
// chains bound the chunk: INT4_CHUNK blocks x 2 x 240 x 32767 < 2^31.

inline void panel_int4_row(const Int4W& W, int64_t p, const int32_t* xq, float sx, const int32_t* xs,
                           const Epilogue& ep, int64_t pf) {
  const uint8_t* w = W.panel(p);
  const uint16_t* sc = W.pscales(p);
  const uint8_t* zp = W.pzeros(p);
  const int64_t G = W.groups(), gblocks = W.gs / 8;
  const bool nta = tuning().row_nta;
  const Isa::VI lo4 = Isa::iset1_16(0x000F), hi4 = Isa::iset1_16(0x00F0);
  Isa::V facc[VP];
  for (int v = 0; v < VP; ++v) facc[v] = Isa::zero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* zg = zp ? zp + g * 16 : nullptr;
    for (int64_t b0 = g * gblocks; b0 < (g + 1) * gblocks; b0 += INT4_CHUNK) {
      const int64_t b1 = std::min((g + 1) * gblocks, b0 + INT4_CHUNK);
      Isa::VI acc[4][VP];
      for (int v = 0; v < VP; ++v) {
        acc[0][v] = b0 == g * gblocks ? int4_start(zg, v, xs[g]) : Isa::izero();
        acc[1][v] = acc[2][v] = acc[3][v] = Isa::izero();
      }
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* q = w + b * 64;
        prefetch_once(q + pf, nta);
        const Isa::VI x0 = Isa::iset1(xq[4 * b]), x1 = Isa::iset1(xq[4 * b + 1]);
        const Isa::VI x2 = Isa::iset1(xq[4 * b + 2]), x3 = Isa::iset1(xq[4 * b + 3]);
        for (int v = 0; v < VP; ++v) {
          const Isa::VI wv = Isa::iload(q + v * 4 * Isa::L);
          const Isa::VI t = Isa::template srli16<8>(wv);
          acc[0][v] = Isa::dot_pairs(acc[0][v], Isa::iand(wv, lo4), x0);
          acc[1][v] = Isa::dot_pairs(acc[1][v], Isa::iand(wv, hi4), x1);   // 16 x nibble 1
          acc[2][v] = Isa::dot_pairs(acc[2][v], Isa::iand(t, lo4), x2);
          acc[3][v] = Isa::dot_pairs(acc[3][v], Isa::iand(t, hi4), x3);    // 16 x nibble 3
        }
      }
      for (int v = 0; v < VP; ++v) {
        const Isa::VI t = Isa::iadd(Isa::iadd(acc[0][v], acc[2][v]),
                                    Isa::iadd(Isa::template srai32<4>(acc[1][v]), Isa::template srai32<4>(acc[3][v])));
        facc[v] = Isa::fma(Isa::f16_to_f32(sc + g * 16 + v * Isa::L), Isa::cvt(t), facc[v]);
      }
    }
  }
  ep.store(0, p * 16, facc, VP, sx);
}

// MR rows of x x NP panels (p0 .. p0+NP-1). xq [MR][ldx] int16 pairs, xs [MR][G] the rows' group sums.
template <int MR, int NP, bool PF = false>
inline void panel_int4(const Int4W& W, int64_t p0, const int32_t* xq, int64_t ldx, const float* sx, const int32_t* xs,
                       const Epilogue& ep, int64_t m0, int64_t pf, const uint8_t* wnext = nullptr) {
  const int64_t G = W.groups(), gblocks = W.gs / 8, pb = W.pbytes();
  const uint8_t* w = W.panel(p0);
  const bool nta = MR == 1 && tuning().row_nta;   // one row of x: the weights are read once
  Isa::V facc[MR][NP][VP];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < VP; ++v) facc[i][p][v] = Isa::zero();
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b0 = g * gblocks; b0 < (g + 1) * gblocks; b0 += INT4_CHUNK) {
      const int64_t b1 = std::min((g + 1) * gblocks, b0 + INT4_CHUNK);
      Isa::VI acc[MR][NP][VP];
      for (int p = 0; p < NP; ++p) {
        const uint8_t* zg = W.z ? W.pzeros(p0 + p) + g * 16 : nullptr;
        for (int i = 0; i < MR; ++i)
          for (int v = 0; v < VP; ++v)
            acc[i][p][v] = b0 == g * gblocks ? int4_start(zg, v, xs[i * G + g]) : Isa::izero();
      }
      for (int64_t b = b0; b < b1; ++b) {
        Isa::VI wv[NP][VP];
        for (int p = 0; p < NP; ++p) {
          if constexpr (PF) prefetch_run(w, wnext, p, pb, b * 64 + pf, nta);
          for (int v = 0; v < VP; ++v) wv[p][v] = Isa::iload(w + p * pb + b * 64 + v * 4 * Isa::L);
        }
        const auto step = [&](auto cc) {
          constexpr int C = decltype(cc)::value;
          Isa::VI u[NP][VP];
          for (int p = 0; p < NP; ++p)
            for (int v = 0; v < VP; ++v) u[p][v] = Isa::template nib<C>(wv[p][v]);
          for (int i = 0; i < MR; ++i) {
            const Isa::VI xb = Isa::iset1(xq[i * ldx + 4 * b + C]);
            for (int p = 0; p < NP; ++p)
              for (int v = 0; v < VP; ++v) acc[i][p][v] = Isa::dot_pairs(acc[i][p][v], u[p][v], xb);
          }
        };
        step(std::integral_constant<int, 0>{});
        step(std::integral_constant<int, 1>{});
        step(std::integral_constant<int, 2>{});
        step(std::integral_constant<int, 3>{});
      }
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < VP; ++v) {
          const Isa::V s = Isa::f16_to_f32(W.pscales(p0 + p) + g * 16 + v * Isa::L);
          for (int i = 0; i < MR; ++i) facc[i][p][v] = Isa::fma(s, Isa::cvt(acc[i][p][v]), facc[i][p][v]);
        }
    }
  }
  for (int i = 0; i < MR; ++i) ep.store(m0 + i, p0 * 16, &facc[i][0][0], NP * VP, sx[i]);
}

// Rows m0..m1 against panels g*NP .. g*NP+NP-1; the first pass over the tile prefetches (PF).
template <int NP, int MRB, bool PF = false>
inline void tile_int4(const Int4W& W, const int32_t* xq, const float* sx, const int32_t* xs, int64_t m0, int64_t m1,
                      int64_t g, const Epilogue& ep, int64_t pf) {
  const int64_t ld = W.K / 2, G = W.groups();
  const auto pass = [&](auto rows, int64_t m) {
    constexpr int R = decltype(rows)::value;
    if (PF && m == m0) panel_int4<R, NP, PF>(W, g * NP, xq + m * ld, ld, sx + m, xs + m * G, ep, m, pf);
    else panel_int4<R, NP>(W, g * NP, xq + m * ld, ld, sx + m, xs + m * G, ep, m, pf);
  };
  for_row_blocks<MRB>(m0, m1, pass);
}

// ---- int4 panels with int8 x ("x8", kiln_set_int4_x_bits(8)) ------------------------------------------------
// The 32-bit lane of row n (words 2n, 2n+1 of a block's line; AVX2: the half of rows 0-7 or 8-15) holds that row's
// 8 k of the block: its bytes' low nibbles are k = 8b + (0, 4, 1, 5) and, after a 4-bit shift, their high nibbles
// k = 8b + (2, 6, 3, 7). One AND and one shift + AND give two vectors of unsigned bytes that multiply 4 x 4 bytes
// of x into each int32 lane (AVX-512 VNNI vpdpbusd, or vpmaddubsw + vpmaddwd on AVX2): half the dot products and
// half the decode of the int16 path above, x quantised to int8 per weight group (Int4X), its 8 bytes of a block
// stored in that order. A group's int32 sums start at -z * sum(xq in the group) and end with one FMA with the
// weight's scale times x's. Every product is at most 15 x 127, so an int32 chain is exact for K < 2^20.

// x8 decode (one row of x), one panel, one sequential stream: four int32 chains (four blocks at a time; on
// AVX-512 a block is two dependent vpdpbusd, so four chains keep the dot-product unit busy).
inline void panel_int4_row_x8(const Int4W& W, int64_t p, const int32_t* xq, const float* sx, const int32_t* xs,
                              const Epilogue& ep, int64_t pf) {
  const uint8_t* w = W.panel(p);
  const uint16_t* sc = W.pscales(p);
  const uint8_t* zp = W.pzeros(p);
  const int64_t G = W.groups(), gblocks = W.gs / 8;
  const bool nta = tuning().row_nta;
  const Isa::VI lo4 = Isa::iset1_8(0x0F);
  Isa::V facc[VP];
  for (int v = 0; v < VP; ++v) facc[v] = Isa::zero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* zg = zp ? zp + g * 16 : nullptr;
    Isa::VI acc[4][VP];
    for (int v = 0; v < VP; ++v) {
      acc[0][v] = int4_start(zg, v, xs[g]);
      acc[1][v] = acc[2][v] = acc[3][v] = Isa::izero();
    }
    const auto block = [&](int64_t b, int c) {
      const uint8_t* q = w + b * 64;
      prefetch_once(q + pf, nta);
      const Isa::VI xl = Isa::iset1(xq[2 * b]), xh = Isa::iset1(xq[2 * b + 1]);
      for (int v = 0; v < VP; ++v) {
        const Isa::VI wv = Isa::iload(q + v * 4 * Isa::L);
        acc[c][v] = Isa::dot_u4(acc[c][v], Isa::iand(wv, lo4), xl, Isa::iand(Isa::template srli16<4>(wv), lo4), xh);
      }
    };
    const int64_t b1 = (g + 1) * gblocks;
    int64_t b = g * gblocks;
    for (; b + 4 <= b1; b += 4) {
      block(b, 0);
      block(b + 1, 1);
      block(b + 2, 2);
      block(b + 3, 3);
    }
    for (; b < b1; ++b) block(b, 0);
    const Isa::V s = Isa::set1(sx[g]);
    for (int v = 0; v < VP; ++v) {
      const Isa::VI t = Isa::iadd(Isa::iadd(acc[0][v], acc[1][v]), Isa::iadd(acc[2][v], acc[3][v]));
      facc[v] = Isa::fma(Isa::mul(Isa::f16_to_f32(sc + g * 16 + v * Isa::L), s), Isa::cvt(t), facc[v]);
    }
  }
  ep.store(0, p * 16, facc, VP, 1.0f);
}

// x8: MR rows of x x NP panels (p0 .. p0+NP-1); X points at the first of the MR rows, ldx / G its row strides.
template <int MR, int NP, bool PF = false>
inline void panel_int4_x8(const Int4W& W, int64_t p0, const Int4X& X, int64_t ldx, const Epilogue& ep, int64_t m0,
                          int64_t pf, const uint8_t* wnext = nullptr) {
  const int64_t G = W.groups(), gblocks = W.gs / 8, pb = W.pbytes();
  const uint8_t* w = W.panel(p0);
  const bool nta = MR == 1 && tuning().row_nta;   // one row of x: the weights are read once
  const Isa::VI lo4 = Isa::iset1_8(0x0F);
  Isa::V facc[MR][NP][VP];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < VP; ++v) facc[i][p][v] = Isa::zero();
  for (int64_t g = 0; g < G; ++g) {
    Isa::VI acc[MR][NP][VP];
    for (int p = 0; p < NP; ++p) {
      const uint8_t* zg = W.z ? W.pzeros(p0 + p) + g * 16 : nullptr;
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < VP; ++v) acc[i][p][v] = int4_start(zg, v, X.xs[i * G + g]);
    }
    for (int64_t b = g * gblocks; b < (g + 1) * gblocks; ++b) {
      Isa::VI lo[NP][VP], hi[NP][VP];
      for (int p = 0; p < NP; ++p) {
        if constexpr (PF) prefetch_run(w, wnext, p, pb, b * 64 + pf, nta);
        for (int v = 0; v < VP; ++v) {
          const Isa::VI wv = Isa::iload(w + p * pb + b * 64 + v * 4 * Isa::L);
          lo[p][v] = Isa::iand(wv, lo4);
          hi[p][v] = Isa::iand(Isa::template srli16<4>(wv), lo4);
        }
      }
      for (int i = 0; i < MR; ++i) {
        const Isa::VI xl = Isa::iset1(X.xq[i * ldx + 2 * b]), xh = Isa::iset1(X.xq[i * ldx + 2 * b + 1]);
        for (int p = 0; p < NP; ++p)
          for (int v = 0; v < VP; ++v) acc[i][p][v] = Isa::dot_u4(acc[i][p][v], lo[p][v], xl, hi[p][v], xh);
      }
    }
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < VP; ++v) {
        const Isa::V s = Isa::f16_to_f32(W.pscales(p0 + p) + g * 16 + v * Isa::L);
        for (int i = 0; i < MR; ++i)
          facc[i][p][v] = Isa::fma(Isa::mul(s, Isa::set1(X.sx[i * G + g])), Isa::cvt(acc[i][p][v]), facc[i][p][v]);
      }
  }
  for (int i = 0; i < MR; ++i) ep.store(m0 + i, p0 * 16, &facc[i][0][0], NP * VP, 1.0f);
}

// x8: rows m0..m1 against panels g*NP .. g*NP+NP-1; the first pass over the tile prefetches (PF).
template <int NP, int MRB, bool PF = false>
inline void tile_int4_x8(const Int4W& W, const Int4X& X, int64_t m0, int64_t m1, int64_t g, const Epilogue& ep,
                      int64_t pf) {
  const int64_t ld = W.K / 4, G = W.groups();
  const auto pass = [&](auto rows, int64_t m) {
    constexpr int R = decltype(rows)::value;
    const Int4X Xm{X.xq + m * ld, X.sx + m * G, X.xs + m * G};
    if (PF && m == m0) panel_int4_x8<R, NP, PF>(W, g * NP, Xm, ld, ep, m, pf);
    else panel_int4_x8<R, NP>(W, g * NP, Xm, ld, ep, m, pf);
  };
  for_row_blocks<MRB>(m0, m1, pass);
}

// Tiles (row block of MC rows, group of NP panels), row-block major so that a thread's consecutive tiles
// share their rows of x; dynamic chunks so that a thread preempted by another process holds back little.
template <class F>
inline void for_tiles(int64_t M, int64_t groups, int64_t MC, int nthreads, F&& f) {
  const int64_t mblocks = (M + MC - 1) / MC;
  const int64_t ntiles = mblocks * groups;
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, ntiles)));
  const int64_t chunk = std::max<int64_t>(1, ntiles / (int64_t(nt) * 16));
#pragma omp parallel for num_threads(nt) schedule(dynamic, chunk)
  for (int64_t t = 0; t < ntiles; ++t) {
    const int64_t mb = t / groups;
    f(mb * MC, std::min(M, mb * MC + MC), t % groups);
  }
}

// Items 0..count-1 in contiguous runs, one per thread of an OpenMP team of up to nthreads: f(first, end).
template <class F>
inline void for_thread_runs(int64_t count, int nthreads, F&& f) {
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, count)));
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    f(count * t / n, count * (t + 1) / n);
  }
}

// One-row decode: panels 0..panels-1 (pbytes bytes each from base) in contiguous runs, one per thread, so that each
// thread streams one sequential run of memory; each thread first asks for the first tuning().row_burst bytes of its
// run at once (else a short GEMV's stream starts from the few lines its prefetch distance covers). f(panel).
template <class F>
inline void for_panel_runs(int64_t panels, int nthreads, const void* base, int64_t pbytes, F&& f) {
  const int64_t burst = tuning().row_burst;
  const bool nta = tuning().row_nta;
  for_thread_runs(panels, nthreads, [&](int64_t p0, int64_t p1) {
    const char* run = static_cast<const char*>(base) + p0 * pbytes;
    const int64_t len = std::min<int64_t>(burst, (p1 - p0) * pbytes);
    for (int64_t o = 0; o < len; o += 64) prefetch_once(run + o, nta);
    for (int64_t p = p0; p < p1; ++p) f(p);
  });
}

// One-row decode over tiles of interleaved panels: tiles 0..tiles-1 in contiguous runs, one per thread, so that
// each of a tile's streams goes on into the same panel of the thread's next tile (prefetch_run). Static, unlike
// for_tiles: a thread preempted by another process holds back its run, which whole decodes still paid for.
// f(tile, next tile or -1).
template <class F>
inline void for_tile_runs(int64_t tiles, int nthreads, F&& f) {
  for_thread_runs(tiles, nthreads, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) f(g, g + 1 < g1 ? g + 1 : -1);
  });
}

// Software prefetch distance for the GEMMs of a batched decode step (up to SMALL_M rows: one row block, each
// tile's weights streamed from memory once); prefill's row blocks are compute-bound and run without.
constexpr int64_t SMALL_M = 32;
constexpr bool PREFETCHING = true;  // the prefetching instances exist; tuning().small_prefetch == 0 skips them
inline bool small_batch_prefetch(int64_t M) { return tuning().small_prefetch > 0 && M <= SMALL_M; }

// y[M, N] = x[M, K] @ W^T (* channel scales) (+ bias) for a panel-layout weight of type W.
// x: fp32 [M][K]. Float path.
template <class W>
void panel_gemm_float(const typename W::T* w, int64_t M, int64_t N, int64_t K, const float* x,
                      const Epilogue& ep, int nthreads) {
  if (M < 4) {
    // decode: 4 panels per call, a few independent streams and accumulator chains per thread
    if ((N / 16) % 4 == 0) {
      // bf16 weights prefetch (tuning().bf16_row_prefetch); fp32 ones measured no faster with it
      const int64_t pf = std::is_same_v<W, PanelBf16> ? tuning().bf16_row_prefetch : 0;
      for_tiles(M, N / 64, M, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
        if (pf > 0) tile_float<W, 4, 2, PREFETCHING>(w, K, x, m0, m1, g, ep, pf);
        else tile_float<W, 4, 2>(w, K, x, m0, m1, g, ep);
      });
      return;
    }
    for_tiles(M, N / 16, M, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      tile_float<W, 1, 2>(w, K, x, m0, m1, g, ep);
    });
    return;
  }
  if constexpr (Isa::MR_ONEPASS > 0) {
    if (M > Isa::MR_BIG && M <= Isa::MR_ONEPASS) {
      const float* xp = pack_kmajor(x, M, K, Isa::MR_ONEPASS);
      const int64_t pstride = (K / W::S) * W::STEP;
      if (tuning().onepass_split && (N / 16) % 2 == 0) {
        for_tiles(1, N / 32, 1, nthreads, [&](int64_t, int64_t, int64_t g) {
          panel_pair_float_12_4<W, 64>(w + 2 * g * pstride, pstride, xp, K, ep, g * 32, int(M),
                                       tuning().onepass_prefetch);
        });
        return;
      }
      for_tiles(1, N / 16, 1, nthreads, [&](int64_t, int64_t, int64_t g) {
        panel_float<W, Isa::MR_ONEPASS, 1, true, true>(w + g * pstride, pstride, xp, 0, K, ep, 0, g * 16,
                                                        int(M), tuning().onepass_prefetch);
      });
      return;
    }
  }
  if ((N / 16) % Isa::NP_BIG == 0 && M > SMALL_M && rows_share_l1_sets(K)) {  // prefill, x packed per row block
    const uint64_t call = ++pack_calls;
    for_tiles(M, N / (16 * Isa::NP_BIG), Isa::MC, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      tile_float_kmajor<W, Isa::NP_BIG, Isa::MR_BIG>(w, K, x, m0, m1, g, ep, call);
    });
  } else if ((N / 16) % Isa::NP_BIG == 0 && M > SMALL_M) {  // prefill, x in place: the wide micro-kernel
    for_tiles(M, N / (16 * Isa::NP_BIG), Isa::MC_WIDE, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      tile_float<W, Isa::NP_BIG, Isa::MR_WIDE>(w, K, x, m0, m1, g, ep);
    });
  } else if ((N / 16) % Isa::NP_BIG == 0) {
    const bool pf = small_batch_prefetch(M);
    for_tiles(M, N / (16 * Isa::NP_BIG), Isa::MC, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      if (pf) tile_float<W, Isa::NP_BIG, Isa::MR_BIG, PREFETCHING>(w, K, x, m0, m1, g, ep, tuning().small_prefetch);
      else tile_float<W, Isa::NP_BIG, Isa::MR_BIG>(w, K, x, m0, m1, g, ep);
    });
  } else {
    for_tiles(M, N / 16, Isa::MC, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      tile_float<W, 1, Isa::MR_BIG>(w, K, x, m0, m1, g, ep);
    });
  }
}

// Int path for int8 panels: xq [M][K] int16 (K even), sx [M].
inline void panel_gemm_int8(const int8_t* w, int64_t M, int64_t N, int64_t K, const int16_t* xq16,
                            const float* sx, const Epilogue& ep, int nthreads) {
  const int32_t* xq = reinterpret_cast<const int32_t*>(xq16);
  const int64_t int8_np = row_streams(tuning().int8_row_panels, N / 16);
  if (M == 1 && int8_np > 1) {
    // decode over int8_row_panels interleaved streams per thread (CPUs whose prefetchers want several)
    const int64_t pstride = K * 16, pf = tuning().int8_row_prefetch, tile = int8_np * pstride;
    for_tile_runs(N / (16 * int8_np), nthreads, [&](int64_t g, int64_t next) {
      const int8_t* wn = next < 0 ? nullptr : w + next * tile;
      if (int8_np == 2) panel_int8<1, 2, true>(w + g * tile, pstride, xq, K / 2, sx, K, ep, 0, g * 32, pf, wn);
      else if (int8_np == 8) panel_int8<1, 8, true>(w + g * tile, pstride, xq, K / 2, sx, K, ep, 0, g * 128, pf, wn);
      else panel_int8<1, 4, true>(w + g * tile, pstride, xq, K / 2, sx, K, ep, 0, g * 64, pf, wn);
    });
    return;
  }
  if (M == 1) {
    // decode: a contiguous run of panels per thread
    const int64_t pstride = K * 16, pf = tuning().row_prefetch;
    for_panel_runs(N / 16, nthreads, w, pstride,
                   [&](int64_t p) { panel_int8_row(w + p * pstride, xq, sx[0], K, ep, p * 16, pf); });
    return;
  }
  if (M < 4 && (N / 16) % 4 == 0) {
    for_tiles(M, N / 64, M, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      tile_int8<4, 2>(w, K, xq, sx, m0, m1, g, ep);
    });
  } else if ((N / 16) % Isa::NP_INT == 0) {
    const bool pf = small_batch_prefetch(M);
    for_tiles(M, N / (16 * Isa::NP_INT), Isa::MC, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      if (pf) tile_int8<Isa::NP_INT, Isa::MR_INT, PREFETCHING>(w, K, xq, sx, m0, m1, g, ep);
      else tile_int8<Isa::NP_INT, Isa::MR_INT>(w, K, xq, sx, m0, m1, g, ep);
    });
  } else {
    for_tiles(M, N / 16, Isa::MC, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      tile_int8<1, Isa::MR_INT>(w, K, xq, sx, m0, m1, g, ep);
    });
  }
}

// bf16 dot path: x bf16 [M][K] (K even).
inline void panel_gemm_bf16dot(const uint16_t* w, int64_t M, int64_t N, int64_t K, const uint16_t* xb,
                               const Epilogue& ep, int nthreads) {
  const int32_t* xp = reinterpret_cast<const int32_t*>(xb);
  if constexpr (Isa::MR_ONEPASS > 0) {
    if (M > Isa::MR_BIG && M <= Isa::MR_ONEPASS) {
      const int32_t* xk = pack_kmajor(xp, M, K / 2, Isa::MR_ONEPASS);
      const int64_t pstride = K * 16;
      for_tiles(1, N / 16, 1, nthreads, [&](int64_t, int64_t, int64_t g) {
        panel_bf16dot_kmajor<Isa::MR_ONEPASS>(w + g * pstride, xk, K, ep, 0, g * 16, int(M));
      });
      return;
    }
  }
  // tuning().bf16_row_panels panels a decode tile where they divide the panels, else the 4 of before
  const int64_t bnp = (N / 16) % tuning().bf16_row_panels == 0 ? tuning().bf16_row_panels : 4;
  if (M < 4 && (N / 16) % bnp == 0) {
    const int64_t pf = tuning().bf16_row_prefetch;
    // tiles of bnp panels (tuning().bf16_row_panels), rows two at a time (16 panels: one, within 32 registers)
    const auto tile = [&](auto np, int64_t m0, int64_t m1, int64_t g) {
      constexpr int NP = decltype(np)::value, MRB = NP == 16 ? 1 : 2;
      if (pf > 0) tile_bf16dot<NP, MRB, PREFETCHING>(w, K, xp, m0, m1, g, ep, pf);
      else tile_bf16dot<NP, MRB>(w, K, xp, m0, m1, g, ep);
    };
    for_tiles(M, N / (16 * bnp), M, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      switch (bnp) {
        case 2: tile(std::integral_constant<int, 2>{}, m0, m1, g); break;
        case 8: tile(std::integral_constant<int, 8>{}, m0, m1, g); break;
        case 16: tile(std::integral_constant<int, 16>{}, m0, m1, g); break;
        default: tile(std::integral_constant<int, 4>{}, m0, m1, g);
      }
    });
  } else if ((N / 16) % Isa::NP_BIG == 0 && M > SMALL_M) {  // prefill: the wide micro-kernel
    for_tiles(M, N / (16 * Isa::NP_BIG), Isa::MC_WIDE, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      tile_bf16dot<Isa::NP_BIG, Isa::MR_WIDE>(w, K, xp, m0, m1, g, ep);
    });
  } else if ((N / 16) % Isa::NP_BIG == 0) {
    const bool pf = small_batch_prefetch(M);
    for_tiles(M, N / (16 * Isa::NP_BIG), Isa::MC, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      if (pf) tile_bf16dot<Isa::NP_BIG, Isa::MR_BIG, PREFETCHING>(w, K, xp, m0, m1, g, ep, tuning().small_prefetch);
      else tile_bf16dot<Isa::NP_BIG, Isa::MR_BIG>(w, K, xp, m0, m1, g, ep);
    });
  } else {
    for_tiles(M, N / 16, Isa::MC, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      tile_bf16dot<1, Isa::MR_BIG>(w, K, xp, m0, m1, g, ep);
    });
  }
}

// The int4 kernels of one rounding of x, for panel_gemm_int4: one row over one panel (row), one row over NP
// interleaved panels (row_panels), and MRB-row tiles (tile).
struct Int4X16 {
  static void row(const Int4W& W, int64_t p, const Int4X& X, const Epilogue& ep, int64_t pf) {
    panel_int4_row(W, p, X.xq, X.sx[0], X.xs, ep, pf);
  }
  template <int NP>
  static void row_panels(const Int4W& W, int64_t p0, const Int4X& X, const Epilogue& ep, int64_t pf,
                         const uint8_t* wnext) {
    panel_int4<1, NP, true>(W, p0, X.xq, W.K / 2, X.sx, X.xs, ep, 0, pf, wnext);
  }
  template <int NP, int MRB, bool PF>
  static void tile(const Int4W& W, const Int4X& X, int64_t m0, int64_t m1, int64_t g, const Epilogue& ep,
                   int64_t pf) {
    tile_int4<NP, MRB, PF>(W, X.xq, X.sx, X.xs, m0, m1, g, ep, pf);
  }
};

struct Int4X8 {
  static void row(const Int4W& W, int64_t p, const Int4X& X, const Epilogue& ep, int64_t pf) {
    panel_int4_row_x8(W, p, X.xq, X.sx, X.xs, ep, pf);
  }
  template <int NP>
  static void row_panels(const Int4W& W, int64_t p0, const Int4X& X, const Epilogue& ep, int64_t pf,
                         const uint8_t* wnext) {
    panel_int4_x8<1, NP, true>(W, p0, X, W.K / 4, ep, 0, pf, wnext);
  }
  template <int NP, int MRB, bool PF>
  static void tile(const Int4W& W, const Int4X& X, int64_t m0, int64_t m1, int64_t g, const Epilogue& ep,
                   int64_t pf) {
    tile_int4_x8<NP, MRB, PF>(W, X, m0, m1, g, ep, pf);
  }
};

// int4 panels (K % 8 == 0), x as Int4X in the rounding of Kern (Int4X16 or Int4X8).
template <class Kern>
inline void panel_gemm_int4(const Int4W& W, int64_t M, int64_t N, const Int4X& X, const Epilogue& ep,
                            int nthreads) {
  const int64_t panels = N / 16;
  const Tuning& tu = tuning();
  const int64_t np = row_streams(tu.row_panels, panels);
  if (M == 1 && np == 1) {
    // decode: a contiguous run of panels per thread
    const int64_t pf = tu.row_prefetch;
    for_panel_runs(panels, nthreads, W.w, W.pbytes(), [&](int64_t p) { Kern::row(W, p, X, ep, pf); });
    return;
  }
  if (M == 1) {  // decode over row_panels interleaved streams per thread (CPUs whose prefetchers want several)
    const int64_t pf = tu.row_prefetch;
    for_tile_runs(panels / np, nthreads, [&](int64_t g, int64_t next) {
      const uint8_t* wn = next < 0 ? nullptr : W.panel(next * np);
      if (np == 2) Kern::template row_panels<2>(W, g * 2, X, ep, pf, wn);
      else if (np == 8) Kern::template row_panels<8>(W, g * 8, X, ep, pf, wn);
      else Kern::template row_panels<4>(W, g * 4, X, ep, pf, wn);
    });
    return;
  }
  const bool pfm = small_batch_prefetch(M);
  const int64_t pf = tu.small_prefetch;
  if (panels % Isa::NP_INT4 == 0) {
    for_tiles(M, panels / Isa::NP_INT4, Isa::MC, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      if (pfm) Kern::template tile<Isa::NP_INT4, Isa::MR_INT4, PREFETCHING>(W, X, m0, m1, g, ep, pf);
      else Kern::template tile<Isa::NP_INT4, Isa::MR_INT4, false>(W, X, m0, m1, g, ep, pf);
    });
  } else {
    for_tiles(M, panels, Isa::MC, nthreads, [&](int64_t m0, int64_t m1, int64_t g) {
      if (pfm) Kern::template tile<1, Isa::MR_INT4, PREFETCHING>(W, X, m0, m1, g, ep, pf);
      else Kern::template tile<1, Isa::MR_INT4, false>(W, X, m0, m1, g, ep, pf);
    });
  }
}
