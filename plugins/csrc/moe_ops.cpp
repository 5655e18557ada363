// CPU kernel of kiln::moe (the schema, the fake kernel, the torch fallback and the reference are defined from
// Python, kiln/plugins/moe.py). With no Python per call: route (router GEMM in x's dtype, softmax in fp32,
// top-k, optional renormalization), group the tokens by expert, and for each expert that got tokens run its two
// GEMMs through the kiln::*_linear kernels on that expert's slice of the stacked weights (decode reads the
// chosen experts' weights only), silu(gate) * up between them, and add the router-weighted outputs in fp32,
// experts in ascending order. Anything it does not cover (kernels disabled, unusual shapes or dtypes) goes to
// kiln::_moe_py, which also owns the argument checks and their messages.

#include "kiln_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/div.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/linear.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using at::Tensor;
using OptT = std::optional<Tensor>;

Tensor moe_py(const Tensor& x, const Tensor& router, const Tensor& gu, const OptT& gus, const Tensor& down,
              const OptT& ds, int64_t top_k, bool renorm, int64_t bits, int64_t gs) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::_moe_py", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptT&, const Tensor&,
                                     const OptT&, int64_t, bool, int64_t, int64_t)>();
  return op.call(x, router, gu, gus, down, ds, top_k, renorm, bits, gs);
}

// One expert's GEMM: kiln::weight_only_linear (bits 4/8) or kiln::fp32_linear / bf16_linear (float weights, plain
// or in panels): their C++ kernels, which fall back themselves for what they do not cover.
Tensor expert_linear(const Tensor& x, const Tensor& w, const OptT& s, int64_t bits, int64_t gs) {
  static auto wol = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("kiln::weight_only_linear", "")
                        .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptT&, int64_t, int64_t,
                                      const OptT&)>();
  static auto f32 = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("kiln::fp32_linear", "")
                        .typed<Tensor(const Tensor&, const Tensor&, const OptT&)>();
  static auto b16 = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("kiln::bf16_linear", "")
                        .typed<Tensor(const Tensor&, const Tensor&, const OptT&)>();
  if (bits) return wol.call(x, w, *s, std::nullopt, bits, gs, std::nullopt);  // no zero points
  return (w.scalar_type() == at::kFloat ? f32 : b16).call(x, w, std::nullopt);
}

// (out, in) of one expert's weight w[e] in the op's formats, or (-1, -1) when it is none of them
std::pair<int64_t, int64_t> expert_nk(const Tensor& w, int64_t bits) {
  const int64_t d = w.dim() - 1;  // dims of one expert
  if (bits == 4) return d == 2 && w.scalar_type() == at::kByte ? std::make_pair(w.size(1), 2 * w.size(2))
                                                                : std::make_pair<int64_t, int64_t>(-1, -1);
  if (d == 2) return {w.size(1), w.size(2)};
  if (d == 3 && w.size(3) == KILN_PANEL) return {w.size(1) * KILN_PANEL, w.size(2)};
  if (d == 4 && w.size(3) == KILN_PANEL && w.size(4) == KILN_PAIR) return {w.size(1) * KILN_PANEL, w.size(2) * KILN_PAIR};
  return {-1, -1};
}

