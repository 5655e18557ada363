// Causal attention of a prompt chunk over its sequence's cached context (prefill), bf16 or fp32, on AVX-512 (no torch).
//
// Why: torch's CPU flash attention (F.scaled_dot_product_attention) runs 73-131 GFLOP/s on a 2-core Zen 5 without
// AMX, against ~700 for the GEMMs around it, so half of a 1859-token prompt's step was attention
// (docs/benchmarks.md, "Rerun 2026-12-04: bf16 on Zen 5"). This kernel is flash attention in the panel kernels'
// manner: vdpbf16ps for Q K^T and for P V (bf16 products, fp32 sums), an online softmax in fp32 per query row,
// and key blocks past a row's causal limit skipped (a chunk of n new tokens at the end of ctx: query i sees keys
// 0 .. ctx - n + i, so a whole prompt and a continuation chunk are the same call).
//
// Layouts: q [n][Hq][D], k and v [ctx][Hkv][D] (contiguous bf16), out [n][Hq][D] bf16; query head h reads kv head
// h / (Hq / Hkv) (k and v may also be read in place from a KV pool: see pack_k). Per kv head, the AVX-512 loop packs
// k as [key vectors of 16][D/2][16] bf16 pairs (the B operand of a 16-key dot product) and v as [key pairs][D][2] (the
// AMX path: pack_heads_amx); both are zero-padded to whole blocks of BK keys, and scores past a row's limit are -inf,
// so the padding never reaches the output. P is rounded to bf16 for the P V products, as flash
// attention kernels do in bf16.

#include "kiln_kernels.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#include "transpose16.h"

constexpr int MR = 6;     // query rows per micro-kernel (6 x 4 score vectors, then 6 x 4 output vectors)
constexpr int BK = 64;    // keys per block: 4 vectors of 16
constexpr int KV = BK / 16;
constexpr int BQ = 16;    // query positions per task (times the group's heads: its rows)

bool cpu_ok() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
}

#define KILN_ATTN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// k512: the AVX-512 code, entered only where cpu_ok() (the library runs on AVX2-only CPUs too)
namespace k512 {

// 2^x for x <= 127 (scores minus a running max: x <= 0 in the AVX-512 path, <= LAZY in the AMX one), relative error
// ~2e-7; 2^x for x <= -150 is 0.
KILN_ATTN_TARGET inline __m512 exp2_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.6931471805599453f));  // f ln 2, |f| <= 0.35
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 2^x to ~5e-5 relative (degree 4 where exp2_neg has 6), x <= 127: for P that is rounded to bf16 (2^-9) before it
// multiplies v, as the AMX path does; its row sums see the same error, ~10x below the output's own rounding.
KILN_ATTN_TARGET inline __m512 exp2_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 24);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace k512

// The two element types. Bf16: q, k and v bf16, the dot products vdpbf16ps on pairs (a q word is a pair of d; a
// packed k word a pair of d of one key; a packed v word a pair of keys at one d; P is rounded to bf16 pairs). F32:
// fp32 throughout, one FMA per d (q, k) or per key (P, v); nothing is rounded below fp32.
struct Bf16 {
  using E = uint16_t;   // an element of q, k, v and out
  using W = uint32_t;   // a step's word: a bf16 pair
  static constexpr int PACK = 2;
};
struct F32 {
  using E = float;
  using W = float;
  static constexpr int PACK = 1;
};

// Key j's row of kv head h is at k + (slot[j] * hkv + h) * D: slot[j] = j for k [ctx][Hkv][D], or its slot in a KV
// pool's layer [blocks][block_size][Hkv][D] (a sequence's keys read in place, not gathered first).

