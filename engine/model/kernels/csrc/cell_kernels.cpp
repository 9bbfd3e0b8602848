// Fused CPU kernels for the native Llama forward (engine/native.py), loaded by engine/kernels.py.
//
// Each replaces a run of small eager ops whose cost on a small CPU is dispatch, allocation and an
// OpenMP region per op rather than arithmetic:
//   rms_norm        transformers' LlamaRMSNorm in one pass (fp32 statistics, the input's dtype out);
//   qk_norm         Qwen3's / Gemma 3's per-head RMSNorm of each Q and K head row of the fused Q|K|V
//                   output, in place (one pass instead of a split, two norms and a copy back);
//   rope_store      RoPE on Q and K from one cos/sin table, K and V written straight into the cell
//                   pools, Q returned;
//   cell_attention  one query row per sequence reads its own cells in place from the pools (no
//                   gathered copy), scores, softmax and values in fp32. With AVX-512 and a head_dim of
//                   64 or 128, in blocks of 16 cells shared by rows with the same cells (cell_blocks.h);
//                   else row by row (attention_kernel below).
//   rope_store_q8, cell_attention_q8
//                   the same over int8 pools with a float32 scale per (cell, kv head) row
//                   (engine/cells/int8_kv.py): rows are quantized as they are written (absmax / 127,
//                   round half to even, as torch.round) and read in place, the row's scale applied
//                   once to its dot product and once to its softmax weight.
// Inputs are checked here; the Python side decides when to call (CPU, fp32 or bf16, contiguous).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cell_blocks.h"

namespace {

// Calls f(T{}) with T the kernel type for fp32 or bf16 tensors (the dtypes the native forward runs).
template <typename F>
void dispatch(at::ScalarType dtype, const char* name, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else if (dtype == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, name, ": only float32 and bfloat16 tensors are supported, got ", dtype);
  }
}

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// Dot product and axpy of a float vector with one K or V row of the pool's dtype. Written with
// AVX-512 where the build has it (16 lanes: cell_blocks::load_row16), plain loops otherwise.
#if defined(__AVX512F__)
using cell_blocks::load_row16;
#endif

inline float to_f(int8_t v) { return static_cast<float>(v); }

template <typename T>
inline float dot_row(const float* q, const T* row, int64_t dim) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= dim; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load_row16(row + d), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; d < dim; ++d) s += q[d] * to_f(row[d]);
  return s;
}

template <typename T>
inline void axpy_row(float* acc, float p, const T* row, int64_t dim) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (; d + 16 <= dim; d += 16) _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, load_row16(row + d), _mm512_loadu_ps(acc + d)));
#endif
  for (; d < dim; ++d) acc[d] += p * to_f(row[d]);
}

template <typename T>
void rms_norm_kernel(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      T* o = out + r * dim;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) sum += to_f(xr[i]) * to_f(xr[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      // transformers rounds the normalized value to the input dtype before scaling by the weight
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) o[i] = static_cast<T>(to_f(w[i]) * to_f(static_cast<T>(to_f(xr[i]) * inv)));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous [rows, dim] tensor");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "rms_norm: weight must be a contiguous [dim] tensor of x's dtype");
  auto out = at::empty_like(x);
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                              x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// Each Q head row of qkv normalized with q_weight, each K head row with k_weight (V untouched), in place;
// the same arithmetic as rms_norm_kernel per row.
void qk_norm(at::Tensor qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, int64_t n_q, int64_t n_kv,
             double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qk_norm: qkv must be a contiguous [tokens, width] tensor");
  const int64_t dim = q_weight.numel();
  TORCH_CHECK(dim > 0 && k_weight.numel() == dim && qkv.size(1) == (n_q + 2 * n_kv) * dim,
              "qk_norm: qkv width must be (n_q + 2 n_kv) * head_dim, both weights [head_dim]");
  TORCH_CHECK(q_weight.is_contiguous() && k_weight.is_contiguous() && q_weight.scalar_type() == qkv.scalar_type()
                  && k_weight.scalar_type() == qkv.scalar_type(),
              "qk_norm: the weights must be contiguous and of qkv's dtype");
  const int64_t tokens = qkv.size(0), heads = n_q + n_kv, width = qkv.size(1);
  dispatch(qkv.scalar_type(), "qk_norm", [&](auto tag) {
    using T = decltype(tag);
    T* base = qkv.data_ptr<T>();
    const T* qw = q_weight.data_ptr<T>();
    const T* kw = k_weight.data_ptr<T>();
    const float e = static_cast<float>(eps);
    // a decode row's heads are a few thousand values: threads only for prefill-sized work (a parallel region
    // costs more than the whole norm at one row)
    at::parallel_for(0, tokens * heads, std::max<int64_t>(16, 65536 / dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t h = r % heads;
        T* x = base + (r / heads) * width + h * dim;
        const T* w = h < n_q ? qw : kw;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; ++i) sum += to_f(x[i]) * to_f(x[i]);
        const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + e);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) x[i] = static_cast<T>(to_f(w[i]) * to_f(static_cast<T>(to_f(x[i]) * inv)));
      }
    });
  });
}

