// kiln CPU linear kernels: y[M,N] = x[M,K] @ dequant(W[N,K])^T (+ bias), x and y fp32.
//
// Weight formats (row-major, one row per output channel):
//   WTYPE_BF16 (0): uint16 bf16 bits [N, K]
//   WTYPE_INT8 (1): int8 [N, K], one fp32 scale per row
//   WTYPE_INT4 (2): uint8 [N, K/2], fp32 scales [N, K/group_size]; two's-complement nibbles
//       (-8..7). K is cut into blocks of 64 elements stored in 32 bytes: the 32-bit little-endian
//       word l (l = 0..7) of a block holds, in its nibble j (bits 4j..4j+3), element
//       k = 64*block + 8*j + l. So one 256-bit load + one shift pair per j gives 8 consecutive
//       elements. (The Python side packs/unpacks this layout; the kernel needs K % 64 == 0.)
//
// Strategy (memory-bound decode first):
//   * Parallel over tiles of 4 output rows (OpenMP, static contiguous ranges per thread).
//   * M <= 4: "direct" GEMV: every weight vector is decoded once in registers and used for all M
//     activation rows; the weights are read exactly once per call and never materialised.
//   * M > 4: per tile and K-chunk of 256, the 4 rows are decoded once into an fp32 L1 buffer and a
//     4x3 register-blocked FMA micro-kernel runs over the M rows (compute-bound regime).
//   * The Python side sends large M (prefill) to kiln_dequant_rows + torch's sgemm instead.
// This file deliberately includes no torch header (it compiles in ~2 s) and exposes a C ABI used
// through ctypes. OpenMP resolves to the libgomp that torch already loaded (same soname).

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int WTYPE_BF16 = 0;
constexpr int WTYPE_INT8 = 1;
constexpr int WTYPE_INT4 = 2;

constexpr int RT = 4;           // output rows per tile
constexpr int KCV = 32;         // vectors (of 8) per K-chunk in the buffered kernel -> 256 floats
constexpr int64_t MAX_M = 64;   // largest M the kernels accept (Python sends bigger M to sgemm)

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  lo = _mm_add_ss(lo, sh);
  return _mm_cvtss_f32(lo);
}

inline float bf16_bits_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct NoCtx {};

struct WBf16 {
  const uint16_t* w;
  int64_t K;
  static constexpr bool grouped = false;
  using Ctx = NoCtx;
  inline Ctx prep(int64_t) const { return {}; }
  inline __m256 load(int64_t n, int64_t i, Ctx) const {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * K + 8 * i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  inline float scalar(int64_t n, int64_t k) const { return bf16_bits_to_f32(w[n * K + k]); }
  inline float row_scale(int64_t) const { return 1.0f; }
  inline float group_scale(int64_t, int64_t) const { return 1.0f; }
  int64_t group_vecs() const { return 0; }
};

struct WInt8 {
  const int8_t* w;
  const float* s;
  int64_t K;
  static constexpr bool grouped = false;
  using Ctx = NoCtx;
  inline Ctx prep(int64_t) const { return {}; }
  inline __m256 load(int64_t n, int64_t i, Ctx) const {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + n * K + 8 * i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  inline float scalar(int64_t n, int64_t k) const { return float(w[n * K + k]); }
  inline float row_scale(int64_t n) const { return s[n]; }
  inline float group_scale(int64_t, int64_t) const { return 1.0f; }
  int64_t group_vecs() const { return 0; }
};

struct WInt4 {
  const uint8_t* w;
  const float* s;
  int64_t K;
  int64_t gs;
  int64_t ngroups;
  static constexpr bool grouped = true;
  struct Ctx {
    __m128i cnt;
  };
  inline Ctx prep(int64_t i) const { return {_mm_cvtsi32_si128(int(28 - 4 * (i & 7)))}; }
  inline __m256 load(int64_t n, int64_t i, Ctx c) const {
    __m256i word =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * (K / 2) + (i >> 3) * 32));
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sll_epi32(word, c.cnt), 28));
  }
  inline float scalar(int64_t, int64_t) const { return 0.0f; }  // K % 64 == 0: no tail
  inline float row_scale(int64_t) const { return 1.0f; }
  inline float group_scale(int64_t n, int64_t g) const { return s[n * ngroups + g]; }
  int64_t group_vecs() const { return gs / 8; }
};

