// lora_update: every adapter's low-rank update of one fused linear in one call (engine/model/lora_kernel.py).
//
// A decode step of a few rows over several adapters costs, per linear and in torch ops, a shrink, a mask, an
// expand and an add: each a dispatch, an allocation and a parallel region, which at decode sizes outweigh the
// arithmetic (r 16 on a 576-wide model: ~0.2 MFLOP a linear). Here the step's adapters' A are stacked
// `a [R, K]`, part by part: a fused linear's output is cut in parts (q|k|v: three, gate|up: two, else one);
// part p owns output columns [parts[p][1], parts[p][2]) and A's rows [parts[p][0], next part's start); its B,
// transposed, is dense `[R_p, W_p]` (no zeros between a projection's rank and another projection's columns),
// stored in panels of kChunk columns, `[ceil(W_p / kChunk), R_p, kChunk]` (the last zero padded), at the part's
// offset of `bt` (1-D: the parts one after the other): a task's block of columns is one contiguous read, as
// the base's packed panels are, not R_p strided pieces. Adapter row m (input row
// rows[m]) owns A's rows [ranges[m][p][0], ranges[m][p][1]) of part p (empty: no update there):
//   t[m, c]  = scale[m] * x[rows[m]] . a[c]                       (the shrink, fp32)
//   op "add"     out[rows[m], j] += t[m] . bt_p[:, j]   for j in part p     (in place)
//   op "swiglu"  out[i] = silu(out[i] + d_gate[i]) * (up[i] + d_up[i])   for every row i of out, with two
//   op "geglu"   gelu_tanh instead of silu                  parts, the gate's columns [0, W) then up's [W, 2W)
//                (rows without an adapter take no update; written into `out`, the gate's pre-activation)
// Sums are fp32 and each output is rounded once to the tensors' dtype (float32 or bfloat16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 64;  // output columns per task of the expand, and per panel of bt

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }

// x . w over k values, fp32 sums.
inline float dot(const float* x, const float* w, int64_t k) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= k; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + d), _mm512_loadu_ps(w + d), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; d < k; ++d) s += x[d] * w[d];
  return s;
}

inline float dot(const c10::BFloat16* x, const c10::BFloat16* w, int64_t k) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX512BF16__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 32 <= k; d += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x + d), (__m512bh)_mm512_loadu_si512(w + d));
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; d < k; ++d) s += static_cast<float>(x[d]) * static_cast<float>(w[d]);
  return s;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> fp32: the 16 bits moved to the top half
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// acc[0..n) = sum over c < nc of t[c] * b[c * w + j] for j in [0, n): the expand of one row over one panel
// (`b`: the row's first A row in it, `w`: its width; 16 columns at a time, their sum kept in a register).
template <typename T>
inline void expand(const float* t, const T* b, int64_t nc, int64_t w, int64_t n, float* acc) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) sum = _mm512_fmadd_ps(_mm512_set1_ps(t[c]), load16(b + c * w + j), sum);
    _mm512_storeu_ps(acc + j, sum);
  }
#endif
  for (; j < n; ++j) {
    float sum = 0.f;
    for (int64_t c = 0; c < nc; ++c) sum += t[c] * to_f(b[c * w + j]);
    acc[j] = sum;
  }
}

// One part of the fused output: A's rows from `r0`, output columns [w0, w1), its B block at `off` in bt.
struct Part {
  int64_t r0, w0, w1, off;
};