Tensor moe_cpu(const Tensor& x, const Tensor& router, const Tensor& gate_up, const OptT& gate_up_scales,
               const Tensor& down, const OptT& down_scales, int64_t top_k, bool renormalize, int64_t bits,
               int64_t group_size) {
  auto fallback = [&]() {
    return moe_py(x, router, gate_up, gate_up_scales, down, down_scales, top_k, renormalize, bits, group_size);
  };
  const bool fdtype = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
  if (!kiln_ops_enabled() || !fdtype || x.dim() != 2 || router.dim() != 2 || router.scalar_type() != x.scalar_type())
    return fallback();
  const int64_t T = x.size(0), H = x.size(1), E = router.size(0);
  const auto [n2, k1] = expert_nk(gate_up, bits);
  const auto [n1, k2] = expert_nk(down, bits);
  const bool quant = bits == 4 || bits == 8;
  const bool wdtype = quant ? (bits == 8 ? gate_up.scalar_type() == at::kChar && down.scalar_type() == at::kChar
                                         : true)
                            : (bits == 0 && (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16)
                               && down.scalar_type() == gate_up.scalar_type());
  if (router.size(1) != H || T == 0 || top_k < 1 || top_k > E || gate_up.size(0) != E || down.size(0) != E ||
      k1 != H || n1 != H || n2 != 2 * k2 || k2 <= 0 || !wdtype || gate_up_scales.has_value() != quant ||
      down_scales.has_value() != quant || !gate_up.is_contiguous() || !down.is_contiguous())
    return fallback();
  const int64_t inter = k2;
  if (quant) {  // scales fp32: int8 [E, N], int4 [E, N, K / group_size]
    auto ok = [&](const Tensor& sc, int64_t n, int64_t k) {
      return sc.scalar_type() == at::kFloat && sc.size(0) == E && sc.size(1) == n &&
             (bits == 8 ? sc.dim() == 2 : sc.dim() == 3 && group_size > 0 && sc.size(2) * group_size == k);
    };
    if (!ok(*gate_up_scales, n2, k1) || !ok(*down_scales, n1, k2)) return fallback();
  }

  // 1) route
  Tensor probs = at::softmax(at::linear(x, router).to(at::kFloat), -1);
  auto [weights, experts] = at::topk(probs, top_k, -1);
  if (renormalize) weights = weights.div(weights.sum(-1, true));
  weights = weights.contiguous();
  experts = experts.contiguous();
  const float* wp = weights.const_data_ptr<float>();
  const int64_t* ep = experts.const_data_ptr<int64_t>();

  // 2) group: tokens of each expert (counting sort, tokens ascending within an expert)
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < T * top_k; ++i) ++start[ep[i] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> tokens(T * top_k), fill(start.begin(), start.end() - 1);
  std::vector<float> gates(T * top_k);
  for (int64_t i = 0; i < T * top_k; ++i) {
    const int64_t at = fill[ep[i]]++;
    tokens[at] = i / top_k;
    gates[at] = wp[i];
  }

  // 3) each hit expert over its tokens, weighted into the fp32 sum
  Tensor out = at::zeros({T, H}, x.options().dtype(at::kFloat));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    Tensor rows = at::from_blob(tokens.data() + start[e], {n}, at::TensorOptions().dtype(at::kLong));
    Tensor g = at::from_blob(gates.data() + start[e], {n, 1}, at::TensorOptions().dtype(at::kFloat));
    Tensor xe = n == T ? x : x.index_select(0, rows);
    const OptT gs = quant ? OptT(gate_up_scales->select(0, e)) : std::nullopt;
    const OptT dsc = quant ? OptT(down_scales->select(0, e)) : std::nullopt;
    Tensor h = expert_linear(xe, gate_up.select(0, e), gs, bits, group_size);
    Tensor a = at::silu(h.narrow(1, 0, inter)).mul_(h.narrow(1, inter, inter));
    Tensor y = expert_linear(a, down.select(0, e), dsc, bits, group_size).to(at::kFloat).mul_(g);
    out.index_add_(0, rows, y);
  }
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("moe", &moe_cpu); }

// AOTInductor C shim of moe (as the linears' in linear_ops.cpp; its declaration: kiln.plugins.aoti_shims).
extern "C" AOTITorchError aoti_torch_cpu_moe(AtenTensorHandle x, AtenTensorHandle router, AtenTensorHandle gate_up,
                                             AtenTensorHandle* gate_up_scales, AtenTensorHandle down,
                                             AtenTensorHandle* down_scales, int64_t top_k, int32_t renormalize,
                                             int64_t bits, int64_t group_size, AtenTensorHandle* ret0) {
  using torch::aot_inductor::pointer_to_optional;
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(moe_cpu(
        *tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(router),
        *tensor_handle_to_tensor_pointer(gate_up), pointer_to_optional<at::Tensor>(gate_up_scales),
        *tensor_handle_to_tensor_pointer(down), pointer_to_optional<at::Tensor>(down_scales), top_k, renormalize != 0,
        bits, group_size));
  });
}
