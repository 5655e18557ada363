// CPU kernels of kiln::rms_norm, kiln::fused_add_rms_norm, kiln::rotary_embedding, kiln::silu_mul,
// kiln::gelu and kiln::paged_attention, registered with the dispatcher when the native library loads
// (the schemas are defined from Python, next to the fake kernels and the references). A Python
// kernel costs ~30-40 us of dispatch per call; these run with no Python per call.
//
// Coverage: fp32 / bf16 contiguous-able tensors of the shapes the models use. Anything else
// (other dtypes, mismatched shapes, out-of-range indices, kernels disabled) goes to the Python
// implementations (kiln::_<op>_py), which also own the error messages.
//
// paged_attention: the new K/V are written into the pool here (quantized for an int8 / fp8 pool); decode
// sequences (one new token) are computed here (decode_attention.h, AVX2 or AVX-512), one work item per
// (sequence, kv head): the group's query heads share one pass over the keys and values, read through the
// block table in tiles (each row widened to fp32 once, an 8-bit row's scale applied to the score and to the
// value's weight), scores in fp32 (soft-capped when asked) with an exact softmax (max, exp, sum). Only the
// slots inside each sequence's context (and window) are read, so whatever the rest of the pool holds (stale
// values, NaN) cannot leak in. Context sequences (more than SHORT_SEQ_TOKENS new tokens) go to the Python SDPA
// path, kiln::_paged_attention_context_py; short ones (a speculative verify: the last token and its proposals)
// run as decode rows, one per token, each over its own causal prefix of the context.

#include "kiln_kernels.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using BF = c10::BFloat16;

// ---------------------------------------------------------------------------------------------
// fallbacks (Python implementations)

Tensor rms_norm_py(const Tensor& x, const Tensor& w, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::_rms_norm_py", "")
                       .typed<Tensor(const Tensor&, const Tensor&, double)>();
  return op.call(x, w, eps);
}

std::tuple<Tensor, Tensor> fused_py(const Tensor& x, const Tensor& r, const Tensor& w, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::_fused_add_rms_norm_py", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>();
  return op.call(x, r, w, eps);
}

std::tuple<Tensor, Tensor> rotary_py(const Tensor& q, const Tensor& k, const Tensor& p, const Tensor& t) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::_rotary_embedding_py", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>();
  return op.call(q, k, p, t);
}

Tensor silu_mul_py(const Tensor& g, const Tensor& u) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::_silu_mul_py", "")
                       .typed<Tensor(const Tensor&, const Tensor&)>();
  return op.call(g, u);
}

Tensor argmax_rows_py(const Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::_argmax_rows_py", "")
                       .typed<Tensor(const Tensor&)>();
  return op.call(x);
}

Tensor gelu_py(const Tensor& x, c10::string_view a) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::_gelu_py", "")
                       .typed<Tensor(const Tensor&, c10::string_view)>();
  return op.call(x, a);
}

Tensor paged_py(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& kv, int64_t layer,
                const Tensor& sl, const Tensor& cl, const Tensor& bt, const Tensor& sm, double scale,
                int64_t window, double softcap) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::_paged_attention_py", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, int64_t,
                                     const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                                     int64_t, double)>();
  return op.call(q, k, v, kv, layer, sl, cl, bt, sm, scale, window, softcap);
}

void paged_context_py(const Tensor& q, const Tensor& kv, int64_t layer, const Tensor& sl, const Tensor& cl,
                      const Tensor& bt, Tensor& out, double scale, int64_t window, double softcap, int64_t min_len) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::_paged_attention_context_py", "")
                       .typed<void(const Tensor&, const Tensor&, int64_t, const Tensor&, const Tensor&,
                                   const Tensor&, Tensor&, double, int64_t, double, int64_t)>();
  op.call(q, kv, layer, sl, cl, bt, out, scale, window, softcap, min_len);
}

bool enabled() { return kiln_ops_enabled() != 0; }

bool f32_or_bf16(const Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

inline float to_f(float v) { return v; }
inline float to_f(BF v) { return static_cast<float>(v); }
template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }

// The sums of eight vectors, in order: [sum(a0), ..., sum(a7)].
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp on 8 lanes (Cephes polynomial, rel. error ~1e-7 on [-87, 88]); inputs below -87 give ~0.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}

int64_t grain_rows(int64_t d) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d)); }

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = w * cast(x * rsqrt(mean(x^2) + eps)) with x in fp32 (Llama's definition)

// One pass by hand, with no ATen op inside: on a decode step's one 1024-vector the reference's own reduction
// (xf.pow(2).mean(-1): two TensorIterator ops and their allocations) cost more than the rest of the call. The
// squares are summed in fp32 over 8-lane partial sums, so the mean differs from the reference's in its last bits
// (a different order of the same fp32 additions). Built without FMA contraction so each product rounds as in
// the reference.
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const BF* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// sum of x[j]^2 in fp32 (each square rounded, as pow(2) does)
template <typename T>
__attribute__((optimize("fp-contract=off"))) float sum_squares(const T* x, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= d; j += 32) {
    const __m256 v0 = widen8(x + j), v1 = widen8(x + j + 8), v2 = widen8(x + j + 16), v3 = widen8(x + j + 24);
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));
    a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));
    a2 = _mm256_add_ps(a2, _mm256_mul_ps(v2, v2));
    a3 = _mm256_add_ps(a3, _mm256_mul_ps(v3, v3));
  }
  for (; j + 8 <= d; j += 8) {
    const __m256 v = widen8(x + j);
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(v, v));
  }
  float total = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; j < d; ++j) {
    const float v = to_f(x[j]);
    total += v * v;
  }
  return total;
}

// y = w * cast(x * inv) of one row
template <typename T>
__attribute__((optimize("fp-contract=off"))) void scale_row(const T* x, const T* w, T* y, int64_t d, float inv) {
  for (int64_t j = 0; j < d; ++j) {
    const T normed = from_f<T>(to_f(x[j]) * inv);  // rounded to x's dtype before the scale
    y[j] = from_f<T>(to_f(w[j]) * to_f(normed));
  }
}

inline float inv_rms(float sum_sq, int64_t d, float eps) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(d) + eps);
}

template <typename T>
void rms_norm_into(const Tensor& xc, const Tensor& wc, Tensor& y, double eps) {
  const int64_t d = xc.size(-1), rows = xc.numel() / d;
  const T* x = xc.const_data_ptr<T>();
  const T* w = wc.const_data_ptr<T>();
  T* out = y.data_ptr<T>();
  // rows below the grain run on this thread: a parallel region costs more than one short row
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      scale_row(x + r * d, w, out + r * d, d, inv_rms(sum_squares(x + r * d, d), d, static_cast<float>(eps)));
  });
}