inline float act(float v, bool gelu) {
  if (!gelu) return v / (1.f + std::exp(-v));
  return 0.5f * v * (1.f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}


// Multiply-adds below which a call runs on one thread (a parallel region's wake-up and barrier cost more).
// A decode step's update (8 rows of r 16: ~0.1-0.4 M) is above it: streaming the adapters' weights (as many
// bytes a step as 20% of SmolLM2-135M's) needs every core's share of the memory bandwidth, as the base's do.
constexpr int64_t kSerialWork = 1 << 16;

// f(0, n), on the calling thread when `work` is small, else split over the threads as at::parallel_for does.
template <typename F>
void split(int64_t n, int64_t grain, int64_t work, const F& f) {
  if (work < kSerialWork) {
    if (n > 0) f(0, n);
  } else {
    at::parallel_for(0, n, grain, f);
  }
}

template <typename T>
void run(const at::Tensor& x, at::Tensor& out, const at::Tensor* up, const int64_t* rows, const int64_t* ranges,
         const float* scale, int64_t n, const at::Tensor& a, const at::Tensor& bt, const std::vector<Part>& parts,
         const std::string& op) {
  const int64_t k = x.size(1), r = a.size(0), xs = x.stride(0), os = out.stride(0), np = parts.size();
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  T* op_ = out.data_ptr<T>();
  // the shrink: one task per (adapter row, column) pair
  std::vector<float> t(n * r, 0.f);
  std::vector<int64_t> pairs;
  int64_t expand_work = 0;
  for (int64_t m = 0; m < n; ++m)
    for (int64_t p = 0; p < np; ++p) {
      const int64_t* rg = ranges + 2 * (m * np + p);
      for (int64_t c = rg[0]; c < rg[1]; ++c) pairs.push_back(m * r + c);
      expand_work += (rg[1] - rg[0]) * (parts[p].w1 - parts[p].w0);
    }
  const int64_t shrink = static_cast<int64_t>(pairs.size()) * k;
  split(static_cast<int64_t>(pairs.size()), 16, shrink, [&](int64_t p0, int64_t p1) {
    for (int64_t q = p0; q < p1; ++q) {
      const int64_t m = pairs[q] / r, c = pairs[q] % r;
      t[pairs[q]] = scale[m] * dot(xp + rows[m] * xs, ap + c * k, k);
    }
  });
  // row m's update of part p over the part's columns [j0, j0 + len) into acc
  auto delta = [&](int64_t m, int64_t p, int64_t j0, int64_t len, float* acc) {
    const Part& pt = parts[p];
    const int64_t* rg = ranges + 2 * (m * np + p);
    const int64_t rp = p + 1 < np ? parts[p + 1].r0 : r;  // the part's rows of a end there
    const T* panel = bp + pt.off + (j0 - pt.w0) / kChunk * (rp - pt.r0) * kChunk;
    expand(t.data() + m * r + rg[0], panel + (rg[0] - pt.r0) * kChunk, rg[1] - rg[0], kChunk, len, acc);
  };
  if (op == "add") {
    std::vector<std::pair<int64_t, int64_t>> blocks;  // (part, first column): no block straddles two parts
    for (int64_t p = 0; p < np; ++p)
      for (int64_t j0 = parts[p].w0; j0 < parts[p].w1; j0 += kChunk) blocks.emplace_back(p, j0);
    split(static_cast<int64_t>(blocks.size()), 1, expand_work, [&](int64_t b0, int64_t b1) {
      float acc[kChunk];
      for (int64_t blk = b0; blk < b1; ++blk) {
        const auto [p, j0] = blocks[blk];
        const int64_t len = std::min(kChunk, parts[p].w1 - j0);
        for (int64_t m = 0; m < n; ++m) {
          const int64_t* rg = ranges + 2 * (m * np + p);
          if (rg[0] == rg[1]) continue;
          delta(m, p, j0, len, acc);
          T* o = op_ + rows[m] * os + j0;
          for (int64_t j = 0; j < len; ++j) o[j] = static_cast<T>(to_f(o[j]) + acc[j]);
        }
      }
    });
    return;
  }
  const bool gelu = op == "geglu";
  const int64_t half = out.size(1), total = out.size(0), us = up->stride(0);
  const T* upp = up->data_ptr<T>();
  std::vector<int64_t> pos(total, -1);  // each output row's adapter row, or -1
  for (int64_t m = 0; m < n; ++m) pos[rows[m]] = m;
  split((half + kChunk - 1) / kChunk, 1, expand_work + total * half, [&](int64_t b0, int64_t b1) {
    float dg[kChunk], du[kChunk];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t j0 = blk * kChunk, len = std::min(kChunk, half - j0);
      for (int64_t i = 0; i < total; ++i) {
        const int64_t m = pos[i];
        for (int64_t j = 0; j < len; ++j) dg[j] = du[j] = 0.f;
        if (m >= 0) {
          if (ranges[4 * m] < ranges[4 * m + 1]) delta(m, 0, j0, len, dg);
          if (ranges[4 * m + 2] < ranges[4 * m + 3]) delta(m, 1, half + j0, len, du);
        }
        T* g = op_ + i * os + j0;
        const T* u = upp + i * us + j0;
        for (int64_t j = 0; j < len; ++j) g[j] = static_cast<T>(act(to_f(g[j]) + dg[j], gelu) * (to_f(u[j]) + du[j]));
      }
    }
  });
}

