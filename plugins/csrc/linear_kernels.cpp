// kiln CPU linear kernels: y[M,N] = x[M,K] @ dequant(W[N,K])^T (+ bias), x and y fp32 (or both bf16).
//
// Weight formats (row-major, one row per output channel; the ids are kiln_kernels.h's KILN_W_*):
//   BF16: uint16 bf16 bits [N, K]
//   FP32: fp32 [N, K] (plain GEMV: torch's fp32 GEMV reads with one stream per core, which on Zen 1
//         reaches ~70% of the bandwidth that 8 streams per core reach)
//   BF16_PACKED, FP32_PACKED, INT8_PACKED: the same values in tiles of 8 rows, [N/8][K/16][8][16]
//         (N % 8 == 0, K % 16 == 0; see WFloat)
//   INT8: int8 [N, K], one fp32 scale per row
//   INT4: uint8 [N, K/2], fp32 scales [N, K/group_size]; two's-complement nibbles
//       (-8..7). K is cut into blocks of 64 elements stored in 32 bytes: the little-endian 16-bit
//       word l (l = 0..15) of a block holds, in its nibble j (bits 4j..4j+3), element
//       k = 64*block + 16*j + l. One 256-bit load + two 16-bit shifts give 16 consecutive
//       elements. (kiln/plugins/weight_format.py packs/unpacks this layout; the kernel needs K % 64 == 0.)
//
// Why it looks like this (AMD Zen 1, AVX2 on 128-bit units; every 256-bit op costs about one
// cycle and int->float conversions are the bottleneck, not the FMAs):
//   * M <= 4 ("direct" GEMV, decode): weights are read once and never materialised.
//       bf16: a 32-byte load holds 16 weights; the odd ones are already fp32 bit patterns after a
//             single AND, the even ones after one shift. x is de-interleaved once per call to match.
//       int8/int4: activations are quantised once per call to int16 with one scale per row
//             (error <= max|x_row| / 65534, far below the weight quantisation error), and the dot
//             products run in integers: vpmovsxbw (int8) or two 16-bit shifts (int4), vpmaddwd,
//             vpaddd; int32 partial sums are flushed to fp32 every 128 steps (no overflow) or at
//             each int4 group end (times the group scale).
//   * M > 4 ("buffered"): per tile of 4 rows and K-chunk of 256, the rows are decoded once into an
//     fp32 L1 buffer, then a 4x3 register-blocked FMA micro-kernel runs over the M rows.
//   * From memory the kernels are limited by how many lines are in flight, not by the bus: fp32/bf16
//     read 8 rows at once, packed (one stream per tile, prefetched 1 KiB ahead in software) or
//     plain (8 streams; bf16 also prefetches the next 8 rows); packed int8 reads its tiles the same
//     way; plain int8 and int4 (more work per byte) read one row after the other, a single
//     sequential stream the hardware prefetcher follows.
//   * Callers cut M > KILN_MAX_M (64) into 64-row calls, and send M above the kind's limit (bf16: 64,
//     kiln_ops_max_m) to kiln_dequant_rows + torch's sgemm instead.
//   * Parallel over tiles of 8 output rows (OpenMP, dynamic chunks of ~1/16 of a thread's share).
// This file deliberately includes no torch header (it compiles in ~3 s) and exposes a C ABI used
// through ctypes. OpenMP resolves to the libgomp that torch already loaded (same soname).

#include "kiln_kernels.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#ifndef KILN_BUILD_KEY
#define KILN_BUILD_KEY unset
#endif

namespace {

constexpr int RT = KILN_ROW_TILE;  // output rows per tile
constexpr int KCV = 16;          // 16-element units per K-chunk in the buffered kernel -> 256 floats
constexpr int KC = KCV * 16;
constexpr int64_t MAX_M = KILN_MAX_M;  // largest M the kernels accept
constexpr int64_t DIRECT_M = 4;  // M up to this uses the direct kernels, in passes of up to 4 rows
constexpr int64_t FLUSH = 128;   // int8: int32 partial sums are flushed every FLUSH 16-element steps
static_assert(KILN_K_STEP == 16, "the kernels step through K 16 elements at a time");

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  lo = _mm_add_ss(lo, sh);
  return _mm_cvtss_f32(lo);
}

// round to nearest even, NaN -> quiet NaN: the same bits as torch's float -> bfloat16 conversion
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_bits_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- weight types ------------------------------------------------------------------------------
// decode16f(n, i, lo, hi): elements 16i..16i+7 -> lo, 16i+8..16i+15 -> hi, fp32, group scale applied
// load16(n, i, ctx):       (int types) elements 16i..16i+15 as int16 (no scale)

// Offset of element (n, 16i) of a weight [N][K], plain or packed in tiles of 8 rows ([N/8][K/16][8][16])
template <bool P>
inline int64_t elem_offset(int64_t n, int64_t i, int64_t K) {
  if constexpr (P) return (n >> 3) * 8 * K + i * 128 + (n & 7) * 16;
  else return n * K + 16 * i;
}

// Float weights: plain [N][K], or packed (P): tiles of 8 rows stored as [N/8][K/16][8][16], so
// the 8 rows a GEMV tile reads at step i are 128 consecutive elements and a tile is one sequential
// stream. Plain rows of K=1024 lie 2 KiB (bf16) / 4 KiB (fp32) apart: the 8 streams of a tile then
// share L1 sets, and the hardware prefetcher tracks 8 short streams instead of one; packed, the bf16
// GEMVs of the 311M Llama's shapes stream 22-24 GB/s from memory instead of 18-19 (2 threads).
template <class T, bool P>
struct WFloat {
  const T* w;
  int64_t K;
  static constexpr bool is_float = true;
  static constexpr bool row_addressed = true;  // at(), row_stride(), step_stride, decode16f_at()
  static constexpr bool is_bf16 = std::is_same_v<T, uint16_t>;
  static constexpr bool packed = P;
  static constexpr bool grouped = false;
  static constexpr int64_t step_stride = P ? 128 : 16;  // elements from step i to i + 1 of a row
  // Row r of a call's rows n0..n0+R-1 (packed: within one tile of 8) is at at(n0, 0) + r * row_stride().
  inline int64_t row_stride() const { return P ? 16 : K; }
  inline const T* at(int64_t n, int64_t i) const { return w + elem_offset<P>(n, i, K); }
  inline void decode16f(int64_t n, int64_t i, __m256& lo, __m256& hi) const { decode16f_at(at(n, i), lo, hi); }
  static inline void decode16f_at(const T* p, __m256& lo, __m256& hi) {
    if constexpr (is_bf16) {
      lo = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
      hi = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))), 16));
    } else {
      lo = _mm256_loadu_ps(p);
      hi = _mm256_loadu_ps(p + 8);
    }
  }
  inline float scalar(int64_t n, int64_t k) const {
    const T v = at(n, k / 16)[k % 16];
    if constexpr (is_bf16) return bf16_bits_to_f32(v);
    else return v;
  }
  inline float row_scale(int64_t) const { return 1.0f; }
};
using WBf16 = WFloat<uint16_t, false>;
using WBf16Packed = WFloat<uint16_t, true>;
using WF32 = WFloat<float, false>;
using WF32Packed = WFloat<float, true>;

// int8 weights: plain [N][K] or packed (P) in tiles of 8 rows, [N/8][K/16][8][16], as WFloat
template <bool P>
struct WInt8T {
  const int8_t* w;
  const float* s;
  int64_t K;
  static constexpr bool is_float = false;
  static constexpr bool row_addressed = true;
  static constexpr bool is_bf16 = false;
  static constexpr bool packed = P;
  static constexpr bool grouped = false;
  struct Ctx {};
  inline Ctx prep(int64_t) const { return {}; }
  static constexpr int64_t step_stride = P ? 128 : 16;
  inline int64_t row_stride() const { return P ? 16 : K; }
  inline const int8_t* at(int64_t n, int64_t i) const { return w + elem_offset<P>(n, i, K); }
  inline __m256i load16(int64_t n, int64_t i, Ctx) const {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at(n, i))));
  }
  inline void decode16f(int64_t n, int64_t i, __m256& lo, __m256& hi) const { decode16f_at(at(n, i), lo, hi); }
  static inline void decode16f_at(const int8_t* p, __m256& lo, __m256& hi) {
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
  inline float scalar(int64_t n, int64_t k) const { return float(at(n, k / 16)[k % 16]); }
  inline float row_scale(int64_t n) const { return s[n]; }
  inline float group_scale(int64_t, int64_t) const { return 1.0f; }
  int64_t seg_steps() const { return FLUSH; }
};
using WInt8 = WInt8T<false>;
using WInt8Packed = WInt8T<true>;

struct WInt4 {
  const uint8_t* w;
  const float* s;
  int64_t K;
  int64_t gs;
  int64_t ngroups;
  static constexpr bool is_float = false;
  static constexpr bool row_addressed = false;
  static constexpr bool is_bf16 = false;
  static constexpr bool packed = false;
  static constexpr bool grouped = true;
  struct Ctx {
    __m128i cnt;
  };
  inline Ctx prep(int64_t i) const { return {_mm_cvtsi32_si128(int(12 - 4 * (i & 3)))}; }
  inline __m256i load16(int64_t n, int64_t i, Ctx c) const {
    const __m256i word =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * (K / 2) + (i >> 2) * 32));
    return _mm256_srai_epi16(_mm256_sll_epi16(word, c.cnt), 12);
  }
  inline void decode16f(int64_t n, int64_t i, __m256& lo, __m256& hi) const {
    const __m256i v = load16(n, i, prep(i));
    const __m256 sc = _mm256_set1_ps(s[n * ngroups + (16 * i) / gs]);
    lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v))), sc);
    hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1))), sc);
  }
  inline float scalar(int64_t, int64_t) const { return 0.0f;  }  // K % 64 == 0: no tail
  inline float row_scale(int64_t) const { return 1.0f; }
  inline float group_scale(int64_t n, int64_t g) const { return s[n * ngroups + g]; }
  int64_t seg_steps() const { return gs / 16; }
};