// k head h -> kp [ctx_pad/16][D/PACK][16] words (16 keys per vector, one word of d per step)
template <class T>
void pack_k(const typename T::E* k, const int64_t* slot, int64_t ctx, int64_t ctx_pad, int64_t hkv, int64_t h,
            int64_t D, typename T::W* kp) {
  const int64_t S = D / T::PACK;
  for (int64_t j0 = 0; j0 < ctx_pad; j0 += 16)
    for (int64_t st = 0; st < S; ++st)
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t j = j0 + t;
        typename T::W w{};
        if (j < ctx) std::memcpy(&w, k + (slot[j] * hkv + h) * D + st * T::PACK, sizeof(w));
        kp[(j0 / 16 * S + st) * 16 + t] = w;
      }
}

// v head h -> vp [ctx_pad/PACK][D] words (bf16: the pair (key even, key odd) per d; fp32: v's rows)
template <class T>
void pack_v(const typename T::E* v, const int64_t* slot, int64_t ctx, int64_t ctx_pad, int64_t hkv, int64_t h,
            int64_t D, typename T::W* vp) {
  for (int64_t j = 0; j < ctx_pad; j += T::PACK)
    for (int64_t d = 0; d < D; ++d) {
      if constexpr (T::PACK == 2) {
        const uint32_t lo = j < ctx ? v[(slot[j] * hkv + h) * D + d] : 0;
        const uint32_t hi = j + 1 < ctx ? v[(slot[j + 1] * hkv + h) * D + d] : 0;
        vp[(j / 2) * D + d] = lo | (hi << 16);
      } else {
        vp[j * D + d] = j < ctx ? v[(slot[j] * hkv + h) * D + d] : 0.0f;
      }
    }
}

template <class T>
struct Rows {
  const typename T::W* q[MR];  // each row's query as D/PACK words
  typename T::E* out[MR];      // where its output goes (nullptr: a padding row)
  int64_t limit[MR];           // last key the row sees
};

namespace k512 {

// acc + w * x: w 16 lanes of words (as loaded), x one word broadcast (bf16: a pair, both products summed)
template <class T>
KILN_ATTN_TARGET inline __m512 dot(__m512 acc, __m512 w, typename T::W x) {
  if constexpr (T::PACK == 2) {
    int32_t bits;
    std::memcpy(&bits, &x, 4);
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(bits));
  } else {
    return _mm512_fmadd_ps(w, _mm512_set1_ps(x), acc);
  }
}

template <class W>
KILN_ATTN_TARGET inline __m512 load16(const W* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }

