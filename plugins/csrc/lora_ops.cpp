// CPU kernel of kiln::lora (the schema, the reference and the Python implementation are in plugins/lora.py),
// registered with the dispatcher when the native library loads: each token's adapter delta
// (x @ A^T) @ B^T added to the base linear's output y, for a batch whose tokens use different adapters.
//
// Tokens are grouped by adapter slot (a counting sort), so every adapter present in the step is read once:
// shrink xa = x_g @ A^T for each group and each distinct A of the segments (one fp32 dot product of length K
// per token and rank row), then expand delta += xa @ B^T by column blocks of each segment: per token of a
// group, the block's 64 sums stay in registers over the rank rows of B^T (read from L1 after the group's
// first token), so delta is loaded and stored once per block and token. Both phases run on torch's
// intra-op threads. The delta is accumulated in fp32 and added to y once (one rounding for bf16).
//
// Coverage: fp32 / bf16 x, y and pool of one dtype, 2-D x and y, int32 slots; anything else (fp16, bad
// shapes, slots out of range, kernels disabled) goes to kiln::_lora_py, which also owns the error messages.

#include "kiln_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using at::Tensor;
using BF = c10::BFloat16;

Tensor lora_py(const Tensor& y, const Tensor& x, const Tensor& slots, const Tensor& w, c10::IntArrayRef seg,
               int64_t rank) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::_lora_py", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, c10::IntArrayRef,
                                     int64_t)>();
  return op.call(y, x, slots, w, seg, rank);
}

inline float to_f(float v) { return v; }
inline float to_f(BF v) { return static_cast<float>(v); }

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BF* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_k x[k] * a[k], x in fp32
template <typename T>
float dot(const float* x, const T* a, int64_t k) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8(a + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), load8(a + i + 8), s1);
  }
  for (; i + 8 <= k; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8(a + i), s0);
  float s = hsum(_mm256_add_ps(s0, s1));
  for (; i < k; ++i) s += x[i] * to_f(a[i]);
  return s;
}

// out[c] += s * b[c], c < n
template <typename T>
void axpy(float s, const T* b, float* out, int64_t n) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(out + c, _mm256_fmadd_ps(vs, load8(b + c), _mm256_loadu_ps(out + c)));
  for (; c < n; ++c) out[c] += s * to_f(b[c]);
}

struct Segment {
  int64_t a_off, b_off, b_stride, y_col, n, a_index;  // a_index: which distinct A (shared shrink)
};

constexpr int64_t COL_BLOCK = 64;  // columns of a segment one expand work item covers

template <typename T>
void lora_typed(const Tensor& xc, Tensor& out, const int32_t* slots, const Tensor& wc, const std::vector<Segment>& segs,
                int64_t num_a, const std::vector<int64_t>& a_offs, int64_t rank) {
  const int64_t tokens = xc.size(0), k = xc.size(1), ncols = out.size(1), numel = wc.size(1);
  const int64_t num_slots = wc.size(0);
  // counting sort of the active tokens by slot
  std::vector<int64_t> count(num_slots + 1, 0);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) ++count[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) count[s + 1] += count[s];
  const int64_t active = count[num_slots];
  if (active == 0) return;
  std::vector<int64_t> order(active), fill(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) order[fill[slots[t]]++] = t;
  struct Group {
    int64_t slot, begin, end;
  };
  std::vector<Group> groups;
  for (int64_t s = 0; s < num_slots; ++s)
    if (count[s + 1] > count[s]) groups.push_back({s, count[s], count[s + 1]});
  std::vector<int64_t> group_of(active);
  for (size_t g = 0; g < groups.size(); ++g)
    for (int64_t i = groups[g].begin; i < groups[g].end; ++i) group_of[i] = static_cast<int64_t>(g);

  const T* x = xc.const_data_ptr<T>();
  const T* w = wc.const_data_ptr<T>();
  // the active rows of x in fp32, in group order
  std::vector<float> xs(active * k);
  at::parallel_for(0, active, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, k)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T* src = x + order[i] * k;
      float* dst = xs.data() + i * k;
      for (int64_t j = 0; j < k; ++j) dst[j] = to_f(src[j]);
    }
  });
  // shrink: xa[a][i][r] = x_i . A_{slot(i)}[r]
  std::vector<float> xa(num_a * active * rank);
  const int64_t items = num_a * active * rank;
  at::parallel_for(0, items, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k)), [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t a = q / (active * rank), i = (q / rank) % active, r = q % rank;
      const T* arow = w + groups[group_of[i]].slot * numel + a_offs[a] + r * k;
      xa[q] = dot(xs.data() + i * k, arow, k);
    }
  });
  // expand into delta [active][ncols] (fp32), by (segment, column block) work items
  std::vector<float> delta(active * ncols, 0.0f);
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (segment, first column of the block)
  for (size_t s = 0; s < segs.size(); ++s)
    for (int64_t c = 0; c < segs[s].n; c += COL_BLOCK) blocks.push_back({static_cast<int64_t>(s), c});
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t bi = b0; bi < b1; ++bi) {
      const Segment& sg = segs[blocks[bi].first];
      const int64_t c0 = blocks[bi].second, nc = std::min(COL_BLOCK, sg.n - c0);
      for (const Group& g : groups) {
        const T* bt = w + g.slot * numel + sg.b_off + c0;
        for (int64_t i = g.begin; i < g.end; ++i) {
          const float* s = xa.data() + (sg.a_index * active + i) * rank;
          float* d = delta.data() + i * ncols + sg.y_col + c0;
          if (nc == COL_BLOCK) {  // the block's sums in registers over all rank rows: one load and store of d
            __m256 acc[COL_BLOCK / 8];
            for (int64_t j = 0; j < COL_BLOCK / 8; ++j) acc[j] = _mm256_loadu_ps(d + 8 * j);
            for (int64_t r = 0; r < rank; ++r) {
              const __m256 vs = _mm256_set1_ps(s[r]);
              const T* brow = bt + r * sg.b_stride;
              for (int64_t j = 0; j < COL_BLOCK / 8; ++j) acc[j] = _mm256_fmadd_ps(vs, load8(brow + 8 * j), acc[j]);
            }
            for (int64_t j = 0; j < COL_BLOCK / 8; ++j) _mm256_storeu_ps(d + 8 * j, acc[j]);
          } else {
            for (int64_t r = 0; r < rank; ++r)
              if (s[r] != 0.0f) axpy(s[r], bt + r * sg.b_stride, d, nc);
          }
        }
      }
    }
  });
  // y += delta on the active rows (columns no segment covers have delta 0)
  T* o = out.data_ptr<T>();
  at::parallel_for(0, active, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, ncols)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      T* row = o + order[i] * ncols;
      const float* d = delta.data() + i * ncols;
      for (const Segment& sg : segs)
        for (int64_t c = sg.y_col; c < sg.y_col + sg.n; ++c) row[c] = static_cast<T>(to_f(row[c]) + d[c]);
    }
  });
}