template <class W>
constexpr bool is_float_w = W::is_float;

// Software prefetch in the float direct kernels, at step i of rows n0..n0+R-1 (row pointer p):
//   packed weights: the same rows' bytes PREFETCH_AHEAD bytes further along the tile's stream, with
//     the non-temporal hint (into L1, not kept in L2: the weights are read once per call). Without
//     it the hardware prefetcher keeps too few lines in flight once the kernel spends a few cycles
//     per line (bf16 311M-Llama shapes, 2 threads: 19 GB/s without, 22-24 with; T0 hint 21-22;
//     512 bytes ahead 21-22, 2048 20).
//   plain bf16: the next R rows (one contiguous block) at the same pace, R*32 bytes per step
//     (15-18 GB/s without, 17-22 with).
//   plain fp32: none (rows of K=1024 are 4 KiB apart; prefetched lines compete for the L1 sets of
//     the ones being read: 10-15% slower with any prefetch).
// The address may lie past the weights: integer arithmetic (no out-of-range pointer), and a
// prefetch never faults.
constexpr int PREFETCH_AHEAD = 1024;

template <class W, int R>
inline void prefetch_ahead(const W& w, int64_t n0, int64_t i, const void* p) {
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(w.w)>>;
  if constexpr (W::packed) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p) + PREFETCH_AHEAD;
    for (int j = 0; j < R * 16 * int(sizeof(T)); j += 64) _mm_prefetch(reinterpret_cast<const char*>(a + j), _MM_HINT_NTA);
  } else if constexpr (W::is_bf16) {
    const uintptr_t nxt = reinterpret_cast<uintptr_t>(w.w) + uintptr_t((n0 + R) * w.K * 2 + i * (R * 32));
    for (int j = 0; j < R * 32; j += 64) _mm_prefetch(reinterpret_cast<const char*>(nxt + j), _MM_HINT_T0);
  }
}

// ---- per-call activation preprocessing ---------------------------------------------------------

struct XPrep {
  const float* x;     // original fp32 [M][K]
  const float* xp;    // bf16 path: [M][K16*16], per 16-block even elements then odd elements
  const int16_t* xq;  // int path: [M][K16*16] int16
  const float* sx;    // int path: [M] scale of xq
};

// even/odd de-interleave per 16-element block (matches the bf16 AND/shift decode)
void prep_bf16(const float* x, int64_t M, int64_t K, float* xp) {
  const int64_t K16 = K / 16;
  const __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < K16; ++i) {
      const float* s = x + m * K + 16 * i;
      __m256 a = _mm256_permutevar8x32_ps(_mm256_loadu_ps(s), idx);      // e0..e3 o0..o3
      __m256 b = _mm256_permutevar8x32_ps(_mm256_loadu_ps(s + 8), idx);  // e4..e7 o4..o7
      float* d = xp + m * K16 * 16 + 16 * i;
      _mm256_storeu_ps(d, _mm256_permute2f128_ps(a, b, 0x20));
      _mm256_storeu_ps(d + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
}

// symmetric int16 per row: xq = round(x / sx), sx = max|x| / 32767. Returns false if x holds a
// NaN or an infinity (the caller then computes in fp32, so they propagate like in the reference).
bool prep_int16(const float* x, int64_t M, int64_t K, int16_t* xq, float* sx) {
  const int64_t K16 = K / 16;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    __m256 mx = _mm256_setzero_ps();
    __m256 bad = _mm256_setzero_ps();  // x * 0 is NaN iff x is NaN or +-inf
    int64_t k = 0;
    for (; k + 8 <= K16 * 16; k += 8) {
      const __m256 v = _mm256_loadu_ps(r + k);
      mx = _mm256_max_ps(mx, _mm256_and_ps(v, absmask));
      bad = _mm256_add_ps(bad, _mm256_mul_ps(v, _mm256_setzero_ps()));
    }
    if (hsum(bad) != 0.0f) return false;  // NaN != 0
    alignas(32) float t[8];
    _mm256_store_ps(t, mx);
    float amax = 0.0f;
    for (float v : t) amax = std::max(amax, v);
    const float s = amax > 0.0f ? amax / 32767.0f : 1.0f;
    sx[m] = s;
    const __m256 inv = _mm256_set1_ps(1.0f / s);
    const __m256 lim = _mm256_set1_ps(32767.0f);
    for (int64_t i = 0; i < K16; ++i) {
      __m256 a = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(r + 16 * i), inv), _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
      __m256 b = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(r + 16 * i + 8), inv), _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
      __m256i p = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K16 * 16 + 16 * i), _mm256_permute4x64_epi64(p, 0xD8));
    }
  }
  return true;
}

// ---- direct kernels (M <= 4) ---------------------------------------------------------------------