// out[i] = x[i] * cos[i] + rotate_half(x)[i] * sin[i], rotate_half(x) = cat(-x[half:], x[:half])
template <typename T>
inline void rope_row(const T* x, const T* cos, const T* sin, T* out, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i)
    out[i] = static_cast<T>(to_f(x[i]) * to_f(cos[i]) - to_f(x[i + half]) * to_f(sin[i]));
#pragma omp simd
  for (int64_t i = half; i < dim; ++i)
    out[i] = static_cast<T>(to_f(x[i]) * to_f(cos[i]) + to_f(x[i - half]) * to_f(sin[i]));
}

// One row of `dim` floats into int8 and its scale: scale = max|x| / 127, q = round-half-even(x / scale),
// the rule engine/cells/int8_kv.py's `quantize` follows (a zero row: scale 0, zeros).
inline void quantize_row(const float* x, int8_t* out, float* scale, int64_t dim) {
  float amax = 0.f;
  for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax / 127.f;
  *scale = s;
  const float div = s == 0.f ? 1.f : s;
  for (int64_t i = 0; i < dim; ++i) {
    const float r = std::nearbyint(x[i] / div);
    out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pool,
                      at::Tensor v_pool, const at::Tensor& cells, int64_t n_q, int64_t n_kv) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "rope_store: qkv must be a contiguous [tokens, width] tensor");
  const int64_t n_tok = qkv.size(0);
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes(),
              "rope_store: pools must be contiguous [1, n_kv, n_cells, head_dim] tensors of one shape");
  const int64_t n_cells = k_pool.size(2), dim = k_pool.size(3);
  TORCH_CHECK(k_pool.size(1) == n_kv && qkv.size(1) == (n_q + 2 * n_kv) * dim,
              "rope_store: qkv width must be (n_q + 2 n_kv) * head_dim of the pools");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == n_tok && cos.size(1) == dim &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rope_store: cos and sin must be contiguous [tokens, head_dim]");
  TORCH_CHECK(cells.scalar_type() == at::kLong && cells.numel() == n_tok && cells.is_contiguous(),
              "rope_store: cells must be int64 [tokens]");
  TORCH_CHECK(qkv.scalar_type() == k_pool.scalar_type() && qkv.scalar_type() == cos.scalar_type() &&
                  qkv.scalar_type() == sin.scalar_type(),
              "rope_store: qkv, cos, sin and the pools must share one dtype");
  auto q = at::empty({n_tok, n_q, dim}, qkv.options());
  const int64_t* cell = cells.data_ptr<int64_t>();
  for (int64_t t = 0; t < n_tok; ++t)
    TORCH_CHECK(cell[t] >= 0 && cell[t] < n_cells, "rope_store: cell index out of range");
  dispatch(qkv.scalar_type(), "rope_store", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    scalar_t* qo = q.data_ptr<scalar_t>();
    scalar_t* kp = k_pool.data_ptr<scalar_t>();
    scalar_t* vp = v_pool.data_ptr<scalar_t>();
    const int64_t width = qkv.size(1), heads = n_q + 2 * n_kv;
    at::parallel_for(0, n_tok * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / heads, h = i % heads;
        const scalar_t* x = src + t * width + h * dim;
        if (h < n_q) {
          rope_row(x, c + t * dim, s + t * dim, qo + (t * n_q + h) * dim, dim);
        } else if (h < n_q + n_kv) {
          rope_row(x, c + t * dim, s + t * dim, kp + ((h - n_q) * n_cells + cell[t]) * dim, dim);
        } else {
          std::copy(x, x + dim, vp + ((h - n_q - n_kv) * n_cells + cell[t]) * dim);
        }
      }
    });
  });
  return q;
}