bool norm_ok(const Tensor& x, const Tensor& w) {
  return enabled() && f32_or_bf16(x) && w.scalar_type() == x.scalar_type() && x.dim() >= 1 &&
         w.dim() == 1 && w.size(0) == x.size(-1) && x.numel() > 0;
}

Tensor rms_norm_cpu(const Tensor& x, const Tensor& weight, double eps) {
  if (!norm_ok(x, weight)) return rms_norm_py(x, weight, eps);
  const Tensor xc = x.contiguous(), wc = weight.contiguous();
  Tensor y = at::empty_like(xc);
  if (x.scalar_type() == at::kFloat)
    rms_norm_into<float>(xc, wc, y, eps);
  else
    rms_norm_into<BF>(xc, wc, y, eps);
  return y;
}

// s = x + residual (rounded to T) and y = rms_norm(s) row by row: each row is summed, squared and scaled while
// it is in L1.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void add_norm_rows(const T* x, const T* res, const T* w, T* s, T* y,
                                                                  int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * d;
      const T* rr = res + r * d;
      T* sr = s + r * d;
      for (int64_t j = 0; j < d; ++j) sr[j] = from_f<T>(to_f(xr[j]) + to_f(rr[j]));
      scale_row(sr, w, y + r * d, d, inv_rms(sum_squares(sr, d), d, eps));
    }
  });
}

std::tuple<Tensor, Tensor> fused_add_rms_norm_cpu(const Tensor& x, const Tensor& residual,
                                                  const Tensor& weight, double eps) {
  if (!norm_ok(x, weight) || residual.scalar_type() != x.scalar_type() || !residual.sizes().equals(x.sizes()))
    return fused_py(x, residual, weight, eps);
  const Tensor xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  Tensor summed = at::empty_like(xc), y = at::empty_like(xc);
  const int64_t d = x.size(-1), rows = x.numel() / d;
  if (x.scalar_type() == at::kFloat)
    add_norm_rows(xc.const_data_ptr<float>(), rc.const_data_ptr<float>(), wc.const_data_ptr<float>(),
                  summed.data_ptr<float>(), y.data_ptr<float>(), rows, d, static_cast<float>(eps));
  else
    add_norm_rows(xc.const_data_ptr<BF>(), rc.const_data_ptr<BF>(), wc.const_data_ptr<BF>(), summed.data_ptr<BF>(),
                  y.data_ptr<BF>(), rows, d, static_cast<float>(eps));
  return {y, summed};
}

// ---------------------------------------------------------------------------------------------
// rotary (rotate-half): table [P, D] fp32, cos in the first half, sin in the second

template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate(const T* x, T* y, int64_t tokens, int64_t heads, int64_t d, const int64_t* pos,
            const float* table) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, grain_rows(heads * d), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* cs = table + pos[t] * d;
      const float* sn = cs + half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (t * heads + h) * d;
        T* yr = y + (t * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(xr[i]), x2 = to_f(xr[i + half]);
          yr[i] = from_f<T>(x1 * cs[i] - x2 * sn[i]);
          yr[i + half] = from_f<T>(x2 * cs[i] + x1 * sn[i]);
        }
      }
    }
  });
}

std::tuple<Tensor, Tensor> rotary_embedding_cpu(const Tensor& q, const Tensor& k, const Tensor& position_ids,
                                                const Tensor& table) {
  const bool shapes = q.dim() == 3 && k.dim() == 3 && position_ids.dim() == 1 && table.dim() == 2 &&
                      q.size(0) == k.size(0) && q.size(0) == position_ids.size(0) && q.size(2) == k.size(2) &&
                      table.size(1) == q.size(2) && q.size(2) % 2 == 0;
  if (!enabled() || !shapes || !f32_or_bf16(q) || k.scalar_type() != q.scalar_type() ||
      table.scalar_type() != at::kFloat || position_ids.scalar_type() != at::kLong)
    return rotary_py(q, k, position_ids, table);
  const Tensor pc = position_ids.contiguous();
  const int64_t* pos = pc.const_data_ptr<int64_t>();
  const int64_t n = pc.numel(), maxp = table.size(0);
  for (int64_t i = 0; i < n; ++i)
    if (pos[i] < 0 || pos[i] >= maxp) return rotary_py(q, k, position_ids, table);  // raises there
  const Tensor qc = q.contiguous(), kc = k.contiguous(), tc = table.contiguous();
  Tensor qo = at::empty_like(qc), ko = at::empty_like(kc);
  const int64_t d = q.size(2);
  if (q.scalar_type() == at::kFloat) {
    rotate(qc.const_data_ptr<float>(), qo.data_ptr<float>(), n, q.size(1), d, pos, tc.const_data_ptr<float>());
    rotate(kc.const_data_ptr<float>(), ko.data_ptr<float>(), n, k.size(1), d, pos, tc.const_data_ptr<float>());
  } else {
    rotate(qc.const_data_ptr<BF>(), qo.data_ptr<BF>(), n, q.size(1), d, pos, tc.const_data_ptr<float>());
    rotate(kc.const_data_ptr<BF>(), ko.data_ptr<BF>(), n, k.size(1), d, pos, tc.const_data_ptr<float>());
  }
  return {qo, ko};
}

// ---------------------------------------------------------------------------------------------
// activations: silu_mul in one pass by hand (fp32/bf16 rows with unit stride: a decode step's slices of the
// fused gate-up projection); gelu and the other layouts through ATen's vectorised kernels, called from C++

// 8 fp32 -> bf16, rounded to nearest even as c10::BFloat16 does (a NaN becomes 0x7fc0)
inline __m128i bf16_round8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
inline __m256 widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }

// silu(g) = g / (1 + exp(-g)) with exp8 (Cephes, rel. error ~1e-7: not the bits of ATen's Sleef exp), rounded to
// T before the product with up, as silu_mul_reference does
template <typename T>
__attribute__((optimize("fp-contract=off"))) void silu_mul_row(const T* g, const T* u, T* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = widen8(g + j);
    const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
    if constexpr (std::is_same<T, float>::value) {
      _mm256_storeu_ps(y + j, _mm256_mul_ps(silu, _mm256_loadu_ps(u + j)));
    } else {
      const __m256 prod = _mm256_mul_ps(widen_bf16(bf16_round8(silu)), widen8(u + j));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + j), bf16_round8(prod));
    }
  }
  for (; j < n; ++j) {
    const float x = to_f(g[j]);
    const T silu = from_f<T>(x / (1.0f + std::exp(-x)));
    y[j] = from_f<T>(to_f(silu) * to_f(u[j]));
  }
}

// argmax_rows: [rows, n] fp32 -> int64 [rows], torch.argmax(dim=1)'s answer (the first of equal maxima, the first
// NaN of a row that has one). A row is split into pieces of at least ARGMAX_PIECE values so that a batch of fewer
// rows than threads still uses them all (each thread then reads what it wrote as its half of the LM head).
constexpr int64_t ARGMAX_PIECE = 4096;