// fp32 and bf16 weights. bf16: a 32-byte load holds 16 weights; the odd ones are fp32 bit patterns
// after one AND, the even ones after one shift, and x was de-interleaved to match (prep_bf16).
template <class W, int R, int MB>
inline void direct_float(const W& w, int64_t n0, const XPrep& xs, int64_t K, float* out, int ldo) {
  // M == 1: two accumulator sets (even/odd halves) for more independent FMA chains; else one set.
  constexpr int NA = (MB == 1 && R < 8) ? 2 : 1;
  const int64_t K16 = K / 16;
  const float* xv = W::is_bf16 ? xs.xp : xs.x;  // row m of x at xv + m * ldx
  const int64_t ldx = W::is_bf16 ? K16 * 16 : K;
  const __m256i himask = _mm256_set1_epi32(int(0xFFFF0000u));
  __m256 acc[NA][R][MB];
  for (int a = 0; a < NA; ++a)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[a][r][m] = _mm256_setzero_ps();
  const auto* base = w.at(n0, 0);
  const int64_t rs = w.row_stride();
  for (int64_t i = 0; i < K16; ++i) {
    const auto* q = base + i * W::step_stride;
    prefetch_ahead<W, R>(w, n0, i, q);
    __m256 x0[MB], x1[MB];
    for (int m = 0; m < MB; ++m) {
      x0[m] = _mm256_loadu_ps(xv + m * ldx + 16 * i);
      x1[m] = _mm256_loadu_ps(xv + m * ldx + 16 * i + 8);
    }
    for (int r = 0; r < R; ++r) {
      __m256 v0, v1;
      if constexpr (W::is_bf16) {
        const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * rs));
        v0 = _mm256_castsi256_ps(_mm256_slli_epi32(word, 16));    // even elements
        v1 = _mm256_castsi256_ps(_mm256_and_si256(word, himask));  // odd elements
      } else {
        v0 = _mm256_loadu_ps(q + r * rs);
        v1 = _mm256_loadu_ps(q + r * rs + 8);
      }
      for (int m = 0; m < MB; ++m) {
        acc[0][r][m] = _mm256_fmadd_ps(v0, x0[m], acc[0][r][m]);
        acc[NA - 1][r][m] = _mm256_fmadd_ps(v1, x1[m], acc[NA - 1][r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      __m256 t = acc[0][r][m];
      if constexpr (NA == 2) t = _mm256_add_ps(t, acc[1][r][m]);
      float v = hsum(t);
      for (int64_t k = K16 * 16; k < K; ++k) v += w.scalar(n0 + r, k) * xs.x[m * K + k];
      out[m * ldo + r] = v;
    }
}

template <class W, int R, int MB>
inline void direct_int(const W& w, int64_t n0, const XPrep& xs, int64_t K, float* out, int ldo) {
  const int64_t K16 = K / 16;
  const int64_t seg = w.seg_steps();
  __m256 tot[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) tot[r][m] = _mm256_setzero_ps();
  int64_t g = 0;
  for (int64_t s0 = 0; s0 < K16; s0 += seg, ++g) {
    const int64_t s1 = std::min(s0 + seg, K16);
    __m256i acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_si256();
    for (int64_t i = s0; i < s1; ++i) {
      if constexpr (W::packed) prefetch_ahead<W, R>(w, n0, i, w.at(n0, i));
      const auto c = w.prep(i);
      __m256i xv[MB];
      for (int m = 0; m < MB; ++m)
        xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs.xq + m * K16 * 16 + 16 * i));
      for (int r = 0; r < R; ++r) {
        const __m256i v = w.load16(n0 + r, i, c);
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_add_epi32(acc[r][m], _mm256_madd_epi16(v, xv[m]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 sc = _mm256_set1_ps(w.group_scale(n0 + r, g));
      for (int m = 0; m < MB; ++m) tot[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][m]), sc, tot[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      float v = hsum(tot[r][m]) * xs.sx[m];
      for (int64_t k = K16 * 16; k < K; ++k) v += w.scalar(n0 + r, k) * xs.x[m * K + k];
      out[m * ldo + r] = v;
    }
}

// ---- buffered kernel (M > 4): decode R rows x 256 once into L1, then fp32 FMA micro-kernel ----

template <int R, int MB>
inline void dense_block(const float* buf, int64_t nv, const float* xp, int64_t ldx, __m256* tot) {
  __m256 acc[R][MB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[r][m] = tot[m * R + r];
  for (int64_t j = 0; j < nv; ++j) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(xp + m * ldx + 8 * j);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_load_ps(buf + r * KC + 8 * j);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) tot[m * R + r] = acc[r][m];
}

template <class W, int R>
inline void tile_buffered(const W& w, int64_t n0, const float* x, int64_t M, int64_t K,
                          float* out, int ldo, float* buf, __m256* tot) {
  constexpr int G = R < 4 ? R : 4;
  const int64_t K16 = K / 16;
  for (int64_t q = 0; q < M * R; ++q) tot[q] = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < K16; c0 += KCV) {
    const int64_t c1 = std::min<int64_t>(c0 + KCV, K16);
    if constexpr (W::row_addressed) {
      // row pointers by stride, not from (n, i) per 16 elements (packed tiles: the R rows of a step
      // are contiguous)
      const auto* base = w.at(n0, c0);
      const int64_t rs = w.row_stride();
      for (int64_t i = c0; i < c1; ++i) {
        const auto* p = base + (i - c0) * W::step_stride;
        for (int r = 0; r < R; ++r) {
          __m256 lo, hi;
          W::decode16f_at(p + r * rs, lo, hi);
          _mm256_store_ps(buf + r * KC + 16 * (i - c0), lo);
          _mm256_store_ps(buf + r * KC + 16 * (i - c0) + 8, hi);
        }
      }
    } else {
      for (int64_t i = c0; i < c1; ++i)
        for (int r = 0; r < R; ++r) {
          __m256 lo, hi;
          w.decode16f(n0 + r, i, lo, hi);
          _mm256_store_ps(buf + r * KC + 16 * (i - c0), lo);
          _mm256_store_ps(buf + r * KC + 16 * (i - c0) + 8, hi);
        }
    }
    const int64_t nv = 2 * (c1 - c0);
    const float* xp = x + 16 * c0;
    // packed 8-row tiles: the next chunk (or the next tile) is one contiguous block; its lines are
    // prefetched a few at a time between the micro-kernel calls, while this chunk is computed. (One
    // sequential stream is not followed far enough by the hardware prefetcher: without this, packed
    // fp32 at M=16 took 4.4 ms per 5632x1024 GEMM against 3.7 for the plain layout; with it 3.6-3.7.)
    uintptr_t pf = 0, pf_end = 0;
    int64_t pf_step = 0;
    if constexpr (W::packed && R == RT) {
      pf = reinterpret_cast<uintptr_t>(w.at(n0, c1));
      pf_end = pf + uintptr_t(KCV * W::step_stride * sizeof(*w.w));
      const int64_t calls = (R / G) * std::max<int64_t>(1, M / 3);  // the 3-row micro-kernel calls below
      pf_step = ((int64_t(pf_end - pf) / 64 + calls - 1) / calls) * 64;
    }
    // the micro-kernel takes G rows: tot is [R/G][M][G]; each block of 3 rows of x is used for all
    // R/G row groups while it is in L1
    int64_t m = 0;
    for (; m + 3 <= M; m += 3)
      for (int g0 = 0; g0 < R; g0 += G) {
        for (const uintptr_t e = std::min(pf + pf_step, pf_end); pf < e; pf += 64)
          _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T0);
        dense_block<G, 3>(buf + g0 * KC, nv, xp + m * K, K, tot + (g0 / G) * M * G + m * G);
      }
    for (int g0 = 0; g0 < R; g0 += G) {
      if (M - m == 2) dense_block<G, 2>(buf + g0 * KC, nv, xp + m * K, K, tot + (g0 / G) * M * G + m * G);
      else if (M - m == 1) dense_block<G, 1>(buf + g0 * KC, nv, xp + m * K, K, tot + (g0 / G) * M * G + m * G);
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float v = hsum(tot[(r / G) * M * G + m * G + r % G]);
      for (int64_t k = K16 * 16; k < K; ++k) v += w.scalar(n0 + r, k) * x[m * K + k];
      out[m * ldo + r] = v;
    }
}

// ---- dispatch ----------------------------------------------------------------------------------

template <class W, int R, int MB>
inline void direct(const W& w, int64_t n0, const XPrep& xs, int64_t K, float* out, int ldo) {
  if constexpr (is_float_w<W>) direct_float<W, R, MB>(w, n0, xs, K, out, ldo);
  else direct_int<W, R, MB>(w, n0, xs, K, out, ldo);
}

inline XPrep shift_rows(const XPrep& xs, int64_t m0, int64_t K) {
  const int64_t K16 = K / 16;
  XPrep part = xs;
  part.x = xs.x + m0 * K;
  if (xs.xp) part.xp = xs.xp + m0 * K16 * 16;
  if (xs.xq) part.xq = xs.xq + m0 * K16 * 16;
  part.sx = xs.sx + m0;
  return part;
}

// Rows per call of the int kernels at M = 3..4: plain int8 one row (a sequential stream; 3 and 4
// rows of x over 2 rows at once streamed 5 GB/s from memory, one row 7.5-8.5 GB/s); packed int8 two
// (its rows are interleaved: 2 rows 6.9 GB/s, 1 row 6.2); int4 two (one measured no faster: its
// unpacking, not the stream, limits it).
template <class W>
constexpr int kIntRowsM34 = std::is_same_v<W, WInt8> ? 1 : 2;

template <class W, int R>
inline void direct_rows(const W& w, int64_t n0, const XPrep& xs, int64_t M, int64_t K, float* out) {
  // M in 1..4, out is [M][RT]; about 8 accumulators per call (M=1: bf16/fp32 stream 8 rows
  // together, which measured faster from memory than 4; int8/int4 read one row at a time)
  if constexpr (R == RT && W::packed) {
    // one pass over the tile (one sequential stream) per 2 rows of x; the tile (8 KiB int8, 16 KiB
    // bf16, 32 KiB fp32) is re-read from L1/L2 by the next pass. From memory, 311M Llama shapes:
    // bf16 M=2 21 GB/s (plain, 4-row halves: 17.5); int8 M=1 20 GB/s (plain, one row at a time:
    // 13-15), M=2 12 (8). int8 at M = 3..4 reads one row at a time as in the plain layout (7 GB/s;
    // 8-row passes: 6).
    if (is_float_w<W> || M <= 2) {
      for (int64_t m0 = 0; m0 < M; m0 += 2) {
        const XPrep part = shift_rows(xs, m0, K);
        if (M - m0 >= 2) direct<W, R, 2>(w, n0, part, K, out + m0 * RT, RT);
        else direct<W, R, 1>(w, n0, part, K, out + m0 * RT, RT);
      }
      return;
    }
  }
  if constexpr (R == RT) {
    switch (M) {
      case 1:
        if constexpr (is_float_w<W>) {
          direct<W, R, 1>(w, n0, xs, K, out, RT);
        } else {
          // one row at a time: the weights are then read as one sequential stream, which the
          // hardware prefetcher follows; 4 rows at once (4 short streams of K bytes) streamed
          // int8 at 8.5 vs 14 GB/s from memory (32000x1024, 2 threads; same speed in cache)
          for (int h = 0; h < R; ++h) direct<W, 1, 1>(w, n0 + h, xs, K, out + h, RT);
        }
        return;
      case 2:
        for (int h = 0; h < R; h += 4) direct<W, 4, 2>(w, n0 + h, xs, K, out + h, RT);
        return;
      case 3:
        if constexpr (is_float_w<W>) {
          for (int h = 0; h < R; h += 4) direct<W, 4, 3>(w, n0 + h, xs, K, out + h, RT);
        } else {
          for (int h = 0; h < R; h += kIntRowsM34<W>) direct<W, kIntRowsM34<W>, 3>(w, n0 + h, xs, K, out + h, RT);
        }
        return;
      default:
        if constexpr (is_float_w<W>) {  // two passes of M = 2 over 4 rows
          const XPrep hi = shift_rows(xs, 2, K);
          for (int h = 0; h < R; h += 4) {
            direct<W, 4, 2>(w, n0 + h, xs, K, out + h, RT);
            direct<W, 4, 2>(w, n0 + h, hi, K, out + 2 * RT + h, RT);
          }
        } else {
          for (int h = 0; h < R; h += kIntRowsM34<W>) direct<W, kIntRowsM34<W>, 4>(w, n0 + h, xs, K, out + h, RT);
        }
        return;
    }
  } else {
    switch (M) {
      case 1: direct<W, R, 1>(w, n0, xs, K, out, RT); return;
      case 2: direct<W, R, 2>(w, n0, xs, K, out, RT); return;
      case 3: direct<W, R, 3>(w, n0, xs, K, out, RT); return;
      default: direct<W, R, 4>(w, n0, xs, K, out, RT); return;
    }
  }
}

template <class W>
inline bool use_direct(int64_t M) {
  // measured on Zen 1: the integer kernels beat the fp32 buffered kernel up to M = 16 when run in
  // passes of <= 4 rows of x (the tile's weights stay in L1/L2 between passes); bf16 up to M = 8,
  // packed bf16 up to M = 16 (passes of 2 rows over a 16 KiB tile: 5632x1024 at M = 12 2.7 ms,
  // buffered 2.95; M = 24 and up buffered again)
  if constexpr (is_float_w<W> && W::packed && W::is_bf16) return M <= DIRECT_M * 4;
  if constexpr (is_float_w<W>) return M <= DIRECT_M * 2;
  else return M <= DIRECT_M * 16;
}

template <class W, int R>
inline void tile(const W& w, int64_t n0, const XPrep& xs, int64_t M, int64_t K, float* out,
                 float* buf, __m256* tot, bool direct_ok) {
  // out is [M][RT] (ldo = RT), rows n0..n0+R
  if (direct_ok) {
    for (int64_t m0 = 0; m0 < M; m0 += DIRECT_M)
      direct_rows<W, R>(w, n0, shift_rows(xs, m0, K), std::min(DIRECT_M, M - m0), K, out + m0 * RT);
    return;
  }
  if constexpr (R > 4) {
    // packed: the 8 rows of a K-chunk are one contiguous block, decoded at once (4-row halves would
    // read every other 128/256 bytes); plain: two passes of 4 rows (4 streams each)
    if constexpr (W::packed) tile_buffered<W, R>(w, n0, xs.x, M, K, out, RT, buf, tot);
    else for (int h = 0; h < R; h += 4) tile_buffered<W, 4>(w, n0 + h, xs.x, M, K, out + h, RT, buf, tot);
  } else {
    tile_buffered<W, R>(w, n0, xs.x, M, K, out, RT, buf, tot);
  }
}

template <class W>
void run_linear(const W& w, const void* xin, int64_t M, int64_t N, int64_t K, const float* bias,
                void* yout, bool bf16_io, int nthreads) {
  // bf16_io: x and y are bf16 (a bf16 engine's activations). x is widened here and y rounded as
  // it is written: two ATen conversions per call cost ~13 us, the whole GEMV of a 1024x1024 bf16
  // weight ~60 us.
  thread_local std::vector<float> x_buf;
  const float* x = static_cast<const float*>(xin);
  if (bf16_io) {
    x_buf.resize(size_t(M * K));
    const uint16_t* xb = static_cast<const uint16_t*>(xin);
    for (int64_t j = 0; j < M * K; ++j) x_buf[j] = bf16_bits_to_f32(xb[j]);
    x = x_buf.data();
  }
  float* y = bf16_io ? nullptr : static_cast<float*>(yout);
  uint16_t* yb = bf16_io ? static_cast<uint16_t*>(yout) : nullptr;
  // per-call activation preprocessing for the direct kernels (small: M * K elements)
  thread_local std::vector<float> xp_buf;
  thread_local std::vector<int16_t> xq_buf;
  float sx[MAX_M];
  XPrep xs{x, nullptr, nullptr, sx};
  const int64_t K16 = K / 16;
  bool direct_ok = use_direct<W>(M);
  if (direct_ok) {
    if constexpr (is_float_w<W> && !W::is_bf16) {
      // x is used as is
    } else if constexpr (is_float_w<W>) {
      xp_buf.resize(size_t(M * K16 * 16) + 16);
      prep_bf16(x, M, K, xp_buf.data());
      xs.xp = xp_buf.data();
    } else {
      xq_buf.resize(size_t(M * K16 * 16) + 16);
      if (prep_int16(x, M, K, xq_buf.data(), sx)) xs.xq = xq_buf.data();
      else direct_ok = false;  // non-finite x: fp32 kernel
    }
  }
  const int64_t ntiles = (N + RT - 1) / RT;
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, ntiles)));
  const int64_t chunk = std::max<int64_t>(1, ntiles / (int64_t(nt) * 16));
#pragma omp parallel num_threads(nt)
  {
    alignas(32) float buf[RT * KC];
    alignas(32) __m256 tot[MAX_M * RT];
    alignas(32) float out[MAX_M * RT];
    // dynamic chunks of ~1/16 of a thread's share: a thread preempted by another process (shared
    // machines) then holds back only its current chunk instead of half the matrix.
#pragma omp for schedule(dynamic, chunk)
    for (int64_t t = 0; t < ntiles; ++t) {
      const int64_t n0 = t * RT;
      const int rows = int(std::min<int64_t>(RT, N - n0));
      if (rows == RT) {
        tile<W, RT>(w, n0, xs, M, K, out, buf, tot, direct_ok);
      } else {
        for (int r = 0; r < rows; ++r) tile<W, 1>(w, n0 + r, xs, M, K, out + r, buf, tot, direct_ok);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int r = 0; r < rows; ++r) {
          const int64_t n = n0 + r;
          const float v = out[m * RT + r] * w.row_scale(n) + (bias ? bias[n] : 0.0f);
          if (yb) yb[m * N + n] = f32_to_bf16_bits(v);
          else y[m * N + n] = v;
        }
    }
  }
}