// rope_store with int8 pools: K rows are roped and rounded to the model's dtype (as the float pools hold
// them), then quantized with V's rows into the int8 pools and their scales.
at::Tensor rope_store_q8(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pool,
                         at::Tensor v_pool, at::Tensor k_scale, at::Tensor v_scale, const at::Tensor& cells,
                         int64_t n_q, int64_t n_kv) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "rope_store_q8: qkv must be a contiguous [tokens, width] tensor");
  const int64_t n_tok = qkv.size(0);
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.scalar_type() == at::kChar && v_pool.scalar_type() == at::kChar,
              "rope_store_q8: pools must be contiguous int8 [1, n_kv, n_cells, head_dim] tensors of one shape");
  const int64_t n_cells = k_pool.size(2), dim = k_pool.size(3);
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat && k_scale.is_contiguous() &&
                  v_scale.is_contiguous() && k_scale.numel() == n_kv * n_cells && v_scale.numel() == n_kv * n_cells,
              "rope_store_q8: scales must be contiguous float32 [1, n_kv, n_cells]");
  TORCH_CHECK(k_pool.size(1) == n_kv && qkv.size(1) == (n_q + 2 * n_kv) * dim,
              "rope_store_q8: qkv width must be (n_q + 2 n_kv) * head_dim of the pools");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == n_tok && cos.size(1) == dim &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rope_store_q8: cos and sin must be contiguous [tokens, head_dim]");
  TORCH_CHECK(cells.scalar_type() == at::kLong && cells.numel() == n_tok && cells.is_contiguous(),
              "rope_store_q8: cells must be int64 [tokens]");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && qkv.scalar_type() == sin.scalar_type(),
              "rope_store_q8: qkv, cos and sin must share one dtype");
  auto q = at::empty({n_tok, n_q, dim}, qkv.options());
  const int64_t* cell = cells.data_ptr<int64_t>();
  for (int64_t t = 0; t < n_tok; ++t)
    TORCH_CHECK(cell[t] >= 0 && cell[t] < n_cells, "rope_store_q8: cell index out of range");
  dispatch(qkv.scalar_type(), "rope_store_q8", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    scalar_t* qo = q.data_ptr<scalar_t>();
    int8_t* kp = k_pool.data_ptr<int8_t>();
    int8_t* vp = v_pool.data_ptr<int8_t>();
    float* ks = k_scale.data_ptr<float>();
    float* vs = v_scale.data_ptr<float>();
    const int64_t width = qkv.size(1), heads = n_q + 2 * n_kv;
    at::parallel_for(0, n_tok * heads, 64, [&](int64_t begin, int64_t end) {
      thread_local std::vector<scalar_t> roped;
      thread_local std::vector<float> row;
      roped.resize(static_cast<size_t>(dim));
      row.resize(static_cast<size_t>(dim));
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / heads, h = i % heads;
        const scalar_t* x = src + t * width + h * dim;
        if (h < n_q) {
          rope_row(x, c + t * dim, s + t * dim, qo + (t * n_q + h) * dim, dim);
          continue;
        }
        const bool is_k = h < n_q + n_kv;
        const int64_t r = ((is_k ? h - n_q : h - n_q - n_kv) * n_cells + cell[t]);
        if (is_k) {
          rope_row(x, c + t * dim, s + t * dim, roped.data(), dim);
          x = roped.data();
        }
        for (int64_t d = 0; d < dim; ++d) row[d] = to_f(x[d]);
        quantize_row(row.data(), (is_k ? kp : vp) + r * dim, (is_k ? ks : vs) + r, dim);
      }
    });
  });
  return q;
}

// Every cache line of a pool row: rows of one sequence lie strided through the pool (decodes of many
// sequences interleave), out of the hardware prefetcher's reach, and come from DRAM after a layer's
// weights have streamed through the caches.
template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