// One micro-block of MR query rows against every key block up to their largest limit.
template <class T>
KILN_ATTN_TARGET void attend_rows(const Rows<T>& r, const typename T::W* kp, const typename T::W* vp, int64_t D,
                                  float scale_log2) {
  using W = typename T::W;
  const int64_t S = D / T::PACK, DV = D / 16;
  alignas(64) float o[MR][256];  // D <= 256
  alignas(64) W pbuf[MR][BK / T::PACK];
  float m[MR], l[MR];
  for (int i = 0; i < MR; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
    std::memset(o[i], 0, sizeof(float) * size_t(D));
  }
  int64_t last = 0;
  for (int i = 0; i < MR; ++i) last = std::max(last, r.limit[i]);
  const int64_t blocks = last / BK + 1;
  for (int64_t b = 0; b < blocks; ++b) {
    // scores: s[i][t] = q_i . k_(b*BK + 16t + lane)
    __m512 s[MR][KV];
    for (int i = 0; i < MR; ++i)
      for (int t = 0; t < KV; ++t) s[i][t] = _mm512_setzero_ps();
    const W* kb = kp + b * KV * S * 16;
    for (int64_t st = 0; st < S; ++st) {
      __m512 kk[KV];
      for (int t = 0; t < KV; ++t) kk[t] = load16(kb + (t * S + st) * 16);
      for (int i = 0; i < MR; ++i) {
        const W x = r.q[i][st];
        for (int t = 0; t < KV; ++t) s[i][t] = dot<T>(s[i][t], kk[t], x);
      }
    }
    // online softmax per row (P rounded to bf16 pairs for the bf16 P V products)
    float alpha[MR];
    for (int i = 0; i < MR; ++i) {
      const int64_t visible = r.limit[i] - b * BK + 1;  // keys of this block the row sees (may be <= 0 or > BK)
      __m512 mx = _mm512_set1_ps(-INFINITY);
      __mmask16 keep[KV];
      for (int t = 0; t < KV; ++t) {
        s[i][t] = _mm512_mul_ps(s[i][t], _mm512_set1_ps(scale_log2));
        const int64_t n = std::clamp<int64_t>(visible - 16 * t, 0, 16);
        keep[t] = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
        mx = _mm512_mask_max_ps(mx, keep[t], mx, s[i][t]);
      }
      const float mb = _mm512_reduce_max_ps(mx);
      const float mnew = std::max(m[i], mb);
      if (mnew == -INFINITY) {  // nothing visible yet in this row (its limit is behind this block)
        alpha[i] = 1.0f;
        std::memset(pbuf[i], 0, sizeof(pbuf[i]));
        continue;
      }
      alpha[i] = m[i] == -INFINITY ? 0.0f : std::exp2(m[i] - mnew);
      m[i] = mnew;
      __m512 sum = _mm512_setzero_ps();
      for (int t = 0; t < KV; ++t) {
        const __m512 p = _mm512_maskz_mov_ps(keep[t], exp2_neg(_mm512_sub_ps(s[i][t], _mm512_set1_ps(mnew))));
        sum = _mm512_add_ps(sum, p);
        if constexpr (T::PACK == 2)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbuf[i] + 8 * t), (__m256i)_mm512_cvtneps_pbh(p));
        else
          _mm512_storeu_ps(pbuf[i] + 16 * t, p);
      }
      l[i] = l[i] * alpha[i] + _mm512_reduce_add_ps(sum);
    }
    // o[i] = o[i] * alpha[i] + sum_j p[i][j] v_j, 64 dims (4 vectors) at a time
    const W* vb = vp + b * (BK / T::PACK) * D;
    for (int64_t c = 0; c < DV; c += 4) {
      __m512 acc[MR][4];
      for (int i = 0; i < MR; ++i)
        for (int u = 0; u < 4; ++u)
          acc[i][u] = _mm512_mul_ps(_mm512_loadu_ps(o[i] + (c + u) * 16), _mm512_set1_ps(alpha[i]));
      for (int js = 0; js < BK / T::PACK; ++js) {
        __m512 vv[4];
        for (int u = 0; u < 4; ++u) vv[u] = load16(vb + js * D + (c + u) * 16);
        for (int i = 0; i < MR; ++i) {
          const W x = pbuf[i][js];
          for (int u = 0; u < 4; ++u) acc[i][u] = dot<T>(acc[i][u], vv[u], x);
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int u = 0; u < 4; ++u) _mm512_storeu_ps(o[i] + (c + u) * 16, acc[i][u]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if (r.out[i] == nullptr) continue;
    const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
    for (int64_t c = 0; c < DV; ++c) {
      const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(o[i] + c * 16), inv);
      if constexpr (T::PACK == 2)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.out[i] + c * 16), (__m256i)_mm512_cvtneps_pbh(y));
      else
        _mm512_storeu_ps(r.out[i] + c * 16, y);
    }
  }
}

}  // namespace k512