template <class W>
void run_dequant(const W& w, int64_t K, int64_t n0, int64_t n1, float* out, int nthreads) {
  const int64_t K16 = K / 16;
  const int64_t rows = n1 - n0;
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, rows)));
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t n = n0; n < n1; ++n) {
    float* o = out + (n - n0) * K;
    const float rs = w.row_scale(n);
    const __m256 rsv = _mm256_set1_ps(rs);
    for (int64_t i = 0; i < K16; ++i) {
      __m256 lo, hi;
      w.decode16f(n, i, lo, hi);
      _mm256_storeu_ps(o + 16 * i, _mm256_mul_ps(lo, rsv));
      _mm256_storeu_ps(o + 16 * i + 8, _mm256_mul_ps(hi, rsv));
    }
    for (int64_t k = K16 * 16; k < K; ++k) o[k] = w.scalar(n, k) * rs;
  }
}

bool packed_supported(int64_t N, int64_t K) { return N % RT == 0 && K % KILN_K_STEP == 0; }

bool int4_supported(int64_t K, int64_t group_size) {
  return K % 64 == 0 && group_size > 0 && group_size % 16 == 0 && K % group_size == 0;
}

// ---- panel layouts: GEMM kernels for any M, per instruction set -------------------------------------
// (panel_kernels.h). AVX2 + FMA is what the library is compiled for; the AVX-512 copy is compiled with
// its own target and used only when the CPU has AVX-512 F/BW/VL and VNNI (checked at run time).

// The same instruction for every vector width (panel_kernels.h names no intrinsic itself).
inline void prefetch_line(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
// A line of a one-row decode's weight stream, read once per step: with `nta` (tuning().row_nta) prefetched
// non-temporally, so that the step's ~100 MB of weights do not push out of L2/L3 what the step reuses (the KV
// context, the activations, the step loop's own objects): the whole decode is faster, not the kernel timed alone
// (docs/benchmarks.md, "Non-temporal decode streams"; scripts/bench_tunables.py).
inline void prefetch_once(const void* p, bool nta) {
  if (nta) _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
  else _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}

// The tunables of the panel kernels: software prefetch distances (bytes ahead in a weight stream). Defaults per
// microarchitecture (default_tuning); kiln.plugins.tuning measures them once per machine at first load and sets
// them here (kiln_set_tuning), caching its choice beside the kernel cache. 0 turns a prefetch off.
struct Tuning {
  int64_t row_prefetch;      // one-row decode (int8, int4): each thread's stream
  int64_t small_prefetch;    // batched decode (M <= SMALL_M): each panel of a tile's first pass
  int64_t onepass_prefetch;  // AVX-512 one-pass batched decode (13..16 rows)
  int64_t row_panels;        // int4 one-row decode: panels a thread reads at once (1: one stream; 2, 4 or 8)
  int64_t int8_row_panels;   // int8 one-row decode: the same choice
  int64_t bf16_row_prefetch; // bf16-panel decode (M < 4, either x): each panel's stream
  int64_t int8_row_prefetch; // int8 one-row decode over int8_row_panels > 1 streams: each panel's stream
  int64_t row_nta;           // one-row int8/int4 decode: prefetch non-temporally (1) or into every level (0)
  int64_t bf16_row_panels;   // bf16-panel decode with bf16 x (M < 4): panels a tile reads at once (2, 4, 8, 16)
  int64_t row_burst;         // one-row int8/int4 decode: bytes each thread prefetches at the start of its run
  int64_t attn_span_context; // decode attention with fewer rows than threads: rows of at least this many positions
                             // are split across them, each part reading whole slots (every kv head of a position,
                             // in position order; with as many rows as threads every row does), 0: one kv head
                             // per work item always
  int64_t onepass_split;     // AVX-512 batched decode of 13..16 rows, float path: 1 = rows 0..11 then 12..15 over
                             // panel pairs (panel_pair_float_12_4), 0 = 16 rows x 1 panel in one pass
};

// CPU family / model (AMD: Zen 3 = family 25 models 0x00-0x0f, 0x20-0x5f; Zen 4 = 25, 0x10-0x1f, 0x60-0xaf; Zen 5 = 26)
// -> the distances measured there; anything else gets Zen 5's (the most measured), and Intel CPUs the bf16 and int8
// decode prefetches measured on Sapphire Rapids (bf16 1024 B: single-stream decode 53 -> 60 tok/s there, then 8 panels
// a bf16 decode tile with 2048 B: x1.044 against 4 with 1024 B, faster in 6/6 rounds; int8 over several streams 2048 B)
// and ordinary one-row prefetches there (non-temporal ones are not followed by its L2 streamer: int4 single stream 96
// against 170 tok/s, int8 41 against 96), with 4 panels a thread in the one-row int4 and int8 decode (int4 x1.10
// against 1 in whole decodes, int8 x1.14), 8 where the AVX-512 kernels run (their 32 registers hold 8 panels' sums),
// the int4 ones 1024 B ahead each (docs/benchmarks.md, session 30). Zen 4's bf16 decode reads 8 panels a tile with a
// 256 B prefetch (whole single-stream decodes, scripts/bench_tunables.py: x1.05-1.09 against 4 panels without, faster
// in 11-12 of 12 rounds; 2 and 16 panels slower), and its one-row int8/int4 decode threads prefetch the first 8 KiB of
// their run at once (the stream of a 0.5-3 MB int4 GEMV otherwise starts from a few lines in flight: x1.03-1.07 int4,
// x1.03 int8, faster in 55-67% of 12-30 rounds), and splits a lone decode row's attention from 96 positions (fp32 pool
// x1.13-1.22 at 96-192 positions against 256, int8 x1.07-1.10, bf16 x0.99-1.11: scripts/bench_decode_attention.py
// --spans 256,64: the same two parts from 96 positions; at 48-64 positions no gain). Every CPU starts with the batched
// decode's 13..16 fp32-x rows as 12 + 4 over panel pairs (onepass_split; faster on Sapphire Rapids than 16 rows x 1
// panel, docs/benchmarks.md "fp32 batched decode"); the autotune keeps the 16-row kernel where it is clearly faster.
// Intel's one-pass prefetch is 2048 B (Sapphire Rapids, fp32 engine, 16 requests' decode: 1024-4096 B x1.08-1.10
// against 8192, faster in 4/4 rounds each; none x0.87).
bool cpu_has_avx512();

Tuning default_tuning() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
  const unsigned family = ((eax >> 8) & 0xf) + (((eax >> 8) & 0xf) == 0xf ? (eax >> 20) & 0xff : 0);
  const unsigned model = ((eax >> 4) & 0xf) | (((eax >> 16) & 0xf) << 4);
  const bool zen3 = family == 25 && (model < 0x10 || (model >= 0x20 && model < 0x60));
  if (zen3) return {4096, 0, 0, 1, 1, 0, 0, 1, 4, 0, 256, 1};
  const bool zen4 = family == 25 && ((model >= 0x10 && model < 0x20) || (model >= 0x60 && model < 0xb0));
  if (zen4) return {2048, 4096, 8192, 1, 1, 256, 4096, 1, 8, 8192, 96, 1};
  unsigned vb = 0, vc = 0, vd = 0, va = 0;
  __asm__("cpuid" : "=a"(va), "=b"(vb), "=c"(vc), "=d"(vd) : "a"(0), "c"(0));
  const bool intel = vb == 0x756e6547u && vd == 0x49656e69u && vc == 0x6c65746eu;   // "GenuineIntel"
  const bool intel512 = intel && cpu_has_avx512();
  const int64_t streams = intel512 ? 8 : intel ? 4 : 1;   // row_panels and int8_row_panels
  return {intel512 ? 1024 : 2048, 4096, intel ? 2048 : 8192, streams, streams, intel ? 2048 : 0, intel ? 2048 : 4096,
          intel ? 0 : 1, intel ? 8 : 4, 0, 256, 1};
}

