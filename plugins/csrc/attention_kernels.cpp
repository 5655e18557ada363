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
// h / (Hq / Hkv). Per kv head, k is packed as [key vectors of 16][D/2][16] bf16 pairs (the B operand of a 16-key
// dot product) and v as [key pairs][D][2]; both are zero-padded to whole blocks of BK keys, and scores past a row's
// limit are -inf, so the padding never reaches the output. P is rounded to bf16 for the P V products, as flash
// attention kernels do in bf16.

#include "kiln_kernels.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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

// 2^x for x <= 0 (scores minus their running max), relative error ~2e-7; 2^x for x <= -150 is 0.
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

// k [ctx][Hkv][D] head h -> kp [ctx_pad/16][D/PACK][16] words (16 keys per vector, one word of d per step)
template <class T>
void pack_k(const typename T::E* k, int64_t ctx, int64_t ctx_pad, int64_t hkv, int64_t h, int64_t D,
            typename T::W* kp) {
  const int64_t S = D / T::PACK;
  for (int64_t j0 = 0; j0 < ctx_pad; j0 += 16)
    for (int64_t st = 0; st < S; ++st)
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t j = j0 + t;
        typename T::W w{};
        if (j < ctx) std::memcpy(&w, k + (j * hkv + h) * D + st * T::PACK, sizeof(w));
        kp[(j0 / 16 * S + st) * 16 + t] = w;
      }
}

// v [ctx][Hkv][D] head h -> vp [ctx_pad/PACK][D] words (bf16: the pair (key even, key odd) per d; fp32: v's rows)
template <class T>
void pack_v(const typename T::E* v, int64_t ctx, int64_t ctx_pad, int64_t hkv, int64_t h, int64_t D,
            typename T::W* vp) {
  for (int64_t j = 0; j < ctx_pad; j += T::PACK)
    for (int64_t d = 0; d < D; ++d) {
      if constexpr (T::PACK == 2) {
        const uint32_t lo = j < ctx ? v[(j * hkv + h) * D + d] : 0;
        const uint32_t hi = j + 1 < ctx ? v[((j + 1) * hkv + h) * D + d] : 0;
        vp[(j / 2) * D + d] = lo | (hi << 16);
      } else {
        vp[j * D + d] = j < ctx ? v[(j * hkv + h) * D + d] : 0.0f;
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

template <class T>
int causal_attention(const void* q, const void* k, const void* v, void* out, int64_t n, int64_t ctx, int64_t hq,
                     int64_t hkv, int64_t D, float scale, int nthreads) {
  using E = typename T::E;
  using W = typename T::W;
  if (!cpu_ok()) return 1;
  if (n <= 0 || ctx < n || hkv <= 0 || hq % hkv != 0 || D % 64 != 0 || D > 256) return 2;
  const int64_t group = hq / hkv, S = D / T::PACK;
  const int64_t ctx_pad = (ctx + BK - 1) / BK * BK;
  std::vector<W> kp(size_t(hkv * ctx_pad * S)), vp(size_t(hkv * ctx_pad / T::PACK * D));
  const auto* ke = static_cast<const E*>(k);
  const auto* ve = static_cast<const E*>(v);
  const int nt = std::max(1, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t h = 0; h < 2 * hkv; ++h) {
    if (h < hkv) pack_k<T>(ke, ctx, ctx_pad, hkv, h, D, kp.data() + h * ctx_pad * S);
    else pack_v<T>(ve, ctx, ctx_pad, hkv, h - hkv, D, vp.data() + (h - hkv) * ctx_pad / T::PACK * D);
  }
  const auto* qw = static_cast<const W*>(q);
  auto* oe = static_cast<E*>(out);
  const int64_t start = ctx - n;                 // position of the first new token
  const int64_t qblocks = (n + BQ - 1) / BQ;
  const int64_t tasks = hkv * qblocks;
  const float scale_log2 = scale * 1.4426950408889634f;
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
                               int64_t hq, int64_t hkv, int64_t D, float scale, int nthreads) {
  return causal_attention<Bf16>(q, k, v, out, n, ctx, hq, hkv, D, scale, nthreads);
}

int kiln_causal_attention_f32(const void* q, const void* k, const void* v, void* out, int64_t n, int64_t ctx,
                              int64_t hq, int64_t hkv, int64_t D, float scale, int nthreads) {
  return causal_attention<F32>(q, k, v, out, n, ctx, hq, hkv, D, scale, nthreads);
}

}  // extern "C"