// ---- direct GEMV: R rows x MB activation rows, weights decoded once in registers --------------
template <class W, int R, int MB>
inline void tile_direct(const W& w, int64_t n0, const float* x, int64_t K, float* out, int ldo) {
  const int64_t nvec = K / 8;
  const int64_t gvec = W::grouped ? w.group_vecs() : nvec;
  __m256 tot[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) tot[r][m] = _mm256_setzero_ps();
  int64_t g = 0;
  for (int64_t g0 = 0; g0 < nvec; g0 += gvec, ++g) {
    const int64_t g1 = std::min(g0 + gvec, nvec);
    __m256 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t i = g0; i < g1; ++i) {
      const auto c = w.prep(i);
      __m256 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * K + 8 * i);
      for (int r = 0; r < R; ++r) {
        const __m256 v = w.load(n0 + r, i, c);
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_fmadd_ps(v, xv[m], acc[r][m]);
      }
    }
    if constexpr (W::grouped) {
      for (int r = 0; r < R; ++r) {
        const __m256 sc = _mm256_set1_ps(w.group_scale(n0 + r, g));
        for (int m = 0; m < MB; ++m) tot[r][m] = _mm256_fmadd_ps(acc[r][m], sc, tot[r][m]);
      }
    } else {
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) tot[r][m] = acc[r][m];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      float v = hsum(tot[r][m]);
      for (int64_t k = nvec * 8; k < K; ++k) v += w.scalar(n0 + r, k) * x[m * K + k];
      out[m * ldo + r] = v;
    }
}

// ---- buffered: decode R rows x 256 once into L1, then a register-blocked fp32 micro-kernel ----
template <int R, int MB>
inline void dense_block(const float* buf, int64_t nv, const float* xp, int64_t ldx, __m256* tot) {
  __m256 acc[R][MB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[r][m] = tot[m * R + r];
  for (int64_t j = 0; j < nv; ++j) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(xp + m * ldx + 8 * j);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_load_ps(buf + r * (KCV * 8) + 8 * j);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) tot[m * R + r] = acc[r][m];
}

template <class W, int R>
inline void tile_buffered(const W& w, int64_t n0, const float* x, int64_t M, int64_t K,
                          float* out, int ldo, float* buf, __m256* tot) {
  const int64_t nvec = K / 8;
  for (int64_t q = 0; q < M * R; ++q) tot[q] = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < nvec; c0 += KCV) {
    const int64_t c1 = std::min<int64_t>(c0 + KCV, nvec);
    for (int64_t i = c0; i < c1; ++i) {
      const auto c = w.prep(i);
      for (int r = 0; r < R; ++r) {
        __m256 v = w.load(n0 + r, i, c);
        if constexpr (W::grouped) v = _mm256_mul_ps(v, _mm256_set1_ps(w.group_scale(n0 + r, (8 * i) / w.gs)));
        _mm256_store_ps(buf + r * (KCV * 8) + 8 * (i - c0), v);
      }
    }
    const int64_t nv = c1 - c0;
    const float* xp = x + 8 * c0;
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) dense_block<R, 3>(buf, nv, xp + m * K, K, tot + m * R);
    if (M - m == 2) dense_block<R, 2>(buf, nv, xp + m * K, K, tot + m * R);
    else if (M - m == 1) dense_block<R, 1>(buf, nv, xp + m * K, K, tot + m * R);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float v = hsum(tot[m * R + r]);
      for (int64_t k = nvec * 8; k < K; ++k) v += w.scalar(n0 + r, k) * x[m * K + k];
      out[m * ldo + r] = v;
    }
}

template <class W, int R>
inline void tile(const W& w, int64_t n0, const float* x, int64_t M, int64_t K, float* out,
                 float* buf, __m256* tot) {
  // out is [M][RT] (ldo = RT), rows n0..n0+R
  switch (M) {
    case 1: tile_direct<W, R, 1>(w, n0, x, K, out, RT); return;
    case 2: tile_direct<W, R, 2>(w, n0, x, K, out, RT); return;
    case 3: tile_direct<W, R, 3>(w, n0, x, K, out, RT); return;
    case 4:
      if constexpr (R % 2 == 0) {
        for (int h = 0; h < R; h += 2) tile_direct<W, 2, 4>(w, n0 + h, x, K, out + h, RT);
      } else {
        tile_direct<W, R, 4>(w, n0, x, K, out, RT);
      }
      return;
    default: tile_buffered<W, R>(w, n0, x, M, K, out, RT, buf, tot); return;
  }
}