Tuning& tuning() {
  static Tuning t = default_tuning();
  return t;
}

// Panels a one-row int8/int4 decode thread reads at once (interleaved streams): the tunable where it divides the
// panels, else 4 where that does (8 needs N a multiple of 128), else 1 (one contiguous run a thread).
inline int64_t row_streams(int64_t want, int64_t panels) {
  if (want > 1 && panels % want == 0) return want;
  if (want > 4 && panels % 4 == 0) return 4;
  return 1;
}

namespace k256 {
struct Isa {
  using V = __m256;
  using VI = __m256i;
  static constexpr int L = 8;
  // float path: 6 rows x 1 panel (12 accumulators of the 16 registers); int path 4 x 1 (8); int4 4 x 1 (8)
  static constexpr int MR_BIG = 6, NP_BIG = 1, MR_INT = 4, NP_INT = 1, MR_INT4 = 4, NP_INT4 = 1;
  // no one-pass small-batch kernel (16 accumulators would take every register)
  static constexpr int MR_ONEPASS = 0;
  static constexpr int64_t MC = 96;
  // prefill tiles that read x in place: the float path's
  static constexpr int MR_WIDE = MR_BIG;
  static constexpr int64_t MC_WIDE = MC;
  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V set1(float v) { return _mm256_set1_ps(v); }
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static inline V bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  // 8 outputs x 2 k of bf16 (32 bytes) -> k even (s = 0) or odd (s = 1) as fp32
  static inline V bf16_pair(const uint16_t* p, int s) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_castsi256_ps(s ? _mm256_and_si256(w, _mm256_set1_epi32(int(0xFFFF0000u))) : _mm256_slli_epi32(w, 16));
  }
  // 8 outputs x 2 k of int8 (16 bytes) -> k even or odd as fp32
  static inline V i8_pair(const int8_t* p, int s) {
    const __m256i w = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtepi32_ps(s ? _mm256_srai_epi32(w, 8) : _mm256_srai_epi32(_mm256_slli_epi32(w, 24), 24));
  }
  static inline VI izero() { return _mm256_setzero_si256(); }
  static inline VI iset1(int32_t v) { return _mm256_set1_epi32(v); }
  static inline VI i16_pairs(const int8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline VI dot_pairs(VI acc, VI w, VI x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
  static inline VI iadd(VI a, VI b) { return _mm256_add_epi32(a, b); }
  static inline V cvt(VI v) { return _mm256_cvtepi32_ps(v); }
  static inline VI iload(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static inline V dot_bf16(V acc, VI, VI) { return acc; }  // no bf16 dot product in AVX2: never called
  // nibble C of each 16-bit lane (int4 panels)
  template <int C>
  static inline VI nib(VI w) {
    if constexpr (C == 3) return _mm256_srli_epi16(w, 12);
    else if constexpr (C == 0) return _mm256_and_si256(w, _mm256_set1_epi16(15));
    else return _mm256_and_si256(_mm256_srli_epi16(w, 4 * C), _mm256_set1_epi16(15));
  }
  static inline VI imul(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
  static inline VI iand(VI a, VI b) { return _mm256_and_si256(a, b); }
  static inline VI iset1_16(int16_t v) { return _mm256_set1_epi16(v); }
  static inline VI iset1_8(int8_t v) { return _mm256_set1_epi8(v); }
  // acc + (unsigned bytes lo) . (signed bytes xl) + hi . xh per int32 lane (int4 x8: bytes <= 15, |x| <= 127, so
  // the 16-bit pair sums of vpmaddubsw, <= 4 x 15 x 127, never saturate)
  static inline VI dot_u4(VI acc, VI lo, VI xl, VI hi, VI xh) {
    const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(t, _mm256_set1_epi16(1)));
  }
  template <int S>
  static inline VI srli16(VI v) { return _mm256_srli_epi16(v, S); }
  template <int S>
  static inline VI srai32(VI v) { return _mm256_srai_epi32(v, S); }
  static inline VI u8_to_i32(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static inline V f16_to_f32(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // v rounded to bf16 as f32_to_bf16_bits does (nearest even, NaN -> 0x7fc0), stored at p (8 values)
  static inline void store_bf16(uint16_t* p, V v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);   // lanes 0-3, 4-7
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};
#include "panel_kernels.h"
}  // namespace k256

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c")
namespace k512 {
struct Isa {
  using V = __m512;
  using VI = __m512i;
  static constexpr int L = 16;
  // float path: 12 rows x 2 panels (24 accumulators of the 32 registers); int path 8 x 2 (16); int4 8 x 2 (16)
  static constexpr int MR_BIG = 12, NP_BIG = 2, MR_INT = 8, NP_INT = 2, MR_INT4 = 8, NP_INT4 = 2;
  // 13..16 rows (batched decode): one pass of 16 rows x 1 panel over the weights (panel_float with KMAJOR)
  static constexpr int MR_ONEPASS = 16;
  static constexpr int64_t MC = 96;
  // prefill tiles that read x in place (the bf16 dot path; the float path where K does not pack): 14 rows x 2
  // panels, 28 accumulators + 2 weight vectors + the broadcast, row blocks of 6 x 14; faster than 12 x 2 there
  // (benchmarks.md, "Prefill tiles of 14 rows"). Packed x keeps 12 x 2: a 14-row block pads more rows.
  static constexpr int MR_WIDE = 14;
  static constexpr int64_t MC_WIDE = 84;
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V set1(float v) { return _mm512_set1_ps(v); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static inline V bcast(const float* p) { return _mm512_set1_ps(*p); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static inline V bf16_pair(const uint16_t* p, int s) {
    const __m512i w = _mm512_loadu_si512(p);
    return _mm512_castsi512_ps(s ? _mm512_and_si512(w, _mm512_set1_epi32(int(0xFFFF0000u))) : _mm512_slli_epi32(w, 16));
  }
  static inline V i8_pair(const int8_t* p, int s) {
    const __m512i w = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_cvtepi32_ps(s ? _mm512_srai_epi32(w, 8) : _mm512_srai_epi32(_mm512_slli_epi32(w, 24), 24));
  }
  static inline VI izero() { return _mm512_setzero_si512(); }
  static inline VI iset1(int32_t v) { return _mm512_set1_epi32(v); }
  static inline VI i16_pairs(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline VI dot_pairs(VI acc, VI w, VI x) { return _mm512_dpwssd_epi32(acc, w, x); }
  static inline VI iadd(VI a, VI b) { return _mm512_add_epi32(a, b); }
  static inline V cvt(VI v) { return _mm512_cvtepi32_ps(v); }
  static inline VI iload(const void* p) { return _mm512_loadu_si512(p); }
  static inline V dot_bf16(V acc, VI w, VI x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  template <int C>
  static inline VI nib(VI w) {
    if constexpr (C == 3) return _mm512_srli_epi16(w, 12);
    else if constexpr (C == 0) return _mm512_and_si512(w, _mm512_set1_epi16(15));
    else return _mm512_and_si512(_mm512_srli_epi16(w, 4 * C), _mm512_set1_epi16(15));
  }
  static inline VI imul(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
  static inline VI iand(VI a, VI b) { return _mm512_and_si512(a, b); }
  static inline VI iset1_16(int16_t v) { return _mm512_set1_epi16(v); }
  static inline VI iset1_8(int8_t v) { return _mm512_set1_epi8(v); }
  static inline VI dot_u4(VI acc, VI lo, VI xl, VI hi, VI xh) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, xl), hi, xh);
  }
  template <int S>
  static inline VI srli16(VI v) { return _mm512_srli_epi16(v, S); }
  template <int S>
  static inline VI srai32(VI v) { return _mm512_srai_epi32(v, S); }
  static inline VI u8_to_i32(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline V f16_to_f32(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // v rounded to bf16 as f32_to_bf16_bits does (nearest even, NaN -> 0x7fc0; vcvtneps2bf16 would flush
  // denormals), stored at p (16 values)
  static inline void store_bf16(uint16_t* p, V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
};
#include "panel_kernels.h"
}  // namespace k512
#pragma GCC pop_options

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}

int best_panel_isa() {
  static const int best = cpu_has_avx512() ? 512 : 256;
  return best;
}

std::atomic<int> g_panel_isa{0};  // 0: not chosen yet

int panel_isa() {
  int isa = g_panel_isa.load(std::memory_order_relaxed);
  if (isa == 0) {
    isa = best_panel_isa();
    if (const char* env = std::getenv("KILN_PANEL_ISA")) {
      if (std::atoi(env) == 256) isa = 256;
    }
    g_panel_isa.store(isa);
  }
  return isa;
}

// How the int4-panel kernels round x: 16 (int16 per row, error <= max|x_row| / 65534) or 8 (int8 per weight group,
// error <= max|x_group| / 254, half the dot products: quantize_groups_int8). From KILN_INT4_X_BITS at load
// (default 16), kiln_set_int4_x_bits after.
std::atomic<int> g_int4_x_bits{0};  // 0: not read yet

int int4_x_bits() {
  int bits = g_int4_x_bits.load(std::memory_order_relaxed);
  if (bits == 0) {
    const char* env = std::getenv("KILN_INT4_X_BITS");
    bits = env && std::atoi(env) == 8 ? 8 : 16;
    g_int4_x_bits.store(bits);
  }
  return bits;
}

// What runs for a panel-layout weight of type wtype at M rows (the dispatch of panel_kernels.h's panel_gemm_*),
// with the tunables it uses: "kernel, ISA, blocking, prefetch" (kiln inspect --load prints it per linear).
template <class Isa>
std::string describe_panel(int wtype, int64_t M, int64_t N) {
  const Tuning& t = tuning();
  const int64_t panels = N / 16;
  const bool pfm = t.small_prefetch > 0 && M <= 32;
  const std::string isa = Isa::L == 16 ? "avx512" : "avx2";
  const auto tiles = [&](int mr, int np) {
    const int npp = panels % np == 0 ? np : 1;
    return std::to_string(mr) + "x" + std::to_string(npp) + " tiles" +
           (pfm ? ", prefetch " + std::to_string(t.small_prefetch) + " B (first pass)" : "");
  };
  const int kind = kiln_weight_kind(wtype);
  const std::string nta = t.row_nta ? " non-temporal" : "";
  const std::string burst = t.row_burst > 0 ? ", " + std::to_string(t.row_burst) + " B at the start" : "";
  std::string what;
  if (wtype == KILN_W_BF16_PANEL) {
    const int64_t gemm_m = kiln_ops_bf16_gemm_m();
    if (gemm_m > 0 && M >= gemm_m) return "bf16 panels in place with bf16 x (from M " + std::to_string(gemm_m) +
                                          "): AMX tiles, 32 rows x 2 panels (K a multiple of 32), else oneDNN "
                                          "brgemm per panel";
  }
  if (wtype == KILN_W_FP32_PANEL) {
    const int64_t gemm_m = kiln_ops_fp32_gemm_m();
    if (gemm_m > 0 && M >= gemm_m) return "fp32 panels with fp32 x (from M " + std::to_string(gemm_m) +
                                          "): AMX tiles on x and the panels split into bf16 halves, 3 products (K "
                                          "a multiple of 32; KILN_FP32_MATMUL=high)";
  }
  if (wtype == KILN_W_INT4_PANEL) {
    const int64_t gemm_m = kiln_ops_int4_gemm_m();
    if (gemm_m > 0 && M >= gemm_m) return "int4 panels -> bf16 once per call, oneDNN bf16 GEMM (from M " +
                                          std::to_string(gemm_m) + ")";
    if (M == 1 && row_streams(t.row_panels, panels) > 1)
      what = "one row x " + std::to_string(row_streams(t.row_panels, panels)) + " panels, prefetch " +
             std::to_string(t.row_prefetch) + " B" + nta;
    else if (M == 1) what = "one-row stream, 4 chains, prefetch " + std::to_string(t.row_prefetch) + " B" + nta + burst;
    else what = tiles(Isa::MR_INT4, Isa::NP_INT4);
    return "int4 panels, " + isa + (Isa::L == 16 ? " vnni" : "") + (int4_x_bits() == 8 ? ", x int8 per group" : "") +
           ", " + what;
  }
  if (kind == KILN_W_INT8) {
    if (M == 1 && row_streams(t.int8_row_panels, panels) > 1)
      what = "one row x " + std::to_string(row_streams(t.int8_row_panels, panels)) + " panels, prefetch " +
             std::to_string(t.int8_row_prefetch) + " B" + nta;
    else if (M == 1) what = "one-row stream, 4 chains, prefetch " + std::to_string(t.row_prefetch) + " B" + nta + burst;
    else if (M < 4 && panels % 4 == 0) what = "2x4 tiles";
    else what = tiles(Isa::MR_INT, Isa::NP_INT);
    const int64_t gemm_m = kiln_ops_int8_amx_m();
    const int64_t split_m = kiln_ops_int8_split_m();
    std::string amx = gemm_m > 0 && M >= gemm_m ? "; with bf16 x (from M " + std::to_string(gemm_m) +
                                                  "): AMX tiles on each panel pair converted to bf16 (K a multiple of "
                                                  "32)" : "";
    if (split_m > 0 && M >= split_m)
      amx += "; with fp32 x (from M " + std::to_string(split_m) + "): the same, x split into bf16 halves";
    return "int8 panels, " + isa + (Isa::L == 16 ? " vnni" : "") + ", " + what + amx;
  }
  const std::string name = kind == KILN_W_BF16 ? "bf16 panels" : "fp32 panels";
  if (M < 4) {
    // bf16 weights read with bf16 x (a bf16 engine on an AVX512_BF16 CPU) take bf16_row_panels a tile
    const bool dot = kind == KILN_W_BF16 && Isa::L == 16 && cpu_has_avx512_bf16();
    const int64_t np = dot && panels % t.bf16_row_panels == 0 ? t.bf16_row_panels : 4;
    what = panels % np == 0 ? (np == 16 ? "1x16 tiles" : "2x" + std::to_string(np) + " tiles") : "2x1 tiles";
    if (kind == KILN_W_BF16 && panels % np == 0 && t.bf16_row_prefetch > 0)
      what += ", prefetch " + std::to_string(t.bf16_row_prefetch) + " B";
  } else if (Isa::MR_ONEPASS > 0 && M > Isa::MR_BIG && M <= Isa::MR_ONEPASS) {
    const bool dot = kind == KILN_W_BF16 && Isa::L == 16 && cpu_has_avx512_bf16();
    what = !dot && t.onepass_split && panels % 2 == 0
               ? "rows 0-11 then 12-15 over panel pairs, 64 k a chunk"
               : "one pass of " + std::to_string(Isa::MR_ONEPASS) + " rows";
    what += ", prefetch " + std::to_string(t.onepass_prefetch) + " B";
  }
  else if (M > 32 && Isa::MR_WIDE != Isa::MR_BIG && panels % Isa::NP_BIG == 0)
    // prefill: bf16 x reads x in place with the wide kernel; the float path packs x where K % 512 == 0
    what = kind == KILN_W_BF16 && Isa::L == 16 && cpu_has_avx512_bf16()
               ? tiles(Isa::MR_WIDE, Isa::NP_BIG)
               : tiles(Isa::MR_BIG, Isa::NP_BIG) + " (x packed) where K % 512 == 0, else " + tiles(Isa::MR_WIDE, Isa::NP_BIG);
  else what = tiles(Isa::MR_BIG, Isa::NP_BIG);
  return name + ", " + isa + ", " + what;
}

// x as fp32 [M][K]: widened from bf16 into a per-thread buffer, or used as it is
const float* x_fp32(const void* xin, int64_t M, int64_t K, bool bf16_io) {
  if (!bf16_io) return static_cast<const float*>(xin);
  thread_local std::vector<float> buf;
  buf.resize(size_t(M * K));
  const uint16_t* xb = static_cast<const uint16_t*>(xin);
  const int64_t n = M * K;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(buf.data() + j, _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + j))), 16)));
  for (; j < n; ++j) buf[j] = bf16_bits_to_f32(xb[j]);
  return buf.data();
}

// Symmetric int16 per row, as prep_int16 (xq = round(x / sx), sx = max|x| / 32767) but over every element
// of a row; false if x holds a NaN or an infinity.
bool quantize_rows_int16(const float* x, int64_t M, int64_t K, int16_t* xq, float* sx) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 lim = _mm256_set1_ps(32767.0f), nlim = _mm256_set1_ps(-32767.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 v = _mm256_loadu_ps(r + k);
      mx = _mm256_max_ps(mx, _mm256_and_ps(v, absmask));
      bad = _mm256_add_ps(bad, _mm256_mul_ps(v, _mm256_setzero_ps()));
    }
    float amax = 0.0f, badf = hsum(bad);
    for (; k < K; ++k) {
      amax = std::max(amax, std::fabs(r[k]));
      badf += r[k] * 0.0f;
    }
    if (badf != 0.0f || !(badf == badf)) return false;
    alignas(32) float t[8];
    _mm256_store_ps(t, mx);
    for (float v : t) amax = std::max(amax, v);
    const float s = amax > 0.0f ? amax / 32767.0f : 1.0f;
    sx[m] = s;
    const float inv = 1.0f / s;
    const __m256 vinv = _mm256_set1_ps(inv);
    int16_t* q = xq + m * K;
    k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m256 a = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(r + k), vinv), nlim), lim);
      const __m256 b = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(r + k + 8), vinv), nlim), lim);
      const __m256i p = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permute4x64_epi64(p, 0xD8));
    }
    for (; k < K; ++k) q[k] = int16_t(std::nearbyint(std::min(32767.0f, std::max(-32767.0f, r[k] * inv))));
  }
  return true;
}

