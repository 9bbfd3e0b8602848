// quant_moe: a mixture-of-experts block's experts in one call, their weights in the K-quants (q4_k, q5_k, q6_k),
// for a step of few rows (decode, batched decode, speculative verification: engine/model/native/moe.py).
//
// x [T, H] (the normed hidden states), chosen [T, k] (each row's experts, as the router's top k picked them) and
// weights [T, k] (float32). The T * k (row, expert) pairs are sorted by expert, then row (a counting sort), so
// each active expert is one group; then
//   1. [gate; up]: every group's rows times its expert's [gate; up] rows, silu(gate) * up -> [pairs, I]
//   2. down: each pair's row of that times its expert's down rows -> [pairs, H]
//   3. out[t] = sum over row t's experts in ascending id of weight * down (each product rounded, then added:
//      as `y.mul_(w)` then `index_add_` into zeros, engine/model/native/moe.py's per-expert loop)
// 1 and 2 run quant_krows.cpp's row kernel (`krows_experts`), parallel over (expert, 16 output rows), each
// expert's weight streamed once for all its rows; only the chosen experts' blocks are read. A pair's values are
// bitwise those of `quant_linear` on its expert's weight with its row alone, and 3 sums each row alone in a fixed
// order, so each row of the result is bitwise the same whatever the other rows are (engine/model/native/rows.py)
// and the same as the per-expert loop over the row kernel. The experts of a projection are stacked: one
// weight of E * (2 I) rows ([gate_e; up_e] each) and one of E * H rows (engine/model/native/moe.py's
// QuantExperts), so a call passes 12 tensors, not 12 E.
#include <torch/library.h>

#include <vector>

#include "quant_blocks.h"

namespace {

using namespace cq;

// out [T, H] = sum over each row's experts (ascending id) of w * y [pairs, H]; pos[t * k + j]: pair (t, j)'s
// place in y. No contraction into a fused multiply-add: each product rounds as torch's `mul_` does.
__attribute__((optimize("fp-contract=off"))) void weighted_sum(const int64_t* chosen, const float* w,
                                                                 const int64_t* pos, const float* y, int64_t t_rows,
                                                                 int64_t k, int64_t h, float* out) {
  at::parallel_for(0, t_rows, 1, [&](int64_t a, int64_t b) {
    std::vector<int64_t> order(k);
    for (int64_t t = a; t < b; ++t) {
      for (int64_t j = 0; j < k; ++j) order[j] = t * k + j;
      std::sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return chosen[p] < chosen[q]; });
      float* o = out + t * h;
      std::fill(o, o + h, 0.f);
      for (int64_t p : order) {
        const float wp = w[p];
        const float* yp = y + pos[p] * h;
        for (int64_t i = 0; i < h; ++i) {
          const float v = yp[i] * wp;
          o[i] = o[i] + v;
        }
      }
    }
  });
}

at::Tensor quant_moe(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights, at::TensorList gate_up,
                     int64_t kind_gate_up, at::TensorList down, int64_t kind_down, int64_t experts) {
  TORCH_CHECK(super_blocks(kind_gate_up) && super_blocks(kind_down),
              "quant_moe: the experts must be K-quants (q4_k, q5_k, q6_k); run other kinds expert by expert");
  const Weight gu = weight_of(gate_up, kind_gate_up), dn = weight_of(down, kind_down);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(0) >= 1 && x.size(1) == gu.k,
              "quant_moe: x must be contiguous float32 [rows >= 1, H], H the experts' input width");
  const int64_t t_rows = x.size(0), h = x.size(1);
  TORCH_CHECK(chosen.dim() == 2 && chosen.size(0) == t_rows && chosen.scalar_type() == at::kLong && chosen.is_contiguous(),
              "quant_moe: chosen must be contiguous int64 [rows, k]");
  TORCH_CHECK(weights.sizes() == chosen.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "quant_moe: weights must be contiguous float32 [rows, k], as chosen");
  TORCH_CHECK(experts >= 1 && gu.n % (2 * experts) == 0 && dn.n == experts * h,
              "quant_moe: gate_up must stack [gate; up] of each of the experts, down their [H, I] weights");
  const int64_t inter = gu.n / (2 * experts), k = chosen.size(1), pairs = t_rows * k;
  TORCH_CHECK(dn.k == inter, "quant_moe: down's input width must be the experts' width ", inter);
  const int64_t* ch = chosen.data_ptr<int64_t>();
  // the pairs by expert, then row: a counting sort
  std::vector<int64_t> count(experts + 1, 0), pos(pairs), src(pairs), group_expert, group_start;
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(0 <= ch[p] && ch[p] < experts, "quant_moe: an expert id out of range: ", ch[p]);
    ++count[ch[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) {
    if (count[e + 1] > 0) {
      group_expert.push_back(e);
      group_start.push_back(count[e]);
    }
    count[e + 1] += count[e];
  }
  group_start.push_back(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    pos[p] = count[ch[p]]++;
    src[pos[p]] = p / k;
  }
  const int64_t groups = static_cast<int64_t>(group_expert.size());
  auto mid = at::empty({pairs, inter}, x.options());
  krows_experts(gu, {group_expert.data(), group_start.data(), groups, 2 * inter, inter, true}, x.data_ptr<float>(),
                t_rows, src.data(), pairs, mid.data_ptr<float>());
  std::vector<int64_t> own(pairs);
  for (int64_t p = 0; p < pairs; ++p) own[p] = p;
  auto y = at::empty({pairs, h}, x.options());
  krows_experts(dn, {group_expert.data(), group_start.data(), groups, h, h, false}, mid.data_ptr<float>(), pairs,
                own.data(), pairs, y.data_ptr<float>());
  auto out = at::empty({t_rows, h}, x.options());
  weighted_sum(ch, weights.data_ptr<float>(), pos.data(), y.data_ptr<float>(), t_rows, k, h, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cellserve, m) {
  m.def("quant_moe(Tensor x, Tensor chosen, Tensor weights, Tensor[] gate_up, int kind_gate_up, Tensor[] down, "
        "int kind_down, int experts) -> Tensor");
}

TORCH_LIBRARY_IMPL(cellserve, CPU, m) { m.impl("quant_moe", &quant_moe); }