template <class W>
void run_linear(const W& w, const float* x, int64_t M, int64_t N, int64_t K, const float* bias,
                float* y, int nthreads) {
  const int64_t ntiles = (N + RT - 1) / RT;
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, ntiles)));
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    const int nth = omp_get_num_threads();
    const int64_t t0 = ntiles * tid / nth, t1 = ntiles * (tid + 1) / nth;
    alignas(32) float buf[RT * KCV * 8];
    alignas(32) __m256 tot[MAX_M * RT];
    alignas(32) float out[MAX_M * RT];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * RT;
      const int rows = int(std::min<int64_t>(RT, N - n0));
      if (rows == RT) {
        tile<W, RT>(w, n0, x, M, K, out, buf, tot);
      } else {
        for (int r = 0; r < rows; ++r) tile<W, 1>(w, n0 + r, x, M, K, out + r, buf, tot);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int r = 0; r < rows; ++r) {
          const int64_t n = n0 + r;
          y[m * N + n] = out[m * RT + r] * w.row_scale(n) + (bias ? bias[n] : 0.0f);
        }
    }
  }
}

template <class W>
void run_dequant(const W& w, int64_t K, int64_t n0, int64_t n1, float* out, int nthreads) {
  const int64_t nvec = K / 8;
  const int64_t rows = n1 - n0;
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, rows)));
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t n = n0; n < n1; ++n) {
    float* o = out + (n - n0) * K;
    const float rs = w.row_scale(n);
    const __m256 rsv = _mm256_set1_ps(rs);
    for (int64_t i = 0; i < nvec; ++i) {
      __m256 v = w.load(n, i, w.prep(i));
      if constexpr (W::grouped) v = _mm256_mul_ps(v, _mm256_set1_ps(w.group_scale(n, (8 * i) / w.gs)));
      _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(v, rsv));
    }
    for (int64_t k = nvec * 8; k < K; ++k) o[k] = w.scalar(n, k) * rs;
  }
}

}  // namespace

extern "C" {

int kiln_wol_abi_version() { return 1; }

int kiln_wol_max_m() { return int(MAX_M); }

// Returns 0 on success, a positive code when the case is not supported (caller falls back).
int kiln_linear(int wtype, const void* w, const float* scales, int64_t group_size,
                const float* x, int64_t M, int64_t N, int64_t K, const float* bias, float* y,
                int nthreads) {
  if (M < 1 || M > MAX_M || N < 1 || K < 1) return 1;
  switch (wtype) {
    case WTYPE_BF16: run_linear(WBf16{static_cast<const uint16_t*>(w), K}, x, M, N, K, bias, y, nthreads); return 0;
    case WTYPE_INT8: run_linear(WInt8{static_cast<const int8_t*>(w), scales, K}, x, M, N, K, bias, y, nthreads); return 0;
    case WTYPE_INT4:
      if (K % 64 != 0 || group_size <= 0 || group_size % 8 != 0 || K % group_size != 0) return 2;
      run_linear(WInt4{static_cast<const uint8_t*>(w), scales, K, group_size, K / group_size}, x, M, N, K, bias, y, nthreads);
      return 0;
    default: return 3;
  }
}

// Dequantize rows [n0, n1) to fp32 out[(n - n0) * K + k].
int kiln_dequant_rows(int wtype, const void* w, const float* scales, int64_t group_size,
                      int64_t N, int64_t K, int64_t n0, int64_t n1, float* out, int nthreads) {
  if (n0 < 0 || n1 > N || n0 > n1) return 1;
  switch (wtype) {
    case WTYPE_BF16: run_dequant(WBf16{static_cast<const uint16_t*>(w), K}, K, n0, n1, out, nthreads); return 0;
    case WTYPE_INT8: run_dequant(WInt8{static_cast<const int8_t*>(w), scales, K}, K, n0, n1, out, nthreads); return 0;
    case WTYPE_INT4:
      if (K % 64 != 0 || group_size <= 0 || group_size % 8 != 0 || K % group_size != 0) return 2;
      run_dequant(WInt4{static_cast<const uint8_t*>(w), scales, K, group_size, K / group_size}, K, n0, n1, out, nthreads);
      return 0;
    default: return 3;
  }
}

}  // extern "C"