// x of an int4-panel call with x8 (panel_kernels.h, Int4X): symmetric int8 per group of gs k (xq = round(x / s),
// s = max |x| / 127 over the group: error <= max |x_group| / 254 per element, ~18x below the int4 weight's own
// rounding error of scale / 2 = max |w_group| / 14, and of the order of the bf16 rounding the prefill GEMM path
// takes), each block of 8 stored as k = 0, 4, 1, 5, 2, 6, 3, 7 (the order of the weight nibbles in a row's
// 32-bit lane), the groups' scales in sx [M][G] and their sums of xq in xs [M][G]; false if x holds a NaN or an
// infinity. Serial: ~1 us for K = 4096, far below the GEMV it feeds.
bool quantize_groups_int8(const float* x, int64_t M, int64_t K, int64_t gs, int8_t* xq, float* sx, int32_t* xs) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
  // bytes 0..7 of a block of 8 int32 (k order) -> the lane order 0, 4, 1, 5, 2, 6, 3, 7
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t G = K / gs;
  __m256 bad = _mm256_setzero_ps();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* r = x + m * K + g * gs;
      __m256 mx = _mm256_setzero_ps();
      for (int64_t k = 0; k < gs; k += 8) {
        const __m256 t = _mm256_loadu_ps(r + k);
        mx = _mm256_max_ps(mx, _mm256_and_ps(t, absmask));
        bad = _mm256_add_ps(bad, _mm256_mul_ps(t, _mm256_setzero_ps()));
      }
      alignas(32) float t8[8];
      _mm256_store_ps(t8, mx);
      float amax = 0.0f;
      for (float t : t8) amax = std::max(amax, t);
      const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
      const __m256 inv = _mm256_set1_ps(1.0f / s);
      __m256i sum = _mm256_setzero_si256();
      int8_t* q = xq + m * K + g * gs;
      for (int64_t k = 0; k < gs; k += 8) {
        const __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(r + k), inv), nlim), lim));
        sum = _mm256_add_epi32(sum, i);
        const __m256i p = _mm256_permutevar8x32_epi32(i, order);
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(w16, w16));
      }
      alignas(32) int32_t s8[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(s8), sum);
      sx[m * G + g] = s;
      xs[m * G + g] = s8[0] + s8[1] + s8[2] + s8[3] + s8[4] + s8[5] + s8[6] + s8[7];
    }
  alignas(32) float b8[8];
  _mm256_store_ps(b8, bad);
  for (float t : b8)
    if (t != 0.0f || !(t == t)) return false;
  return true;
}