// ---- AMX (bf16) -------------------------------------------------------------------------------------------------
// Where the CPU has AMX-BF16 and the OS grants tile state, the bf16 kernel computes Q K^T and P V as tile products
// (16 x 16 x 32 per instruction) instead of vdpbf16ps, which leaves the online softmax as most of the work: on a
// 2-core Sapphire Rapids the vdpbf16ps loop ran ~150 GFLOP/s, torch's SDPA ~300-440 and this path 0.5-1.0 TFLOP/s
// (docs/benchmarks.md). It works transposed: a micro-block of 16 query rows is the 16 columns of its tiles, so
// S^T = K Q^T puts keys in tile rows (A: 16 keys x 32 dims straight from the keys' rows) and the 16 rows' scores of
// one key in one vector. The online softmax then runs down the keys with every quantity a vector over the rows
// (running max, sum, rescale factor): no horizontal reductions and no per-row masks, where the row-major layout
// spent a reduction and two mask computations per row and block (x1.05-1.25 on prompts of 256-2000 tokens). P^T,
// rounded to bf16 and paired by key, is the B operand of O^T = V^T P^T (A: 16 dims x 32 keys of the values, which
// pack_heads_amx transposes per block of 64 keys). O^T is accumulated in fp32 in memory, since tiles cannot be
// scaled: when a row's reference max moves, O^T's rows are multiplied by the factors before the next P V adds to
// them; the reference moves only when a block passes it by LAZY, so that is rare. Tiles: 0-3 scores, 4 query pairs,
// 5-6 keys; then 0-3 output, 4-5 P^T, 6-7 values (every tile 16 rows x 64 bytes, kiln_amx_tiles_begin's config).
// Issuing the next block's scores before this block's softmax (to overlap the two units) measured no faster.
// In k512:: as all AVX-512 code is.
namespace k512::amx {

constexpr int RA = 16;   // query rows per micro-block
constexpr int BKA = 64;  // keys per block (four score tiles; P^T as two B tiles)
constexpr float LAZY = 8.0f;   // log2 units a block's max may pass a row's reference max before it moves
static_assert(BK % BKA == 0, "k and v are packed in whole blocks of BK keys");

struct RowsA {
  const uint16_t* q[RA];   // each row's query, D bf16
  uint16_t* out[RA];       // where its output goes (nullptr: a padding row)
  int64_t limit[RA];       // last key the row sees
};

#define KILN_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// The word order of a P^T row of key pair (2j, 2j + 1): word k is query row k / 2's P at key 2j + (k & 1), the
// permutation of cvtne2ps's output (key 2j's 16 rows in words 0-15, key 2j + 1's in 16-31).
KILN_AMX_TARGET inline __m512i pair_order() {
  alignas(64) int16_t idx[32];
  for (int k = 0; k < 32; ++k) idx[k] = int16_t(k / 2 + (k & 1) * 16);
  return _mm512_load_si512(idx);
}

// The rows (lanes) whose limit is at or past key j
KILN_AMX_TARGET inline __mmask16 seen(__m512i limits, int64_t j) {
  return _mm512_cmp_epi32_mask(_mm512_set1_epi32(int32_t(j)), limits, _MM_CMPINT_LE);
}

// One micro-block of 16 query rows (transposed: the rows are the tiles' 16 columns) against every key block up to
// their largest limit. kh: this kv head's keys [ctx_pad][D]; vt: its values transposed per block of 64 keys,
// [ctx_pad / 64][D][64] (both zero past the context).
KILN_AMX_TARGET void attend_rows(const RowsA& r, const uint16_t* kh, const uint16_t* vt, int64_t D,
                                 float scale_log2) {
  const int64_t S = D / 2;
  alignas(64) uint32_t qt[128 * RA];        // the rows' query pairs, transposed: [S][16]
  alignas(64) float ot[256 * RA];           // O^T: [D][16]
  alignas(64) float st[BKA * RA];           // a block's S^T: [64 keys][16]
  alignas(64) uint32_t pt[BKA / 2 * RA];    // P^T as bf16 key pairs: [32][16]
  alignas(64) int32_t lim[RA];
  int64_t last = 0, first = INT64_MAX;
  for (int64_t p0 = 0; p0 < S; p0 += 16) {   // 16 pairs of the 16 rows at a time
    __m512i x[16];
    for (int i = 0; i < RA; ++i) x[i] = _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(r.q[i]) + p0);
    transpose16(x);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(qt + (p0 + j) * RA, x[j]);
  }
  for (int i = 0; i < RA; ++i) {
    lim[i] = int32_t(r.limit[i]);
    last = std::max(last, r.limit[i]);
    first = std::min(first, r.limit[i]);
  }
  std::memset(ot, 0, sizeof(float) * size_t(D * RA));
  const __m512i limits = _mm512_load_si512(lim), order = pair_order();
  const __m512 scale = _mm512_set1_ps(scale_log2), neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 m = neg_inf, l = _mm512_setzero_ps();   // per row: reference max (log2 units), running sum of P
  const int64_t kstride = D * 2, vstride = BKA * 2, blocks = last / BKA + 1;
  for (int64_t b = 0; b < blocks; ++b) {
    // S^T of the block: tiles 0-3 (16 keys each) over the query pairs 32 dims at a time, then into st
    const int64_t kb = b * BKA;
    const uint16_t* k0 = kh + kb * D;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(4, qt + c * 16 * RA, 64);
      _tile_loadd(5, k0 + c * 32, kstride);
      _tile_loadd(6, k0 + 16 * D + c * 32, kstride);
      _tile_dpbf16ps(0, 5, 4);
      _tile_dpbf16ps(1, 6, 4);
      _tile_loadd(5, k0 + 32 * D + c * 32, kstride);
      _tile_loadd(6, k0 + 48 * D + c * 32, kstride);
      _tile_dpbf16ps(2, 5, 4);
      _tile_dpbf16ps(3, 6, 4);
    }
    _tile_stored(0, st, 64);
    _tile_stored(1, st + 16 * RA, 64);
    _tile_stored(2, st + 32 * RA, 64);
    _tile_stored(3, st + 48 * RA, 64);
    // every row sees every key of the block, or the keys up to its limit (lane masks per key)
    const bool full = kb + BKA - 1 <= first;
    __m512 mx0 = neg_inf, mx1 = neg_inf;
    if (full) {
      for (int64_t j = 0; j < BKA; j += 2) {
        mx0 = _mm512_max_ps(mx0, _mm512_load_ps(st + j * RA));
        mx1 = _mm512_max_ps(mx1, _mm512_load_ps(st + (j + 1) * RA));
      }
    } else {
      for (int64_t j = 0; j < BKA; j += 2) {
        mx0 = _mm512_mask_max_ps(mx0, seen(limits, kb + j), mx0, _mm512_load_ps(st + j * RA));
        mx1 = _mm512_mask_max_ps(mx1, seen(limits, kb + j + 1), mx1, _mm512_load_ps(st + (j + 1) * RA));
      }
    }
    // The reference max moves only where a block's passes it by more than LAZY (log2 units): P is then at most
    // 2^LAZY (exact in fp32, within bf16's range) and most blocks rescale nothing. Every row sees key 0, so its
    // reference is finite after block 0 (alpha there, 2^-inf, is 0).
    const __m512 bm = _mm512_mul_ps(_mm512_max_ps(mx0, mx1), scale);
    const __mmask16 moved = _mm512_cmp_ps_mask(bm, _mm512_add_ps(m, _mm512_set1_ps(LAZY)), _CMP_GT_OQ);
    const __m512 mnew = _mm512_mask_blend_ps(moved, m, bm);
    const __m512 alpha = k512::exp2_neg(_mm512_sub_ps(m, mnew));
    m = mnew;
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int64_t j = 0; j < BKA; j += 2) {
      __m512 p0 = k512::exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(st + j * RA), scale, m));
      __m512 p1 = k512::exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(st + (j + 1) * RA), scale, m));
      if (!full) {
        p0 = _mm512_maskz_mov_ps(seen(limits, kb + j), p0);
        p1 = _mm512_maskz_mov_ps(seen(limits, kb + j + 1), p1);
      }
      sum0 = _mm512_add_ps(sum0, p0);
      sum1 = _mm512_add_ps(sum1, p1);
      _mm512_store_si512(pt + j / 2 * RA, _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
    }
    l = _mm512_fmadd_ps(l, alpha, _mm512_add_ps(sum0, sum1));
    if (moved && b > 0)
      for (int64_t d = 0; d < D; ++d) _mm512_store_ps(ot + d * RA, _mm512_mul_ps(_mm512_load_ps(ot + d * RA), alpha));
    // O^T += V^T P^T, 64 dims (four output tiles) at a time, written out tile by tile: GCC's tile intrinsics paste
    // the tile number into their asm text, so it must be a literal (not a loop index or template argument)
    _tile_loadd(4, pt, 64);            // keys 0-31
    _tile_loadd(5, pt + 16 * RA, 64);  // keys 32-63
    const uint16_t* v0 = vt + kb * D;   // this block's [D][64]
    for (int64_t e = 0; e < D; e += 64) {
      _tile_loadd(0, ot + e * RA, 64);
      _tile_loadd(1, ot + (e + 16) * RA, 64);
      _tile_loadd(2, ot + (e + 32) * RA, 64);
      _tile_loadd(3, ot + (e + 48) * RA, 64);
      _tile_loadd(6, v0 + e * BKA, vstride);
      _tile_loadd(7, v0 + e * BKA + 32, vstride);
      _tile_dpbf16ps(0, 6, 4);
      _tile_dpbf16ps(0, 7, 5);
      _tile_loadd(6, v0 + (e + 16) * BKA, vstride);
      _tile_loadd(7, v0 + (e + 16) * BKA + 32, vstride);
      _tile_dpbf16ps(1, 6, 4);
      _tile_dpbf16ps(1, 7, 5);
      _tile_loadd(6, v0 + (e + 32) * BKA, vstride);
      _tile_loadd(7, v0 + (e + 32) * BKA + 32, vstride);
      _tile_dpbf16ps(2, 6, 4);
      _tile_dpbf16ps(2, 7, 5);
      _tile_loadd(6, v0 + (e + 48) * BKA, vstride);
      _tile_loadd(7, v0 + (e + 48) * BKA + 32, vstride);
      _tile_dpbf16ps(3, 6, 4);
      _tile_dpbf16ps(3, 7, 5);
      _tile_stored(0, ot + e * RA, 64);
      _tile_stored(1, ot + (e + 16) * RA, 64);
      _tile_stored(2, ot + (e + 32) * RA, 64);
      _tile_stored(3, ot + (e + 48) * RA, 64);
    }
  }
  // out row i = O^T's column i / its sum: 16 dims of the 16 rows transposed at a time
  alignas(64) float inv[RA];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
  for (int64_t c = 0; c < D; c += 16) {
    __m512i x[16];
    for (int j = 0; j < 16; ++j) x[j] = _mm512_load_si512(ot + (c + j) * RA);
    transpose16(x);
    for (int i = 0; i < RA; ++i)
      if (r.out[i] != nullptr)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.out[i] + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps((__m512)x[i], _mm512_set1_ps(inv[i]))));
  }
}

}  // namespace k512::amx