struct ArgmaxPiece {
  float value;
  int64_t index;
  bool nan;
};

// [lo, hi) of p: one pass for the max (and whether a NaN is there), one for the first index that holds it.
ArgmaxPiece argmax_piece(const float* p, int64_t lo, int64_t hi) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 unord = _mm256_setzero_ps();
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8) {
    const __m256 v = _mm256_loadu_ps(p + j);
    m = _mm256_max_ps(m, v);
    unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = *std::max_element(lanes, lanes + 8);
  bool nan = _mm256_movemask_ps(unord) != 0;
  for (; j < hi; ++j) {
    nan |= std::isnan(p[j]);
    mx = std::max(mx, p[j]);
  }
  if (nan) {
    for (j = lo; j < hi; ++j)
      if (std::isnan(p[j])) return {p[j], j, true};
  }
  const __m256 target = _mm256_set1_ps(mx);
  for (j = lo; j + 8 <= hi; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + j), target, _CMP_EQ_OQ));
    if (hit) return {mx, j + __builtin_ctz(static_cast<unsigned>(hit)), false};
  }
  for (; j < hi; ++j)
    if (p[j] == mx) return {mx, j, false};
  return {mx, lo, false};  // every value -inf
}

Tensor argmax_rows_cpu(const Tensor& x) {
  if (!enabled() || x.dim() != 2 || x.scalar_type() != at::kFloat || x.size(0) == 0 || x.size(1) == 0)
    return argmax_rows_py(x);
  const Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>((threads + rows - 1) / rows, n / ARGMAX_PIECE));
  const int64_t len = (n + parts - 1) / parts;
  std::vector<ArgmaxPiece> pieces(rows * parts);
  const float* p = xc.const_data_ptr<float>();
  at::parallel_for(0, rows * parts, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / parts, lo = (i % parts) * len;
      pieces[i] = argmax_piece(p + r * n, lo, std::min(n, lo + len));
    }
  });
  Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    ArgmaxPiece best = pieces[r * parts];
    for (int64_t c = 1; c < parts && !best.nan; ++c) {
      const ArgmaxPiece& a = pieces[r * parts + c];
      if (a.nan || a.value > best.value) best = a;
    }
    o[r] = best.index;
  }
  return out;
}

Tensor silu_mul_cpu(const Tensor& gate, const Tensor& up) {
  if (!enabled() || gate.scalar_type() != up.scalar_type() || !gate.sizes().equals(up.sizes()))
    return silu_mul_py(gate, up);
  const bool rows = gate.dim() == 2 && gate.stride(1) == 1 && up.stride(1) == 1 && gate.numel() > 0;
  if (!rows || !f32_or_bf16(gate)) {
    Tensor y = at::silu(gate);
    return y.mul_(up);
  }
  const int64_t n = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  Tensor y = at::empty({gate.size(0), n}, gate.options());
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* g = gate.const_data_ptr<T>();
    const T* u = up.const_data_ptr<T>();
    T* o = y.data_ptr<T>();
    at::parallel_for(0, gate.size(0), grain_rows(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) silu_mul_row(g + r * gs, u + r * us, o + r * n, n);
    });
  };
  if (gate.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<BF*>(nullptr));
  return y;
}

Tensor gelu_cpu(const Tensor& x, c10::string_view approximate) {
  if (!enabled() || !(approximate == "none" || approximate == "tanh")) return gelu_py(x, approximate);
  return at::gelu(x, approximate);
}

// ---------------------------------------------------------------------------------------------
// paged attention

// The element types of a pool. A float pool's row (one token's keys or values of one KV head) is head_dim
// values. An 8-bit pool's row (int8, or fp8 = e4m3) is head_dim numbers followed by their bf16 scale in the
// row's last 2 bytes (kiln/plugins/kv_quant.py owns the layout; this file computes the same bytes):
// value = Isa::widen(number) * row_scale(row), where row_scale folds in the unit widen leaves out.
using F8 = c10::Float8_e4m3fn;
template <typename KV>
struct Pool {
  static constexpr bool quantized = false;
  static constexpr int64_t extra = 0;  // bytes of scale after the head_dim numbers
};
template <>
struct Pool<int8_t> {
  static constexpr bool quantized = true;
  static constexpr int64_t extra = 2;
  static constexpr float qmax = 127.0f, unit = 1.0f;
};
template <>
struct Pool<F8> {
  static constexpr bool quantized = true;
  static constexpr int64_t extra = 2;
  static constexpr float qmax = 448.0f, unit = 256.0f;  // widen reads e4m3 as fp16: 2^-8 of its value
};

// one element in widen's unit (the scalar tails)
inline float num(float v) { return v; }
inline float num(BF v) { return static_cast<float>(v); }
inline float num(int8_t v) { return static_cast<float>(v); }
inline float num(F8 v) { return static_cast<float>(v) * (1.0f / 256.0f); }

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t b = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// The scale of an 8-bit row whose numbers start at ``row`` (1 for a float pool).
template <typename KV>
inline float row_scale(const KV* row, int64_t d) {
  if constexpr (Pool<KV>::quantized) {
    uint16_t bits;
    std::memcpy(&bits, row + d, sizeof(bits));
    return bf16_bits_to_float(bits) * Pool<KV>::unit;
  } else {
    return 1.0f;
  }
}

// x (positive, finite) rounded up to a bfloat16: its bits
inline uint16_t ceil_bf16_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return static_cast<uint16_t>((b + 0xFFFFu) >> 16);
}

// Quantize each token's row of each KV head into the 8-bit pool (kv_quant.to_pool, bit for bit): scale =
// max|x| / qmax rounded up to a bf16 (at least float32's smallest normal), numbers = x / scale, clamped,
// rounded to nearest even (int8) or converted to e4m3 by c10 (the conversion torch's .to() uses).
template <typename S, typename KV>
void write_quantized(const S* src, KV* dst, const int64_t* slots, int64_t tokens, int64_t hkv, int64_t d) {
  const int64_t row = d + Pool<KV>::extra;
  const float qmax = Pool<KV>::qmax;
  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, hkv * d)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < hkv; ++h) {
        const S* x = src + (t * hkv + h) * d;
        KV* o = dst + (slots[t] * hkv + h) * row;
        float amax = 0.0f;
        for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(to_f(x[j])));
        const uint16_t bits = ceil_bf16_bits(std::max(amax / qmax, std::numeric_limits<float>::min()));
        const float sc = bf16_bits_to_float(bits);
        for (int64_t j = 0; j < d; ++j) {
          const float n = std::min(std::max(to_f(x[j]) / sc, -qmax), qmax);
          if constexpr (std::is_same<KV, int8_t>::value)
            o[j] = static_cast<int8_t>(std::nearbyint(n));
          else
            o[j] = F8(n);
        }
        std::memcpy(o + d, &bits, sizeof(bits));
      }
  });
}