struct Int4View {
  const uint8_t* w;
  const uint16_t* s;
  const uint8_t* z;
  int64_t K, gs;
};

// fp32 -> bf16 bits, rounded to nearest even (finite values: dequantized weights), in the low half of each lane
inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
}

// int4 panels -> bf16 [N][K] row-major: w = (u - zero) * scale in fp32 (weight_format.dequantize_int4_panels'
// arithmetic), rounded to nearest even. The prefill path (linear_ops.cpp): a compute-bound bf16 GEMM (oneDNN's,
// AMX where the CPU has it) on the weight dequantized once per call. AVX2: a block's 32-byte half holds rows
// 8h..8h+7, 16-bit word 2r + e holding nibble c = element (row r, k = 8b + 2c + e); the four nibbles' bf16 pairs
// are transposed (4 x 8 32-bit elements) so that each row's 8 k are one 16-byte store.
void dequant_int4_panel_bf16(const Int4View& v, int64_t N, uint16_t* out, int nthreads) {
  const int64_t K = v.K, G = K / v.gs, bpg = v.gs / 8, pbytes = (K / 8) * 64, panels = N / 16;
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, panels)));
  const __m256i low4 = _mm256_set1_epi16(15);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int h = 0; h < 2; ++h) {
      uint16_t* o = out + (p * 16 + h * 8) * K;
      for (int64_t g = 0; g < G; ++g) {
        float sr[8], zr[8];
        for (int r = 0; r < 8; ++r) {
          const int64_t i = (p * G + g) * 16 + h * 8 + r;
          sr[r] = _cvtsh_ss(v.s[i]);
          zr[r] = v.z ? float(v.z[i]) : 8.0f;
        }
        // lanes of the pairs: words 0-7 are rows 0-3 (k even, k odd), words 8-15 rows 4-7
        const __m256 slo = _mm256_setr_ps(sr[0], sr[0], sr[1], sr[1], sr[2], sr[2], sr[3], sr[3]);
        const __m256 shi = _mm256_setr_ps(sr[4], sr[4], sr[5], sr[5], sr[6], sr[6], sr[7], sr[7]);
        const __m256 zlo = _mm256_setr_ps(zr[0], zr[0], zr[1], zr[1], zr[2], zr[2], zr[3], zr[3]);
        const __m256 zhi = _mm256_setr_ps(zr[4], zr[4], zr[5], zr[5], zr[6], zr[6], zr[7], zr[7]);
        for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
          const __m256i W = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v.w + p * pbytes + b * 64 + h * 32));
          __m256i P[4];
          for (int c = 0; c < 4; ++c) {
            const __m256i u = _mm256_and_si256(_mm256_srl_epi16(W, _mm_cvtsi32_si128(4 * c)), low4);
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(u)));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(u, 1)));
            // 32-bit elements: the bf16 pairs of rows [0 1 4 5 | 2 3 6 7] (packus interleaves per 128-bit lane)
            P[c] = _mm256_packus_epi32(bf16_bits8(_mm256_mul_ps(_mm256_sub_ps(lo, zlo), slo)),
                                       bf16_bits8(_mm256_mul_ps(_mm256_sub_ps(hi, zhi), shi)));
          }
          const __m256i t0 = _mm256_unpacklo_epi32(P[0], P[1]), t1 = _mm256_unpackhi_epi32(P[0], P[1]);
          const __m256i t2 = _mm256_unpacklo_epi32(P[2], P[3]), t3 = _mm256_unpackhi_epi32(P[2], P[3]);
          const __m256i q[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                                _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
          constexpr int rows_lo[4] = {0, 1, 4, 5}, rows_hi[4] = {2, 3, 6, 7};
          for (int j = 0; j < 4; ++j) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(o + rows_lo[j] * K + b * 8), _mm256_castsi256_si128(q[j]));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(o + rows_hi[j] * K + b * 8), _mm256_extracti128_si256(q[j], 1));
          }
        }
      }
    }
  }
}

// y = x @ W^T (+ bias) for a panel-layout weight; 0, or 2 when the shape does not fit the layout.
int run_panel(int wtype, const void* w, const float* scales, const void* xin, int64_t M, int64_t N, int64_t K,
              const float* bias, void* yout, int nthreads, bool bf16_io) {
  if (wtype == KILN_W_INT4_PANEL) return 3;  // kiln_linear_int4_panel
  if (N % KILN_PANEL != 0 || (wtype != KILN_W_FP32_PANEL && K % KILN_PAIR != 0)) return 2;
  const bool wide = panel_isa() == 512;
  const bool int8 = wtype == KILN_W_INT8_PANEL;
  k256::Epilogue ep256{int8 ? scales : nullptr, bias, bf16_io ? nullptr : static_cast<float*>(yout),
                       bf16_io ? static_cast<uint16_t*>(yout) : nullptr, N};
  k512::Epilogue ep512{ep256.wscale, ep256.bias, ep256.y, ep256.yb, N};
  const bool dot_bf16 = wtype == KILN_W_BF16_PANEL && wide && bf16_io && cpu_has_avx512_bf16();
  const float* x = dot_bf16 ? nullptr : x_fp32(xin, M, K, bf16_io);
  if (int8) {
    thread_local std::vector<int16_t> xq;
    thread_local std::vector<float> sx;
    xq.resize(size_t(M * K));
    sx.resize(size_t(M));
    const auto* wq = static_cast<const int8_t*>(w);
    if (quantize_rows_int16(x, M, K, xq.data(), sx.data())) {
      if (wide) k512::panel_gemm_int8(wq, M, N, K, xq.data(), sx.data(), ep512, nthreads);
      else k256::panel_gemm_int8(wq, M, N, K, xq.data(), sx.data(), ep256, nthreads);
      return 0;
    }
    if (wide) k512::panel_gemm_float<k512::PanelInt8>(wq, M, N, K, x, ep512, nthreads);  // NaN/inf in x
    else k256::panel_gemm_float<k256::PanelInt8>(wq, M, N, K, x, ep256, nthreads);
    return 0;
  }
  if (wtype == KILN_W_BF16_PANEL) {
    const auto* wb = static_cast<const uint16_t*>(w);
    if (dot_bf16) {  // bf16 x: one dot-product instruction per pair
      k512::panel_gemm_bf16dot(wb, M, N, K, static_cast<const uint16_t*>(xin), ep512, nthreads);
      return 0;
    }
    if (wide) k512::panel_gemm_float<k512::PanelBf16>(wb, M, N, K, x, ep512, nthreads);
    else k256::panel_gemm_float<k256::PanelBf16>(wb, M, N, K, x, ep256, nthreads);
    return 0;
  }
  const auto* wf = static_cast<const float*>(w);
  if (wide) k512::panel_gemm_float<k512::PanelF32>(wf, M, N, K, x, ep512, nthreads);
  else k256::panel_gemm_float<k256::PanelF32>(wf, M, N, K, x, ep256, nthreads);
  return 0;
}

// int4 panels: 0; 2 when the shape does not fit the layout; 4 when x holds a NaN or an infinity (the caller
// computes in fp32 then, so that they propagate as in the reference).
int run_int4_panel(const Int4View& v, const void* xin, int64_t M, int64_t N, const float* bias, void* yout,
                   int nthreads, bool bf16_io) {
  const int64_t K = v.K, gs = v.gs;
  if (N % KILN_PANEL != 0 || K % KILN_INT4_BLOCK != 0 || gs <= 0 || gs % KILN_INT4_BLOCK != 0 || K % gs != 0) return 2;
  const float* x = x_fp32(xin, M, K, bf16_io);
  const int64_t G = K / gs;
  float* y = bf16_io ? nullptr : static_cast<float*>(yout);
  uint16_t* yb = bf16_io ? static_cast<uint16_t*>(yout) : nullptr;
  // x rounded for the kernels (panel_kernels.h, Int4X): int8 per group (x8), or int16 per row and its group sums
  thread_local std::vector<int32_t> xq;
  thread_local std::vector<float> sx;
  thread_local std::vector<int32_t> xs;
  const bool x8 = int4_x_bits() == 8 && K < (int64_t(1) << 20);
  xq.resize(size_t(M * K / (x8 ? 4 : 2)));
  sx.resize(size_t(x8 ? M * G : M));
  xs.resize(size_t(M * G));
  if (x8) {
    if (!quantize_groups_int8(x, M, K, gs, reinterpret_cast<int8_t*>(xq.data()), sx.data(), xs.data())) return 4;
  } else {
    int16_t* xq16 = reinterpret_cast<int16_t*>(xq.data());
    if (!quantize_rows_int16(x, M, K, xq16, sx.data())) return 4;
    for (int64_t m = 0; m < M; ++m)  // each row's group sums (exact in int32: gs * 32767 < 2^31)
      for (int64_t g = 0; g < G; ++g) {
        const int16_t* q = xq16 + m * K + g * gs;
        __m256i a = _mm256_setzero_si256();
        int64_t k = 0;
        for (; k + 16 <= gs; k += 16)
          a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k)),
                                                    _mm256_set1_epi16(1)));
        alignas(32) int32_t t[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(t), a);
        int32_t sum = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
        for (; k < gs; ++k) sum += q[k];
        xs[size_t(m * G + g)] = sum;
      }
  }
  if (panel_isa() == 512) {
    const k512::Epilogue ep{nullptr, bias, y, yb, N};
    if (x8) k512::panel_gemm_int4<k512::Int4X8>({v.w, v.s, v.z, K, gs}, M, N, {xq.data(), sx.data(), xs.data()}, ep, nthreads);
    else k512::panel_gemm_int4<k512::Int4X16>({v.w, v.s, v.z, K, gs}, M, N, {xq.data(), sx.data(), xs.data()}, ep, nthreads);
  } else {
    const k256::Epilogue ep{nullptr, bias, y, yb, N};
    if (x8) k256::panel_gemm_int4<k256::Int4X8>({v.w, v.s, v.z, K, gs}, M, N, {xq.data(), sx.data(), xs.data()}, ep, nthreads);
    else k256::panel_gemm_int4<k256::Int4X16>({v.w, v.s, v.z, K, gs}, M, N, {xq.data(), sx.data(), xs.data()}, ep, nthreads);
  }
  return 0;
}