std::atomic<int> g_attention_amx{-1};   // -1: not chosen yet (on where kiln_amx_tiles_permitted)

bool attention_amx() {
  int on = g_attention_amx.load(std::memory_order_relaxed);
  if (on < 0) {
    on = cpu_ok() && kiln_amx_tiles_permitted() ? 1 : 0;
    g_attention_amx.store(on);
  }
  return on == 1;
}

// The AMX path's operands of kv head h: its keys as rows [ctx_pad][D] and its values transposed per block of 64 keys
// [ctx_pad / 64][D][64] (a tile of 16 dims x 32 keys is then 64-byte rows 128 bytes apart, where [D][ctx_pad] puts
// them ctx_pad * 2 bytes apart: at 2048 keys, 4 KiB, every row in the same L1 set), zero past the context (keys
// there score 0 and are masked; their values multiply a P of 0).
void pack_heads_amx(const uint16_t* k, const uint16_t* v, const int64_t* slot, int64_t ctx, int64_t ctx_pad,
                    int64_t hkv, int64_t h, int64_t D, uint16_t* kh, uint16_t* vt) {
  for (int64_t j = 0; j < ctx; ++j)
    std::memcpy(kh + j * D, k + (slot[j] * hkv + h) * D, sizeof(uint16_t) * size_t(D));
  std::memset(kh + ctx * D, 0, sizeof(uint16_t) * size_t((ctx_pad - ctx) * D));
  constexpr int64_t BKA = k512::amx::BKA;
  for (int64_t j0 = 0; j0 < ctx_pad; j0 += BKA)   // a block's rows (8-32 KB) read once per d from L1
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = j0; j < j0 + BKA; ++j)
        vt[j0 * D + d * BKA + j - j0] = j < ctx ? v[(slot[j] * hkv + h) * D + d] : uint16_t(0);
}