// v[0, n) summed in 16 fixed lanes (element l in lane l % 16), then the lanes in order: the zeros of a row's
// masked cells past its own width change nothing, so a row's softmax total is the same whatever width the
// step's widest row gives the gather (engine/model/native/rows.py).
inline float lane_sum(const float* v, int64_t n) {
  float lanes[16] = {};
  int64_t l = 0;
  for (; l + 16 <= n; l += 16)
#pragma omp simd
    for (int j = 0; j < 16; ++j) lanes[j] += v[l + j];
  for (int j = 0; l + j < n; ++j) lanes[j] += v[l + j];
  float total = 0.f;
  for (int j = 0; j < 16; ++j) total += lanes[j];
  return total;
}

// KV is T (float pools) or int8_t (int8 pools, with `ks`/`vs` the rows' scales; nullptr for float pools).
template <typename T, typename KV>
void attention_kernel(const T* q, const KV* kp, const KV* vp, const float* ks, const float* vs, const int64_t* idx,
                      const float* bias, T* out, int64_t n_tok, int64_t n_q, int64_t n_kv, int64_t n_cells,
                      int64_t dim, int64_t width, float scale) {
#if defined(__AVX512F__)
  if (cell_blocks::run(q, kp, vp, ks, vs, idx, bias, out, n_tok, n_q, n_kv, n_cells, dim, width, scale)) return;
#endif
  const int64_t group = n_q / n_kv;
  constexpr int64_t kAhead = 16;  // rows fetched ahead (see prefetch_row)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n_tok * n_kv, 1, [&](int64_t begin, int64_t end) {
    // per-thread scratch kept between calls: no malloc in OpenMP workers (their arenas would hold
    // freed pages), and no allocation at all once the widest step has run
    thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(group * (width + 2 * dim + 1)));
    float* scores = scratch.data();
    float* acc = scores + group * width;
    float* qf = acc + group * dim;
    float* mx = qf + group * dim;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / n_kv, h = i % n_kv;
      const int64_t* cols = idx + t * width;
      const float* b = bias + t * width;
      for (int64_t g = 0; g < group; ++g) {
        const T* qr = q + (t * n_q + h * group + g) * dim;
        float* qg = qf + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) qg[d] = to_f(qr[d]) * scale;
      }
      std::fill(mx, mx + group, neg_inf);
      for (int64_t l = 0; l < width; ++l) {  // scores: each key row is read once for its G queries
        if (b[l] == neg_inf) {
          for (int64_t g = 0; g < group; ++g) scores[g * width + l] = neg_inf;
          continue;
        }
        // checked where read (masked entries are never read): no extra pass over idx every layer
        TORCH_CHECK(cols[l] >= 0 && cols[l] < n_cells, "cell_attention: cell index out of range");
        const KV* kr = kp + (h * n_cells + cols[l]) * dim;
        if (l + kAhead < width) prefetch_row(kp + (h * n_cells + cols[l + kAhead]) * dim, dim);
        const float kscale = ks ? ks[h * n_cells + cols[l]] : 1.f;
        for (int64_t g = 0; g < group; ++g) {
          const float s = dot_row(qf + g * dim, kr, dim) * kscale + b[l];
          scores[g * width + l] = s;
          mx[g] = std::max(mx[g], s);
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax in fp32 (a row always sees its own cell)
        float* sg = scores + g * width;
        const float m = mx[g] == neg_inf ? 0.f : mx[g];
#pragma omp simd
        for (int64_t l = 0; l < width; ++l) sg[l] = std::exp(sg[l] - m);
        const float total = lane_sum(sg, width);
        const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma omp simd
        for (int64_t l = 0; l < width; ++l) sg[l] *= inv;
      }
      std::fill(acc, acc + group * dim, 0.f);
      for (int64_t l = 0; l < width; ++l) {  // values: each value row is read once for its G queries
        if (b[l] == neg_inf) continue;
        const KV* vr = vp + (h * n_cells + cols[l]) * dim;
        if (l + kAhead < width) prefetch_row(vp + (h * n_cells + cols[l + kAhead]) * dim, dim);
        const float vscale = vs ? vs[h * n_cells + cols[l]] : 1.f;
        for (int64_t g = 0; g < group; ++g) axpy_row(acc + g * dim, scores[g * width + l] * vscale, vr, dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out + (t * n_q + h * group + g) * dim;
        const float* a = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(a[d]);
      }
    }
  });
}