template <typename S, typename D>
void write_slots(const S* src, D* dst, const int64_t* slots, int64_t tokens, int64_t row) {
  for (int64_t t = 0; t < tokens; ++t) {
    D* o = dst + slots[t] * row;
    const S* i = src + t * row;
    if constexpr (std::is_same<S, D>::value) {
      std::memcpy(o, i, row * sizeof(D));
    } else {
      for (int64_t j = 0; j < row; ++j) o[j] = from_f<D>(to_f(i[j]));
    }
  }
}

// this step's keys (values) [tokens, hkv, d] into the pool part at ``offset`` (elements of the pool's type)
template <typename S>
void write_kv_typed(const Tensor& src, Tensor& kv, int64_t offset, const int64_t* slots, int64_t tokens,
                    int64_t hkv, int64_t d) {
  const S* s = src.const_data_ptr<S>();
  switch (kv.scalar_type()) {
    case at::kFloat: write_slots(s, kv.data_ptr<float>() + offset, slots, tokens, hkv * d); break;
    case at::kBFloat16: write_slots(s, kv.data_ptr<BF>() + offset, slots, tokens, hkv * d); break;
    case at::kChar: write_quantized(s, kv.data_ptr<int8_t>() + offset, slots, tokens, hkv, d); break;
    default: write_quantized(s, kv.data_ptr<F8>() + offset, slots, tokens, hkv, d); break;
  }
}

// Software prefetch of the KV rows KV_AHEAD positions ahead in decode attention (the blocks of a sequence are
// scattered, which the hardware prefetchers do not follow).
constexpr int64_t KV_AHEAD = 16;
// Sequences of at most this many new tokens (speculative verifies) run on the decode kernel, one row per token;
// longer ones (prefill chunks) on SDPA, where one GEMM over the context serves all their rows.
constexpr int64_t SHORT_SEQ_TOKENS = 16;

// One cache line into L1 (LEVEL 0) or L2 (LEVEL 1). An asm statement, not _mm_prefetch: GCC 12 at -O3 deletes a
// loop nest whose only effect is _mm_prefetch (a loop over rows of a loop over a row's lines: prefetching several
// rows at once), and a volatile asm cannot be removed, so every prefetch here is one that runs.
template <int LEVEL>
inline void prefetch_line_to(const char* p) {
  if constexpr (LEVEL == 0) asm volatile("prefetcht0 %0" : : "m"(*p));
  else asm volatile("prefetcht1 %0" : : "m"(*p));
}

// every cache line of the n elements at p (a row of an 8-bit pool is not line-aligned)
template <int LEVEL, typename T>
inline void prefetch_lines(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * int64_t(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 64) prefetch_line_to<LEVEL>(c + b);
  prefetch_line_to<LEVEL>(c + bytes - 1);
}

// The KV row of one position a decode work item reads (span elements: one kv head, or every kv head of the slot).
// An item over every kv head streams whole slots in position order, bandwidth-bound: its rows go to L2, where far
// more lines can be in flight than L1's miss buffers allow (docs/benchmarks.md, session 19: faster from memory for
// batched rows and long split rows); an item over one kv head reads a part of each slot and wants it in L1.
template <typename T>
__attribute__((always_inline)) inline void prefetch_row(const T* p, int64_t span, bool whole_slots) {
  if (whole_slots) prefetch_lines<1>(p, span);
  else prefetch_lines<0>(p, span);
}

// One decode work item (a query row over kv head h), what it reads, and the buffers of one thread
// (decode_attention.h).
struct Item {
  int64_t row, ctx, lo, len;  // q/out row, context length, first position read, positions read
  int64_t h, nh;              // the kv heads [h, h + nh) (their groups' query heads) this item computes
  const int32_t* table;       // the sequence's block table
  int64_t part = -1;          // a part of a split row: its index in decode_attention's parts buffer
};

struct Geometry {
  int64_t block_size, slot_stride, block_stride, kvrow, d, group, hq;
};

// Buffers of one thread, reused across its items and calls.
struct Scratch {
  std::vector<float> qf, acc, scores, tile, weights, vscale, zeros, ml;
  std::vector<uint16_t> wbf;  // the softmax weights as bf16 (k512::bf16dot)
  std::vector<const float*> rows;
  std::vector<int64_t> offs;
};

// offs[p]: where the row of position it.lo + p (kv head it.h) starts in a layer's K or V pool, for p < len: the
// block table read once per block, no division per row.
inline const int64_t* row_offsets(const Item& it, const Geometry& g, Scratch& s) {
  s.offs.resize(it.len);
  int64_t blk = it.lo / g.block_size, o = it.lo % g.block_size;
  const int64_t head = it.h * g.kvrow;
  int64_t base = it.table[blk] * g.block_stride + head;
  for (int64_t p = 0; p < it.len; ++p) {
    s.offs[p] = base + o * g.slot_stride;
    if (++o == g.block_size && p + 1 < it.len) {
      o = 0;
      base = it.table[++blk] * g.block_stride + head;
    }
  }
  return s.offs.data();
}

// scores [rows][len] -> each row's softmax in place (fp32; AVX2, which every path of the library has), after
// soft-capping (Gemma 2: cap * tanh(score / cap)) where softcap > 0: the one softmax of every decode kernel.
// ml != nullptr (a part of a split context): exp(score - max) left unnormalized, each row's max and sum in ml.
inline void softmax_rows(float* scores, int64_t rows, int64_t len, float softcap, float* ml = nullptr) {
  if (softcap > 0.0f)
    for (int64_t i = 0; i < rows * len; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  for (int64_t r = 0; r < rows; ++r) {
    float* sg = scores + r * len;
    __m256 vm = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t p = 0;
    for (; p + 8 <= len; p += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sg + p));
    alignas(32) float m8[8];
    _mm256_store_ps(m8, vm);
    float mx = *std::max_element(m8, m8 + 8);
    for (; p < len; ++p) mx = std::max(mx, sg[p]);
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vs = _mm256_setzero_ps();
    for (p = 0; p + 8 <= len; p += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + p), vmx));
      _mm256_storeu_ps(sg + p, e);
      vs = _mm256_add_ps(vs, e);
    }
    float sum = hsum(vs);
    for (; p < len; ++p) {
      sg[p] = std::exp(sg[p] - mx);
      sum += sg[p];
    }
    if (ml != nullptr) {
      ml[2 * r] = mx;
      ml[2 * r + 1] = sum;
      continue;
    }
    const float inv = 1.0f / sum;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (p = 0; p + 8 <= len; p += 8) _mm256_storeu_ps(sg + p, _mm256_mul_ps(_mm256_loadu_ps(sg + p), vinv));
    for (; p < len; ++p) sg[p] *= inv;
  }
}

