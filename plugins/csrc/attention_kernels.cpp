// Causal attention of a prompt chunk over its sequence's cached context (prefill), bf16, on AVX-512 BF16 (no torch).
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

// k [ctx][Hkv][D] head h -> kp [ctx_pad/16][D/2][16] int32 words (bf16 pairs (d even, d odd) of 16 keys)
void pack_k(const uint16_t* k, int64_t ctx, int64_t ctx_pad, int64_t hkv, int64_t h, int64_t D, uint32_t* kp) {
  const int64_t P = D / 2;
  for (int64_t j0 = 0; j0 < ctx_pad; j0 += 16)
    for (int64_t dp = 0; dp < P; ++dp)
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t j = j0 + t;
        uint32_t w = 0;
        if (j < ctx) {
          const uint16_t* row = k + (j * hkv + h) * D;
          w = uint32_t(row[2 * dp]) | (uint32_t(row[2 * dp + 1]) << 16);
        }
        kp[(j0 / 16 * P + dp) * 16 + t] = w;
      }
}

// v [ctx][Hkv][D] head h -> vp [ctx_pad/2][D] int32 words (bf16 pairs (key even, key odd) per d)
void pack_v(const uint16_t* v, int64_t ctx, int64_t ctx_pad, int64_t hkv, int64_t h, int64_t D, uint32_t* vp) {
  for (int64_t j = 0; j < ctx_pad; j += 2)
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t lo = j < ctx ? v[(j * hkv + h) * D + d] : 0;
      const uint32_t hi = j + 1 < ctx ? v[((j + 1) * hkv + h) * D + d] : 0;
      vp[(j / 2) * D + d] = lo | (hi << 16);
    }
}

struct Rows {
  const uint32_t* q[MR];  // each row's query as D/2 bf16 pairs
  uint16_t* out[MR];      // where its output goes (nullptr: a padding row)
  int64_t limit[MR];      // last key the row sees
};

namespace k512 {

// One micro-block of MR query rows against every key block up to their largest limit.
KILN_ATTN_TARGET void attend_rows(const Rows& r, const uint32_t* kp, const uint32_t* vp, int64_t D, float scale_log2) {
  const int64_t P = D / 2, DV = D / 16;
  alignas(64) float o[MR][256];  // D <= 256
  alignas(64) uint16_t pbuf[MR][BK];
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
    const uint32_t* kb = kp + b * KV * P * 16;
    for (int64_t dp = 0; dp < P; ++dp) {
      __m512bh kk[KV];
      for (int t = 0; t < KV; ++t)
        kk[t] = (__m512bh)_mm512_loadu_si512(kb + (t * P + dp) * 16);
      for (int i = 0; i < MR; ++i) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(int(r.q[i][dp]));
        for (int t = 0; t < KV; ++t) s[i][t] = _mm512_dpbf16_ps(s[i][t], kk[t], qb);
      }
    }
    // online softmax per row; P rounded to bf16 for the P V products
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
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbuf[i] + 16 * t), (__m256i)_mm512_cvtneps_pbh(p));
      }
      l[i] = l[i] * alpha[i] + _mm512_reduce_add_ps(sum);
    }
    // o[i] = o[i] * alpha[i] + sum_j p[i][j] v_j, 64 dims (4 vectors) at a time
    const uint32_t* vb = vp + b * (BK / 2) * D;
    for (int64_t c = 0; c < DV; c += 4) {
      __m512 acc[MR][4];
      for (int i = 0; i < MR; ++i)
        for (int u = 0; u < 4; ++u)
          acc[i][u] = _mm512_mul_ps(_mm512_loadu_ps(o[i] + (c + u) * 16), _mm512_set1_ps(alpha[i]));
      for (int jp = 0; jp < BK / 2; ++jp) {
        __m512bh vv[4];
        for (int u = 0; u < 4; ++u)
          vv[u] = (__m512bh)_mm512_loadu_si512(vb + jp * D + (c + u) * 16);
        for (int i = 0; i < MR; ++i) {
          uint32_t pair;
          std::memcpy(&pair, pbuf[i] + 2 * jp, 4);
          const __m512bh pb = (__m512bh)_mm512_set1_epi32(int(pair));
          for (int u = 0; u < 4; ++u) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], vv[u], pb);
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int u = 0; u < 4; ++u) _mm512_storeu_ps(o[i] + (c + u) * 16, acc[i][u]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if (r.out[i] == nullptr) continue;
    const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
    for (int64_t c = 0; c < DV; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.out[i] + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o[i] + c * 16), inv)));
  }
}

}  // namespace k512

}  // namespace

extern "C" {

int kiln_causal_attention_available() { return cpu_ok() ? 1 : 0; }

int kiln_causal_attention_bf16(const void* q, const void* k, const void* v, void* out, int64_t n, int64_t ctx,
                               int64_t hq, int64_t hkv, int64_t D, float scale, int nthreads) {
  if (!cpu_ok()) return 1;
  if (n <= 0 || ctx < n || hkv <= 0 || hq % hkv != 0 || D % 64 != 0 || D > 256) return 2;
  const int64_t group = hq / hkv, P = D / 2;
  const int64_t ctx_pad = (ctx + BK - 1) / BK * BK;
  std::vector<uint32_t> kp(size_t(hkv * ctx_pad * P)), vp(size_t(hkv * ctx_pad / 2 * D));
  const auto* k16 = static_cast<const uint16_t*>(k);
  const auto* v16 = static_cast<const uint16_t*>(v);
  const int nt = std::max(1, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t h = 0; h < 2 * hkv; ++h) {
    if (h < hkv) pack_k(k16, ctx, ctx_pad, hkv, h, D, kp.data() + h * ctx_pad * P);
    else pack_v(v16, ctx, ctx_pad, hkv, h - hkv, D, vp.data() + (h - hkv) * ctx_pad / 2 * D);
  }
  const auto* q32 = static_cast<const uint32_t*>(q);
  auto* o16 = static_cast<uint16_t*>(out);
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
    const uint32_t* kh = kp.data() + h * ctx_pad * P;
    const uint32_t* vh = vp.data() + h * ctx_pad / 2 * D;
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
      Rows rb;
      for (int i = 0; i < MR; ++i) {
        const int64_t r = std::min(r0 + i, rows - 1);  // padding rows repeat the last row, not stored
        const int64_t pos = i0 + r / group, head = h * group + r % group;
        rb.q[i] = q32 + (pos * hq + head) * P;
        rb.out[i] = r0 + i < rows ? o16 + (pos * hq + head) * D : nullptr;
        rb.limit[i] = start + pos;
      }
      k512::attend_rows(rb, kh, vh, D, scale_log2);
    }
  }
  return 0;
}

}  // extern "C"