// Calls f with the weight view of type wtype; returns 0, or 2 when the shape does not fit the layout,
// 3 for an unknown weight type.
template <class F>
int with_weight(int wtype, const void* w, const float* scales, int64_t group_size, int64_t N, int64_t K, F&& f) {
  switch (wtype) {
    case KILN_W_BF16: f(WBf16{static_cast<const uint16_t*>(w), K}); return 0;
    case KILN_W_FP32: f(WF32{static_cast<const float*>(w), K}); return 0;
    case KILN_W_INT8: f(WInt8{static_cast<const int8_t*>(w), scales, K}); return 0;
    case KILN_W_BF16_PACKED:
      if (!packed_supported(N, K)) return 2;
      f(WBf16Packed{static_cast<const uint16_t*>(w), K});
      return 0;
    case KILN_W_FP32_PACKED:
      if (!packed_supported(N, K)) return 2;
      f(WF32Packed{static_cast<const float*>(w), K});
      return 0;
    case KILN_W_INT8_PACKED:
      if (!packed_supported(N, K)) return 2;
      f(WInt8Packed{static_cast<const int8_t*>(w), scales, K});
      return 0;
    case KILN_W_INT4:
      if (!int4_supported(K, group_size)) return 2;
      f(WInt4{static_cast<const uint8_t*>(w), scales, K, group_size, K / group_size});
      return 0;
    default: return 3;
  }
}

}  // namespace

extern "C" {

// The build key (see kiln_kernels.h), found by Python in the library file after the mark.
__attribute__((used, visibility("default"))) extern const char kiln_build_key[] =
    "kiln-build-key:" KILN_STR(KILN_BUILD_KEY);

int kiln_linear(int wtype, const void* w, const float* scales, int64_t group_size,
                const void* x, int64_t M, int64_t N, int64_t K, const float* bias, void* y,
                int nthreads, int bf16_io) {
  if (M < 1 || N < 1 || K < 1) return 1;
  if (kiln_is_panel(wtype)) return run_panel(wtype, w, scales, x, M, N, K, bias, y, nthreads, bf16_io != 0);
  if (M > MAX_M) return 1;
  return with_weight(wtype, w, scales, group_size, N, K, [&](const auto& wv) {
    run_linear(wv, x, M, N, K, bias, y, bf16_io != 0, nthreads);
  });
}

// Like the GEMV kernels it reads 8 streams at once per thread (tiles of 8 rows of 4096 floats): on
// Zen 1 one stream per core reaches less than half the bandwidth.
int kiln_panel_isa() { return panel_isa(); }

int64_t kiln_attn_span_context() { return tuning().attn_span_context; }

int kiln_set_panel_isa(int bits) {
  if (bits == 0) bits = best_panel_isa();
  if (bits == 256 || (bits == 512 && best_panel_isa() == 512)) g_panel_isa.store(bits);
  return panel_isa();
}

double kiln_stream_sum(const float* p, int64_t n, int nthreads) {
  constexpr int64_t L = 4096, S = 8;
  const int64_t tiles = n / (L * S);
  double total = 0.0;
  nthreads = std::max(1, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : total)
  for (int64_t t = 0; t < tiles; ++t) {
    __m256 a[S];
    for (int s = 0; s < S; ++s) a[s] = _mm256_setzero_ps();
    const float* q = p + t * L * S;
    for (int64_t i = 0; i < L; i += 8)
      for (int s = 0; s < S; ++s) a[s] = _mm256_add_ps(a[s], _mm256_loadu_ps(q + s * L + i));
    for (int s = 1; s < S; ++s) a[0] = _mm256_add_ps(a[0], a[s]);
    total += hsum(a[0]);
  }
  for (int64_t k = tiles * L * S; k < n; ++k) total += p[k];
  return total;
}

// Median microseconds of an empty parallel region of nthreads on the calling thread's team, each after 50 us of
// work on this thread alone (31 regions, ~1.6 ms). ~1 us while the team's workers spin between regions; 10-50 us
// when libgomp has stopped spinning because the process has more OpenMP threads than CPUs (another thread's team):
// then every region of a decode step pays a sleep and a wake-up (kiln.plugins.openmp_teams).
double kiln_openmp_region_us(int nthreads) {
  using clock = std::chrono::steady_clock;
  constexpr int R = 31;
  double us[R];
  for (int i = 0; i < R; ++i) {
    const auto idle = clock::now() + std::chrono::microseconds(50);
    while (clock::now() < idle) {
    }
    const auto t0 = clock::now();
#pragma omp parallel num_threads(std::max(1, nthreads))
    { asm volatile(""); }
    us[i] = std::chrono::duration<double, std::micro>(clock::now() - t0).count();
  }
  std::nth_element(us, us + R / 2, us + R);
  return us[R / 2];
}

int kiln_linear_int4_panel(const void* w, const uint16_t* scales, const uint8_t* zeros, int64_t group_size,
                           const void* x, int64_t M, int64_t N, int64_t K, const float* bias, void* y, int nthreads,
                           int bf16_io) {
  if (M < 1 || N < 1 || K < 1) return 1;
  return run_int4_panel({static_cast<const uint8_t*>(w), scales, zeros, K, group_size}, x, M, N, bias, y, nthreads,
                        bf16_io != 0);
}

int kiln_int4_x_bits() { return int4_x_bits(); }

int kiln_set_int4_x_bits(int bits) {
  if (bits != 8 && bits != 16) return 1;
  g_int4_x_bits.store(bits);
  return 0;
}

int kiln_dequant_int4_panel_bf16(const void* w, const uint16_t* scales, const uint8_t* zeros, int64_t group_size,
                                 int64_t N, int64_t K, uint16_t* out, int nthreads) {
  if (N < 1 || K < 1 || N % KILN_PANEL != 0 || K % KILN_INT4_BLOCK != 0 || group_size <= 0 ||
      group_size % KILN_INT4_BLOCK != 0 || K % group_size != 0)
    return 2;
  dequant_int4_panel_bf16({static_cast<const uint8_t*>(w), scales, zeros, K, group_size}, N, out, nthreads);
  return 0;
}

int kiln_describe_kernel(int wtype, int64_t M, int64_t N, char* buf, int64_t len) {
  if (!kiln_is_panel(wtype) || len <= 0) return 1;
  const std::string d = panel_isa() == 512 ? describe_panel<k512::Isa>(wtype, M, N) : describe_panel<k256::Isa>(wtype, M, N);
  std::snprintf(buf, size_t(len), "%s", d.c_str());
  return 0;
}

int kiln_get_tuning(const char* name, int64_t* value) {
  const Tuning& t = tuning();
  const std::string n(name);
  if (n == "row_prefetch") *value = t.row_prefetch;
  else if (n == "small_prefetch") *value = t.small_prefetch;
  else if (n == "onepass_prefetch") *value = t.onepass_prefetch;
  else if (n == "row_panels") *value = t.row_panels;
  else if (n == "int8_row_panels") *value = t.int8_row_panels;
  else if (n == "bf16_row_prefetch") *value = t.bf16_row_prefetch;
  else if (n == "int8_row_prefetch") *value = t.int8_row_prefetch;
  else if (n == "row_nta") *value = t.row_nta;
  else if (n == "bf16_row_panels") *value = t.bf16_row_panels;
  else if (n == "row_burst") *value = t.row_burst;
  else if (n == "attn_span_context") *value = t.attn_span_context;
  else if (n == "onepass_split") *value = t.onepass_split;
  else return 1;
  return 0;
}

int kiln_set_tuning(const char* name, int64_t value) {
  if (value < 0 || value > (1 << 16)) return 2;
  Tuning& t = tuning();
  const std::string n(name);
  if (n == "row_prefetch") t.row_prefetch = value;
  else if (n == "small_prefetch") t.small_prefetch = value;
  else if (n == "onepass_prefetch") t.onepass_prefetch = value;
  else if (n == "bf16_row_prefetch") t.bf16_row_prefetch = value;
  else if (n == "int8_row_prefetch") t.int8_row_prefetch = value;
  else if (n == "row_panels") {
    if (value != 1 && value != 2 && value != 4 && value != 8) return 2;
    t.row_panels = value;
  } else if (n == "int8_row_panels") {
    if (value != 1 && value != 2 && value != 4 && value != 8) return 2;
    t.int8_row_panels = value;
  } else if (n == "row_nta") {
    if (value > 1) return 2;
    t.row_nta = value;
  } else if (n == "onepass_split") {
    if (value > 1) return 2;
    t.onepass_split = value;
  } else if (n == "row_burst") t.row_burst = value;
  else if (n == "attn_span_context") t.attn_span_context = value;
  else if (n == "bf16_row_panels") {
    if (value != 2 && value != 4 && value != 8 && value != 16) return 2;
    t.bf16_row_panels = value;
  } else return 1;
  return 0;
}

int kiln_dequant_rows(int wtype, const void* w, const float* scales, int64_t group_size,
                      int64_t N, int64_t K, int64_t n0, int64_t n1, float* out, int nthreads) {
  if (n0 < 0 || n1 > N || n0 > n1) return 1;
  return with_weight(wtype, w, scales, group_size, N, K, [&](const auto& wv) {
    run_dequant(wv, K, n0, n1, out, nthreads);
  });
}

}  // extern "C"