at::Tensor cell_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                          const at::Tensor& idx, const at::Tensor& bias, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "cell_attention: q must be a contiguous [tokens, n_q, head_dim] tensor");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes(),
              "cell_attention: pools must be contiguous [1, n_kv, n_cells, head_dim] tensors of one shape");
  const int64_t n_tok = q.size(0), n_q = q.size(1), dim = q.size(2);
  const int64_t n_kv = k_pool.size(1), n_cells = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == dim && n_q % n_kv == 0, "cell_attention: q heads must be a multiple of the pools' heads");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "cell_attention: q and the pools must share one dtype");
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == n_tok && idx.scalar_type() == at::kLong && idx.is_contiguous(),
              "cell_attention: idx must be a contiguous int64 [tokens, width] tensor");
  TORCH_CHECK(bias.sizes() == idx.sizes() && bias.scalar_type() == at::kFloat && bias.is_contiguous(),
              "cell_attention: bias must be a contiguous float32 tensor shaped like idx");
  const int64_t* cols = idx.data_ptr<int64_t>();
  auto out = at::empty({n_tok, n_q * dim}, q.options());
  dispatch(q.scalar_type(), "cell_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    attention_kernel<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(),
                                         nullptr, nullptr, cols, bias.data_ptr<float>(), out.data_ptr<scalar_t>(), n_tok,
                                         n_q, n_kv, n_cells, dim, idx.size(1), static_cast<float>(scale));
  });
  return out;
}

at::Tensor cell_attention_q8(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                             const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& idx,
                             const at::Tensor& bias, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "cell_attention_q8: q must be a contiguous [tokens, n_q, head_dim] tensor");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.scalar_type() == at::kChar && v_pool.scalar_type() == at::kChar,
              "cell_attention_q8: pools must be contiguous int8 [1, n_kv, n_cells, head_dim] tensors of one shape");
  const int64_t n_tok = q.size(0), n_q = q.size(1), dim = q.size(2);
  const int64_t n_kv = k_pool.size(1), n_cells = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == dim && n_q % n_kv == 0, "cell_attention_q8: q heads must be a multiple of the pools' heads");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat && k_scale.is_contiguous() &&
                  v_scale.is_contiguous() && k_scale.numel() == n_kv * n_cells && v_scale.numel() == n_kv * n_cells,
              "cell_attention_q8: scales must be contiguous float32 [1, n_kv, n_cells]");
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == n_tok && idx.scalar_type() == at::kLong && idx.is_contiguous(),
              "cell_attention_q8: idx must be a contiguous int64 [tokens, width] tensor");
  TORCH_CHECK(bias.sizes() == idx.sizes() && bias.scalar_type() == at::kFloat && bias.is_contiguous(),
              "cell_attention_q8: bias must be a contiguous float32 tensor shaped like idx");
  const int64_t* cols = idx.data_ptr<int64_t>();
  auto out = at::empty({n_tok, n_q * dim}, q.options());
  dispatch(q.scalar_type(), "cell_attention_q8", [&](auto tag) {
    using scalar_t = decltype(tag);
    attention_kernel<scalar_t, int8_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<int8_t>(), v_pool.data_ptr<int8_t>(),
                                       k_scale.data_ptr<float>(), v_scale.data_ptr<float>(), cols, bias.data_ptr<float>(),
                                       out.data_ptr<scalar_t>(), n_tok, n_q, n_kv, n_cells, dim, idx.size(1),
                                       static_cast<float>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(cellserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("qk_norm(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, int n_q, int n_kv, float eps) -> ()");
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor cells, "
        "int n_q, int n_kv) -> Tensor");
  m.def("cell_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor idx, Tensor bias, float scale) -> Tensor");
  m.def("rope_store_q8(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor cells, int n_q, int n_kv) -> Tensor");
  m.def("cell_attention_q8(Tensor q, Tensor k_pool, Tensor v_pool, Tensor k_scale, Tensor v_scale, Tensor idx, "
        "Tensor bias, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(cellserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("qk_norm", &qk_norm);
  m.impl("rope_store", &rope_store);
  m.impl("cell_attention", &cell_attention);
  m.impl("rope_store_q8", &rope_store_q8);
  m.impl("cell_attention_q8", &cell_attention_q8);
}