template <class T>
int causal_attention(const void* q, const void* k, const void* v, void* out, int64_t n, int64_t ctx, int64_t hq,
                     int64_t hkv, int64_t D, float scale, int nthreads, const int32_t* table, int64_t block_size,
                     int64_t num_blocks) {
  using E = typename T::E;
  using W = typename T::W;
  if (!cpu_ok()) return 1;
  if (n <= 0 || ctx < n || hkv <= 0 || hq % hkv != 0 || D % 64 != 0 || D > 256) return 2;
  if (table != nullptr && block_size <= 0) return 2;
  thread_local std::vector<int64_t> slots;   // each key's row (slot) in k and v
  slots.resize(size_t(ctx));
  for (int64_t j = 0; j < ctx; ++j) {
    if (table == nullptr) {
      slots[j] = j;
      continue;
    }
    const int64_t b = table[j / block_size];
    if (b < 0 || b >= num_blocks) return 2;   // the caller's gather path names the bad block
    slots[j] = b * block_size + j % block_size;
  }
  const int64_t* const slot = slots.data();
  const int64_t group = hq / hkv, S = D / T::PACK;
  const int64_t ctx_pad = (ctx + BK - 1) / BK * BK;
  const int nt = std::max(1, nthreads);
  auto* oe = static_cast<E*>(out);
  const int64_t start = ctx - n;                 // position of the first new token
  const int64_t qblocks = (n + BQ - 1) / BQ;
  const int64_t tasks = hkv * qblocks;
  const float scale_log2 = scale * 1.4426950408889634f;
  if constexpr (T::PACK == 2) {
    if (attention_amx()) {
      // the packed operands, kept by the calling thread between calls (a prompt's layers reuse them)
      thread_local std::vector<uint16_t> kbuf, vbuf;
      kbuf.resize(size_t(hkv * ctx_pad * D));
      vbuf.resize(size_t(hkv * ctx_pad * D));
      uint16_t* const kh = kbuf.data();
      uint16_t* const vt = vbuf.data();
      const auto* qe = static_cast<const uint16_t*>(q);
      const auto* ke = static_cast<const uint16_t*>(k);
      const auto* ve = static_cast<const uint16_t*>(v);
#pragma omp parallel num_threads(nt)
      {
#pragma omp for schedule(static)
        for (int64_t h = 0; h < hkv; ++h)
          pack_heads_amx(ke, ve, slot, ctx, ctx_pad, hkv, h, D, kh + h * ctx_pad * D, vt + h * ctx_pad * D);
        kiln_amx_tiles_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t) {   // later query blocks first, as below
          const int64_t qb = qblocks - 1 - t / hkv, h = t % hkv;
          const int64_t i0 = qb * BQ, i1 = std::min(n, i0 + BQ);
          const int64_t rows = (i1 - i0) * group;
          for (int64_t r0 = 0; r0 < rows; r0 += k512::amx::RA) {
            k512::amx::RowsA rb;
            for (int i = 0; i < k512::amx::RA; ++i) {
              const int64_t r = std::min(r0 + i, rows - 1);
              const int64_t pos = i0 + r / group, head = h * group + r % group;
              rb.q[i] = qe + (pos * hq + head) * D;
              rb.out[i] = r0 + i < rows ? oe + (pos * hq + head) * D : nullptr;
              rb.limit[i] = start + pos;
            }
            k512::amx::attend_rows(rb, kh + h * ctx_pad * D, vt + h * ctx_pad * D, D, scale_log2);
          }
        }
        kiln_amx_tiles_end();
      }
      if (kbuf.size() > (size_t(32) << 20)) {   // a very long context's buffers are not kept
        std::vector<uint16_t>().swap(kbuf);
        std::vector<uint16_t>().swap(vbuf);
      }
      return 0;
    }
  }
  std::vector<W> kp(size_t(hkv * ctx_pad * S)), vp(size_t(hkv * ctx_pad / T::PACK * D));
  const auto* ke = static_cast<const E*>(k);
  const auto* ve = static_cast<const E*>(v);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t h = 0; h < 2 * hkv; ++h) {
    if (h < hkv) pack_k<T>(ke, slot, ctx, ctx_pad, hkv, h, D, kp.data() + h * ctx_pad * S);
    else pack_v<T>(ve, slot, ctx, ctx_pad, hkv, h - hkv, D, vp.data() + (h - hkv) * ctx_pad / T::PACK * D);
  }
  const auto* qw = static_cast<const W*>(q);
  // later query blocks see more keys: hand them out first
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t qb = qblocks - 1 - t / hkv, h = t % hkv;
    const int64_t i0 = qb * BQ, i1 = std::min(n, i0 + BQ);
    const int64_t rows = (i1 - i0) * group;      // row r: position i0 + r / group, head h * group + r % group
    const W* kh = kp.data() + h * ctx_pad * S;
    const W* vh = vp.data() + h * ctx_pad / T::PACK * D;
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
      Rows<T> rb;
      for (int i = 0; i < MR; ++i) {
        const int64_t r = std::min(r0 + i, rows - 1);  // padding rows repeat the last row, not stored
        const int64_t pos = i0 + r / group, head = h * group + r % group;
        rb.q[i] = qw + (pos * hq + head) * S;
        rb.out[i] = r0 + i < rows ? oe + (pos * hq + head) * D : nullptr;
        rb.limit[i] = start + pos;
      }
      k512::attend_rows<T>(rb, kh, vh, D, scale_log2);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