Tensor lora_cpu(const Tensor& y, const Tensor& x, const Tensor& slots, const Tensor& weights, c10::IntArrayRef seg,
                int64_t rank) {
  const auto dt = y.scalar_type();
  const bool ok = kiln_ops_enabled() != 0 && (dt == at::kFloat || dt == at::kBFloat16) && x.scalar_type() == dt &&
                  weights.scalar_type() == dt && x.dim() == 2 && y.dim() == 2 && weights.dim() == 2 &&
                  slots.scalar_type() == at::kInt && slots.dim() == 1 && x.size(0) == y.size(0) &&
                  slots.size(0) == x.size(0) && rank >= 1 && !seg.empty() && seg.size() % 5 == 0;
  if (!ok) return lora_py(y, x, slots, weights, seg, rank);
  const int64_t k = x.size(1), numel = weights.size(1), ncols = y.size(1), num_slots = weights.size(0);
  std::vector<Segment> segs;
  std::vector<int64_t> a_offs;
  for (size_t i = 0; i < seg.size(); i += 5) {
    Segment s{seg[i], seg[i + 1], seg[i + 2], seg[i + 3], seg[i + 4], 0};
    const bool fits = s.a_off >= 0 && s.b_off >= 0 && s.y_col >= 0 && s.n >= 1 && s.b_stride >= s.n &&
                      s.a_off + rank * k <= numel && s.b_off + (rank - 1) * s.b_stride + s.n <= numel &&
                      s.y_col + s.n <= ncols;
    if (!fits) return lora_py(y, x, slots, weights, seg, rank);  // raises there, naming the segment
    auto found = std::find(a_offs.begin(), a_offs.end(), s.a_off);
    s.a_index = found - a_offs.begin();
    if (found == a_offs.end()) a_offs.push_back(s.a_off);
    segs.push_back(s);
  }
  const Tensor sc = slots.contiguous();
  const int32_t* sp = sc.const_data_ptr<int32_t>();
  for (int64_t t = 0; t < sc.numel(); ++t)
    if (sp[t] < -1 || sp[t] >= num_slots) return lora_py(y, x, slots, weights, seg, rank);
  Tensor out = y.contiguous();
  out = out.is_same(y) ? y.clone() : out;  // the result never aliases y
  const Tensor xc = x.contiguous(), wc = weights.contiguous();
  const auto num_a = static_cast<int64_t>(a_offs.size());
  if (dt == at::kFloat)
    lora_typed<float>(xc, out, sp, wc, segs, num_a, a_offs, rank);
  else
    lora_typed<BF>(xc, out, sp, wc, segs, num_a, a_offs, rank);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("lora", &lora_cpu); }

// AOTInductor C shim of lora (as the linears' in linear_ops.cpp; its declaration: kiln.plugins.aoti_shims).
extern "C" AOTITorchError aoti_torch_cpu_lora(AtenTensorHandle y, AtenTensorHandle x, AtenTensorHandle slots,
                                              AtenTensorHandle weights, const int64_t* segments, int64_t segments_len_,
                                              int64_t rank, AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(lora_cpu(
        *tensor_handle_to_tensor_pointer(y), *tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(slots),
        *tensor_handle_to_tensor_pointer(weights), c10::IntArrayRef(segments, segments_len_), rank));
  });
}