// The vector ISAs of decode attention (decode_attention.h, once per ISA): AVX2 + FMA + F16C everywhere,
// AVX-512 where kiln_panel_isa() says 512 (the CPU has it and KILN_PANEL_ISA=256 does not force AVX2).
// widen(p): L numbers of a pool row in the pool's unit; e4m3 -> the fp16 with the same bits moved (sign to bit
// 15, exponent and mantissa to bits 13..7), which is its value / 2^8 exactly (subnormals included: the
// fp16 subnormals F16C widens exactly); the 2^8 is in the row's scale (Pool<F8>::unit).
namespace k256 {
struct Isa {
  using V = __m256;
  static constexpr int L = 8;
  static constexpr int GB = 2;  // query heads per pass over a value row (16 registers: 2 x 4 accumulators)
  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V set1(float v) { return _mm256_set1_ps(v); }
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V widen(const float* p) { return _mm256_loadu_ps(p); }
  static inline V widen(const BF* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline V widen(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static inline V widen(const F8* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(b, 8), 1), _mm_set1_epi16(static_cast<short>(0xBFFF)));
    return _mm256_cvtph_ps(h);
  }
  static inline __m256 reduce8(const V* a) { return hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]); }
};
#include "decode_attention.h"
}  // namespace k256

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace k512 {
struct Isa {
  using V = __m512;
  static constexpr int L = 16;
  static constexpr int GB = 4;  // query heads per pass over a value row (32 registers: 4 x 4 accumulators)
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V set1(float v) { return _mm512_set1_ps(v); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V widen(const float* p) { return _mm512_loadu_ps(p); }
  static inline V widen(const BF* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline V widen(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static inline V widen(const F8* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1),
                                       _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    return _mm512_cvtph_ps(h);
  }
  static inline __m256 half_sum(V v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  static inline __m256 reduce8(const V* a) {
    return hsum8(half_sum(a[0]), half_sum(a[1]), half_sum(a[2]), half_sum(a[3]), half_sum(a[4]), half_sum(a[5]),
                 half_sum(a[6]), half_sum(a[7]));
  }
};
#include "decode_attention.h"
}  // namespace k512
#pragma GCC pop_options

// Decode attention of a bf16 pool with bf16 queries on AVX-512 BF16 (Zen 4 / Zen 5 / Sapphire Rapids): the
// products on vdpbf16ps (bf16 pairs, fp32 sums) instead of widening every row to fp32. Scores: 16 positions' key
// rows (one vector per 32 dims) transposed in registers so that each vector holds one pair of dims for the 16
// positions; each query head then takes one dot product per pair (its pair broadcast) into a vector of 16
// scores: no horizontal sums. Values: two positions' rows interleaved (unpacklo/hi_epi16: lane pairs
// (v_p[j], v_p+1[j])) times the broadcast pair of their weights, rounded to bf16 as flash attention kernels round P.
// The fp32 softmax between the two passes is softmax_rows, as on the float path. Same item as decode_attention.h's
// (a query row's group over its kv head); head_dim a multiple of 32, at most 256.

// whether k512::bf16dot runs a head_dim of d here (checked outside the AVX-512 code: it runs on any CPU)
bool bf16dot_usable(int64_t d) {
  static const bool cpu = __builtin_cpu_supports("avx512bf16");
  return cpu && kiln_panel_isa() == 512 && d % 32 == 0 && d <= 256;
}

#include "transpose16.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace k512::bf16dot {   // k512: the library's rule for AVX-512 code (test_panel_kernels checks it)

inline __m512 dot(__m512 acc, __m512i a, uint32_t pair) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32(int32_t(pair)));
}

// f(std::integral_constant<int, N>()) for the N of Ns equal to n (the callers' n is always one of them): a runtime
// count as a template argument, so that the kernels' loops over it have compile-time bounds.
template <int... Ns, class F>
inline void with_constant(int64_t n, F&& f) {
  (void)((n == Ns && (f(std::integral_constant<int, Ns>()), true)) || ...);
}

// Scores of GN query heads (query pairs at qw, head i's at qw + i * d / 2) against n <= 16 positions of one kv
// head (rows at kh + off[u]), scaled, into dst[i * len + u]. GN is a template argument so that the GN score
// vectors stay in registers (a runtime count indexes them in memory).
template <int GN>
inline void score_tile(const uint16_t* kh, const int64_t* off, int64_t n, int64_t chunks, const uint32_t* qw,
                       int64_t d, float scale, float* dst, int64_t len) {
  const __mmask16 keep = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
  __m512 acc[GN];
  for (int i = 0; i < GN; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i r[16];
    for (int64_t u = 0; u < 16; ++u)
      r[u] = u < n ? _mm512_loadu_si512(kh + off[u] + 32 * c) : _mm512_setzero_si512();
    transpose16(r);  // r[j]: dims (32c + 2j, 32c + 2j + 1) of the 16 positions
    for (int i = 0; i < GN; ++i) {
      const uint32_t* qh = qw + i * d / 2 + 16 * c;
      for (int j = 0; j < 16; ++j) acc[i] = dot(acc[i], r[j], qh[j]);
    }
  }
  for (int i = 0; i < GN; ++i) _mm512_mask_storeu_ps(dst + i * len, keep, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
}

// What value_tile reads and where its accumulators live between tiles.
struct ValueTile {
  const uint16_t* vh;    // this kv head's value rows: vh + off[p]
  const uint16_t* vp;    // the pool (prefetches read whole spans from it)
  const int64_t* off;
  const uint16_t* wbf;   // the block's first query head's bf16 weights; head i's at wbf + i * lenp
  int64_t lenp, len, span;
  bool whole_slots, first_pass;
  float* acc;            // [gn][VECS][16] fp32 sums, in the lane order below
};

// Values of positions [t0, t1) for gn <= 16 / VECS query heads: o += w_p v_p + w_p+1 v_p+1 per pair of positions;
// vector 2c holds dims 32c + 8L + (0..3) in lane L (4 dwords), vector 2c + 1 dims 32c + 8L + (4..7). VECS (head_dim
// / 16) is a template argument and the head loops run to the compile-time bound with a guard, so that the
// accumulators are registers, not an array indexed in memory.
template <int VECS>
inline void value_tile(const ValueTile& t, int64_t gn, int64_t t0, int64_t t1) {
  constexpr int GMAX = 16 / VECS;
  constexpr int CHUNKS = VECS / 2;
  __m512 acc[GMAX][VECS];
#pragma GCC unroll 16
  for (int i = 0; i < GMAX; ++i)
    for (int v = 0; v < VECS; ++v)
      acc[i][v] = i < gn ? _mm512_loadu_ps(t.acc + (i * VECS + v) * 16) : _mm512_setzero_ps();
  for (int64_t p = t0; p < t1; p += 2) {
    if (t.first_pass && p + KV_AHEAD < t.len) {
      prefetch_row(t.vp + t.off[p + KV_AHEAD], t.span, t.whole_slots);
      if (p + 1 + KV_AHEAD < t.len) prefetch_row(t.vp + t.off[p + 1 + KV_AHEAD], t.span, t.whole_slots);
    }
    const uint16_t* va = t.vh + t.off[p];
    const bool two = p + 1 < t.len;
    const uint16_t* vb = two ? t.vh + t.off[p + 1] : nullptr;
    uint32_t pair[GMAX];   // each query head's weights of positions p, p + 1
#pragma GCC unroll 16
    for (int i = 0; i < GMAX; ++i)
      if (i < gn) std::memcpy(&pair[i], t.wbf + i * t.lenp + p, 4);
#pragma GCC unroll 8
    for (int c = 0; c < CHUNKS; ++c) {
      const __m512i a = _mm512_loadu_si512(va + 32 * c);
      const __m512i b = two ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 16
      for (int i = 0; i < GMAX; ++i)
        if (i < gn) {
          acc[i][2 * c] = dot(acc[i][2 * c], lo, pair[i]);
          acc[i][2 * c + 1] = dot(acc[i][2 * c + 1], hi, pair[i]);
        }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < GMAX; ++i)
    if (i < gn)
      for (int v = 0; v < VECS; ++v) _mm512_storeu_ps(t.acc + (i * VECS + v) * 16, acc[i][v]);
}

// As decode_attention.h's attend_item: kv heads [it.h, it.h + it.nh), output written (part == nullptr) or the
// parts of a split row (per query head max, sum, d fp32 sums) left for decode_attention to merge.
void attend_item(const BF* q, const BF* kpool, const BF* vpool, BF* out, float* part, const Item& it,
                 const Geometry& g, float scale, float softcap, Scratch& s) {
  const int64_t d = g.d, group = g.group, len = it.len, chunks = d / 32, vecs = d / 16;
  const int64_t heads = it.nh * group, lenp = (len + 1) / 2 * 2;
  s.scores.resize(heads * len);
  s.wbf.resize(heads * lenp);
  s.ml.resize(2 * heads);
  const int64_t* off = row_offsets(it, g, s);   // kv head it.h's rows; head it.h + h's are h * kvrow further
  const int64_t span = it.nh * g.kvrow;         // what one position of the item reads, prefetched as one
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(kpool);
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(vpool);
  const int64_t q0 = it.row * g.hq + it.h * group;
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(q) + q0 * d / 2;  // query head gi's pair j: qw[gi*d/2 + j]
  // scores, 16 positions at a time, per kv head in blocks of up to 8 of its query heads (score_tile)
  for (int64_t p0 = 0; p0 < len; p0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - p0);
    for (int64_t u = 0; u < n; ++u)
      if (p0 + u + KV_AHEAD < len) prefetch_row(kp + off[p0 + u + KV_AHEAD], span, it.nh > 1);
    for (int64_t h = 0; h < it.nh; ++h) {
      const uint16_t* kh = kp + h * g.kvrow;
      for (int64_t gb = h * group; gb < (h + 1) * group; gb += 8) {
        float* dst = s.scores.data() + gb * len + p0;
        with_constant<1, 2, 3, 4, 5, 6, 7, 8>(std::min<int64_t>(8, (h + 1) * group - gb), [&](auto gn) {
          score_tile<decltype(gn)::value>(kh, off + p0, n, chunks, qw + gb * d / 2, d, scale, dst, len);
        });
      }
    }
  }
  softmax_rows(s.scores.data(), heads, len, softcap, part ? s.ml.data() : nullptr);
  // each query head's weights as bf16 (a zero after an odd length: the pair of the last position)
  for (int64_t gi = 0; gi < heads; ++gi) {
    const float* sg = s.scores.data() + gi * len;
    uint16_t* wb = s.wbf.data() + gi * lenp;
    int64_t p = 0;
    for (; p + 16 <= len; p += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wb + p), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sg + p)));
    for (; p < lenp; ++p) wb[p] = p < len ? BF(sg[p]).x : uint16_t(0);
  }
  // values (value_tile), in blocks of query heads whose accumulators fit 16 registers. One kv head: every position
  // with the block's accumulators in registers. Several (a span): PTILE positions at a time, every kv head of them,
  // the accumulators kept in s.acc (value_tile's lane order) between tiles.
  constexpr int64_t PTILE = 32;
  const int64_t gblock = std::max<int64_t>(1, std::min<int64_t>(group, 16 / vecs));
  const int64_t tile = it.nh > 1 ? PTILE : lenp;
  s.acc.assign(heads * vecs * 16, 0.0f);
  for (int64_t t0 = 0; t0 < len; t0 += tile) {
    const int64_t t1 = std::min(len, t0 + tile);
    for (int64_t h = 0; h < it.nh; ++h) {
      const uint16_t* vh = vp + h * g.kvrow;
      for (int64_t gb = h * group; gb < (h + 1) * group; gb += gblock) {
        const int64_t gn = std::min<int64_t>(gblock, (h + 1) * group - gb);
        const bool first_pass = it.nh == 1 || (h == 0 && gb == 0);   // of a span: it prefetches
        const ValueTile t{vh, vp, off, s.wbf.data() + gb * lenp, lenp, len, span, it.nh > 1, first_pass,
                          s.acc.data() + gb * vecs * 16};
        with_constant<2, 4, 6, 8, 10, 12, 14, 16>(vecs, [&](auto v) {   // head_dim / 16 (bf16dot_usable)
          value_tile<decltype(v)::value>(t, gn, t0, t1);
        });
      }
    }
  }
  alignas(64) float o[16][16];
  for (int64_t gi = 0; gi < heads; ++gi) {
    for (int64_t v = 0; v < vecs; ++v) std::memcpy(o[v], s.acc.data() + (gi * vecs + v) * 16, 64);
    float* pg = part ? part + gi * (d + 2) : nullptr;
    if (pg) {
      pg[0] = s.ml[2 * gi];
      pg[1] = s.ml[2 * gi + 1];
    }
    BF* dst = out + (q0 + gi) * d;
    for (int64_t c = 0; c < chunks; ++c)
      for (int L = 0; L < 4; ++L)
        for (int k = 0; k < 8; ++k) {
          const float y = o[2 * c + (k >= 4)][4 * L + (k & 3)];
          if (pg) pg[2 + 32 * c + 8 * L + k] = y;
          else dst[32 * c + 8 * L + k] = BF(y);
        }
  }
}

}  // namespace k512::bf16dot
#pragma GCC pop_options