void lora_update(const at::Tensor& x, at::Tensor& out, const std::optional<at::Tensor>& up, const at::Tensor& rows,
                 const at::Tensor& ranges, const at::Tensor& scale, const at::Tensor& a, const at::Tensor& bt,
                 const at::Tensor& parts_t, c10::string_view op_view) {
  const std::string op(op_view);
  const bool glu = op == "swiglu" || op == "geglu";
  TORCH_CHECK(op == "add" || glu, "lora_update: op must be add, swiglu or geglu, got ", op);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "lora_update: float32 or bfloat16 only, got ", dtype);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1 && out.scalar_type() == dtype,
              "lora_update: x and out must be [rows, features] tensors of one dtype with contiguous rows");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.scalar_type() == dtype && a.size(1) == x.size(1),
              "lora_update: a must be a contiguous [R, K] tensor of x's dtype and K");
  TORCH_CHECK(parts_t.dim() == 2 && parts_t.size(1) == 3 && parts_t.scalar_type() == at::kLong &&
                  parts_t.is_contiguous() && parts_t.size(0) >= 1 && (!glu || parts_t.size(0) == 2),
              "lora_update: parts must be an int64 [P, 3] tensor of (first row of a, first column, end column); "
              "swiglu/geglu: two parts, the gate's then up's");
  const int64_t np = parts_t.size(0), width = out.size(1) * (glu ? 2 : 1);
  const int64_t* pp = parts_t.data_ptr<int64_t>();
  std::vector<Part> parts(np);
  int64_t off = 0;
  for (int64_t p = 0; p < np; ++p) {
    const int64_t r1 = p + 1 < np ? pp[3 * (p + 1)] : a.size(0);
    parts[p] = Part{pp[3 * p], pp[3 * p + 1], pp[3 * p + 2], off};
    TORCH_CHECK(pp[3 * p] >= 0 && pp[3 * p] <= r1 && 0 <= pp[3 * p + 1] && pp[3 * p + 1] <= pp[3 * p + 2] &&
                    pp[3 * p + 2] <= width && (!glu || pp[3 * p + 2] - pp[3 * p + 1] == out.size(1)),
                "lora_update: part ", p, " out of bounds (its rows of a, or its columns of out)");
    off += (r1 - pp[3 * p]) * ((pp[3 * p + 2] - pp[3 * p + 1] + kChunk - 1) / kChunk * kChunk);
  }
  TORCH_CHECK(bt.is_contiguous() && bt.scalar_type() == dtype && bt.numel() == off,
              "lora_update: bt must be a contiguous tensor of x's dtype holding each part's panels (", off,
              " values), got ", bt.numel());
  const int64_t n = rows.numel();
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && ranges.scalar_type() == at::kLong &&
                  ranges.is_contiguous() && ranges.numel() == 2 * n * np && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous() && scale.numel() == n,
              "lora_update: rows int64 [n], ranges int64 [n, P, 2], scale float32 [n]");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* cp = ranges.data_ptr<int64_t>();
  for (int64_t m = 0; m < n; ++m) {
    TORCH_CHECK(rp[m] >= 0 && rp[m] < x.size(0) && rp[m] < out.size(0), "lora_update: a row out of bounds");
    for (int64_t p = 0; p < np; ++p) {
      const int64_t* rg = cp + 2 * (m * np + p);
      const int64_t r1 = p + 1 < np ? pp[3 * (p + 1)] : a.size(0);
      TORCH_CHECK(rg[0] == rg[1] || (pp[3 * p] <= rg[0] && rg[0] <= rg[1] && rg[1] <= r1),
                  "lora_update: a row's range of a is not within its part's rows");
    }
  }
  if (glu) {
    TORCH_CHECK(up.has_value() && up->dim() == 2 && up->stride(1) == 1 && up->scalar_type() == dtype &&
                    up->sizes() == out.sizes(),
                "lora_update: swiglu/geglu need `up` shaped as out (the gate)");
  }
  if (dtype == at::kFloat) {
    run<float>(x, out, glu ? &*up : nullptr, rp, cp, scale.data_ptr<float>(), n, a, bt, parts, op);
  } else {
    run<c10::BFloat16>(x, out, glu ? &*up : nullptr, rp, cp, scale.data_ptr<float>(), n, a, bt, parts, op);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cellserve, m) {
  m.def("lora_update(Tensor x, Tensor(a!) out, Tensor? up, Tensor rows, Tensor ranges, Tensor scale, Tensor a, "
        "Tensor bt, Tensor parts, str op) -> ()");
}

TORCH_LIBRARY_IMPL(cellserve, CPU, m) {
  m.impl("lora_update", &lora_update);
}