int kiln_causal_attention_available() { return cpu_ok() ? 1 : 0; }

int kiln_causal_attention_bf16(const void* q, const void* k, const void* v, void* out, int64_t n, int64_t ctx,
                               int64_t hq, int64_t hkv, int64_t D, float scale, int nthreads, const int32_t* table,
                               int64_t block_size, int64_t num_blocks) {
  return causal_attention<Bf16>(q, k, v, out, n, ctx, hq, hkv, D, scale, nthreads, table, block_size, num_blocks);
}

int kiln_causal_attention_f32(const void* q, const void* k, const void* v, void* out, int64_t n, int64_t ctx,
                              int64_t hq, int64_t hkv, int64_t D, float scale, int nthreads, const int32_t* table,
                              int64_t block_size, int64_t num_blocks) {
  return causal_attention<F32>(q, k, v, out, n, ctx, hq, hkv, D, scale, nthreads, table, block_size, num_blocks);
}

int kiln_causal_attention_amx() { return attention_amx() ? 1 : 0; }

int kiln_causal_attention_set_amx(int on) {
  const int before = attention_amx() ? 1 : 0;
  g_attention_amx.store(on && cpu_ok() && kiln_amx_tiles_permitted() ? 1 : 0);
  return before;
}

}  // extern "C"