// Every decode sequence's attention (decode_attention.h, with the ISA the panel kernels use). Work items read
// every kv head of a row at once, each slot (all heads of a position) whole and in position order: one head's rows
// are a quarter of each slot, and such strided reads stream at ~16 GB/s on Zen 4 where whole slots in order stream
// at ~28 (a read-pattern test); measured x1.03-1.38 on the step's attention of 2-16 rows at 32-600 positions
// (docs/benchmarks.md). With fewer rows than threads, a row of at least tuning().attn_span_context positions
// is split into one part per thread, the parts' softmax sums merged at the end (flash-decoding), and a shorter one
// is one item per kv head, the group's query heads sharing one pass over that head's keys and values.
// attn_span_context 0: one item per kv head always.
// Items go to the threads as they free up (rows of different lengths).
// Threads only when there is enough work: a parallel region costs more than a tiny decode (batch 1, a few dozen
// positions). Past that, both cores pay: a decode step's weight stream has evicted the context, so one thread
// alone waits on memory (batch 1, context 128, 16 layers: ~0.9 -> ~0.5 ms a step on Zen 4).
template <typename Q, typename KV>
void decode_attention(const Q* q, const KV* kpool, const KV* vpool, Q* out, const std::vector<int64_t>& rows,
                      const std::vector<int64_t>& seqs, const int32_t* row_ctx, const int32_t* tables,
                      int64_t max_blocks, int64_t block_size, int64_t hkv, int64_t group, int64_t d,
                      float scale, int64_t window, float softcap) {
  const int64_t nrows = static_cast<int64_t>(rows.size());
  const int64_t threads = at::get_num_threads();
  const int64_t kvrow = d + Pool<KV>::extra;  // one token of one kv head (8-bit: + its scale)
  const int64_t slot_stride = hkv * kvrow;    // one token of one pool (all kv heads)
  const Geometry geo{block_size, slot_stride, block_size * slot_stride, kvrow, d, group, hkv * group};
  const bool wide = kiln_panel_isa() == 512;
  const bool bf16_dots = std::is_same_v<Q, BF> && std::is_same_v<KV, BF> && bf16dot_usable(d);
  // work items: with as many rows as threads, one per row (every kv head); with fewer, a short row one per kv head
  // and a long one one per part (every kv head)
  thread_local std::vector<Item> items;   // the calling thread's: its capacity kept across calls
  items.clear();
  std::vector<std::array<int64_t, 3>> split_rows;   // (row index n, first part, parts) of each split row
  const int64_t splits = std::max<int64_t>(1, threads / std::max<int64_t>(1, nrows));
  const int64_t span_context = kiln_attn_span_context();
  int64_t work = 0, parts = 0;
  for (int64_t n = 0; n < nrows; ++n) {
    const int64_t s = seqs[n], c = row_ctx[n];  // the positions this query row attends to: [0, c)
    const int64_t lo = window > 0 ? std::max<int64_t>(0, c - window) : 0, len = c - lo;
    const int32_t* table = tables + s * max_blocks;
    work += len;
    if (span_context == 0 || (nrows < threads && len < span_context)) {
      for (int64_t h = 0; h < hkv; ++h) items.push_back(Item{rows[n], c, lo, len, h, 1, table});
      continue;
    }
    const int64_t k = nrows < threads ? std::min(splits, len / std::max<int64_t>(1, span_context / 2)) : 1;
    if (k <= 1) {
      items.push_back(Item{rows[n], c, lo, len, 0, hkv, table});
      continue;
    }
    split_rows.push_back({n, parts, k});
    for (int64_t i = 0; i < k; ++i) {
      const int64_t a = lo + len * i / k, b = lo + len * (i + 1) / k;
      items.push_back(Item{rows[n], c, a, b - a, 0, hkv, table, parts++});
    }
  }
  work *= hkv * (group + 1) * d;
  const int64_t heads = hkv * group, part_size = heads * (d + 2);   // a part: per query head max, sum, d sums
  thread_local std::vector<float> part_buf;
  part_buf.resize(parts * part_size);
  // the parallel region's workers name their own thread_locals: they get these pointers
  float* const part_data = part_buf.data();
  const Item* const item_data = items.data();
  const auto run = [&](int64_t i, Scratch& scratch) {
    const Item& it = item_data[i];
    float* part = it.part < 0 ? nullptr : part_data + it.part * part_size;
    if constexpr (std::is_same_v<Q, BF> && std::is_same_v<KV, BF>)
      if (bf16_dots) return k512::bf16dot::attend_item(q, kpool, vpool, out, part, it, geo, scale, softcap, scratch);
    if (wide)
      k512::attend_item<Q, KV>(q, kpool, vpool, out, part, it, geo, scale, softcap, scratch);
    else
      k256::attend_item<Q, KV>(q, kpool, vpool, out, part, it, geo, scale, softcap, scratch);
  };
  thread_local Scratch scratch;
  const int64_t count = static_cast<int64_t>(items.size());
  if (work < (int64_t(1) << 14) || threads == 1 || count == 1) {
    for (int64_t i = 0; i < count; ++i) run(i, scratch);
  } else {
    // rows of different lengths: items handed out as threads free up
#pragma omp parallel for num_threads(int(std::min(threads, count))) schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) run(i, scratch);
  }
  // a split row: out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i over its parts i (M: their largest max)
  std::vector<float> y(split_rows.empty() ? 0 : d);
  for (const auto& [n, first, k] : split_rows) {
    for (int64_t gi = 0; gi < heads; ++gi) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t i = first; i < first + k; ++i) mx = std::max(mx, part_data[i * part_size + gi * (d + 2)]);
      float sum = 0.0f;
      std::fill(y.begin(), y.end(), 0.0f);
      for (int64_t i = first; i < first + k; ++i) {
        const float* pg = part_data + i * part_size + gi * (d + 2);
        const float w = std::exp(pg[0] - mx);
        sum += w * pg[1];
        for (int64_t j = 0; j < d; ++j) y[j] += w * pg[2 + j];
      }
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < d; ++j) out[(rows[n] * heads + gi) * d + j] = from_f<Q>(y[j] * inv);
    }
  }
}

template <typename Q>
void decode_dispatch_kv(const Tensor& qc, const Tensor& kv, int64_t layer, Tensor& out,
                        const std::vector<int64_t>& rows, const std::vector<int64_t>& seqs, const int32_t* ctx,
                        const int32_t* tables, int64_t max_blocks, float scale, int64_t window, float softcap) {
  const int64_t nb = kv.size(2), bs = kv.size(3), hkv = kv.size(4), d = qc.size(2);
  const int64_t pool = nb * bs * hkv * kv.size(5);  // elements of one layer's K (or V) pool
  const int64_t group = qc.size(1) / hkv;
  auto run = [&](auto* tag) {
    using KV = std::remove_pointer_t<decltype(tag)>;
    const KV* base = kv.const_data_ptr<KV>() + layer * 2 * pool;
    decode_attention<Q, KV>(qc.const_data_ptr<Q>(), base, base + pool, out.data_ptr<Q>(), rows, seqs, ctx, tables,
                            max_blocks, bs, hkv, group, d, scale, window, softcap);
  };
  switch (kv.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<BF*>(nullptr)); break;
    case at::kChar: run(static_cast<int8_t*>(nullptr)); break;
    default: run(static_cast<F8*>(nullptr)); break;
  }
}

Tensor paged_attention_cpu(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& kv_cache, int64_t layer,
                           const Tensor& seq_lens, const Tensor& context_lens, const Tensor& block_tables,
                           const Tensor& slot_mapping, double scale, int64_t sliding_window, double softcap) {
  auto fallback = [&]() {
    return paged_py(q, k, v, kv_cache, layer, seq_lens, context_lens, block_tables, slot_mapping, scale,
                    sliding_window, softcap);
  };
  const auto kv_type = kv_cache.scalar_type();
  const bool quantized = kv_type == at::kChar || kv_type == at::kFloat8_e4m3fn;
  if (!enabled() || kv_cache.dim() != 6 || !kv_cache.is_contiguous() || !(f32_or_bf16(kv_cache) || quantized) ||
      !f32_or_bf16(q) || !f32_or_bf16(k) || !f32_or_bf16(v) || q.dim() != 3 || k.dim() != 3 || v.dim() != 3 ||
      seq_lens.dim() != 1 || context_lens.dim() != 1 || block_tables.dim() != 2 || slot_mapping.dim() != 1 ||
      seq_lens.scalar_type() != at::kInt || context_lens.scalar_type() != at::kInt ||
      block_tables.scalar_type() != at::kInt || slot_mapping.scalar_type() != at::kLong)
    return fallback();
  const int64_t L = kv_cache.size(0), nb = kv_cache.size(2), bs = kv_cache.size(3), hkv = kv_cache.size(4),
                d = q.size(2);
  const int64_t T = q.size(0), S = seq_lens.size(0), max_blocks = block_tables.size(1);
  if (layer < 0 || layer >= L || kv_cache.size(1) != 2 || hkv == 0 || q.size(1) % hkv != 0 ||
      kv_cache.size(5) != d + (quantized ? 2 : 0) ||
      k.size(0) != T || v.size(0) != T || k.size(1) != hkv || v.size(1) != hkv || k.size(2) != d ||
      v.size(2) != d || slot_mapping.size(0) != T || context_lens.size(0) != S || block_tables.size(0) != S)
    return fallback();
  const Tensor sl = seq_lens.contiguous(), cl = context_lens.contiguous(), bt = block_tables.contiguous(),
               sm = slot_mapping.contiguous();
  const int32_t* lens = sl.const_data_ptr<int32_t>();
  const int32_t* ctx = cl.const_data_ptr<int32_t>();
  const int32_t* tables = bt.const_data_ptr<int32_t>();
  const int64_t* slots = sm.const_data_ptr<int64_t>();
  // validate everything before touching the pool: anything odd goes to the Python path (its errors)
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] < 0 || slots[t] >= nb * bs) return fallback();
  // decode rows: the one-token sequences, and each token of a short sequence (a speculative verify: its last
  // token and the proposals), which attends to its own causal prefix of the context like a decode token
  std::vector<int64_t> rows, seqs;
  std::vector<int32_t> row_ctx;
  rows.reserve(S);
  seqs.reserve(S);
  row_ctx.reserve(S);
  bool has_context = false;
  int64_t start = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = lens[s], c = ctx[s];
    if (n < 0 || c < n || c > max_blocks * bs) return fallback();
    if (n >= 1 && n <= SHORT_SEQ_TOKENS) {
      if (c < 1) return fallback();
      const int64_t used = (c + bs - 1) / bs;
      for (int64_t b = 0; b < used; ++b)
        if (tables[s * max_blocks + b] < 0 || tables[s * max_blocks + b] >= nb) return fallback();
      for (int64_t i = 0; i < n; ++i) {
        rows.push_back(start + i);
        seqs.push_back(s);
        row_ctx.push_back(static_cast<int32_t>(c - n + 1 + i));
      }
    } else if (n > 1) {
      has_context = true;
    }
    start += n;
  }
  if (start != T) return fallback();

  // 1) write this step's keys/values into their slots (an 8-bit pool: quantized)
  const int64_t pool = nb * bs * hkv * kv_cache.size(5);
  const Tensor kc = k.contiguous(), vc = v.contiguous();
  for (int which = 0; which < 2; ++which) {
    const Tensor& src = which == 0 ? kc : vc;
    const int64_t offset = (layer * 2 + which) * pool;
    if (src.scalar_type() == at::kFloat)
      write_kv_typed<float>(src, kv_cache, offset, slots, T, hkv, d);
    else
      write_kv_typed<BF>(src, kv_cache, offset, slots, T, hkv, d);
  }
  // 2) decode sequences, all at once
  const Tensor qc = q.contiguous();
  Tensor out = at::detail::empty_cpu(qc.sizes(), qc.scalar_type());  // no dispatcher (linear_ops.cpp, kernel_rows)
  if (!rows.empty()) {
    if (q.scalar_type() == at::kFloat)
      decode_dispatch_kv<float>(qc, kv_cache, layer, out, rows, seqs, row_ctx.data(), tables, max_blocks,
                                (float)scale, sliding_window, (float)softcap);
    else
      decode_dispatch_kv<BF>(qc, kv_cache, layer, out, rows, seqs, row_ctx.data(), tables, max_blocks, (float)scale,
                             sliding_window, (float)softcap);
  }
  // 3) context sequences (more than SHORT_SEQ_TOKENS new tokens): SDPA, one sequence at a time (Python)
  if (has_context)
    paged_context_py(qc, kv_cache, layer, seq_lens, context_lens, block_tables, out, scale, sliding_window, softcap,
                     SHORT_SEQ_TOKENS + 1);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_cpu);
  m.impl("rotary_embedding", &rotary_embedding_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
  m.impl("gelu", &gelu_cpu);
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("argmax_rows", &argmax_rows_cpu);
}

// AOTInductor C shim of paged_attention (as the linears' in linear_ops.cpp; its declaration: kiln.plugins.aoti_shims).
extern "C" AOTITorchError aoti_torch_cpu_paged_attention(
    AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle kv_cache, int64_t layer,
    AtenTensorHandle seq_lens, AtenTensorHandle context_lens, AtenTensorHandle block_tables,
    AtenTensorHandle slot_mapping, double scale, int64_t sliding_window, double softcap, AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(paged_attention_cpu(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k), *tensor_handle_to_tensor_pointer(v),
        *tensor_handle_to_tensor_pointer(kv_cache), layer, *tensor_handle_to_tensor_pointer(seq_lens),
        *tensor_handle_to_tensor_pointer(context_lens), *tensor_handle_to_tensor_pointer(block_tables),
        *tensor_handle_to_tensor_pointer(slot_mapping), scale, sliding_window, softcap));
  });
}
