// cell_attention's AVX-512 kernel (included by cell_kernels.cpp): cells read in blocks of 16, each block's
// K / V rows converted to fp32 once for every query that reads them.
//
// Why: a verification step brings a sequence's last token and its drafted tokens, 1 + k rows that read the
// same cells. Per (row, kv head) the row-at-a-time kernel reloads and converts every K and V row and sums
// each dot product across its lanes alone; with 9 rows that cost ~6x one row's attention. Here rows whose
// cell lists are equal (the caller gives a sequence's rows the chunk's last row's cells, each row masked by
// its own bias) form one group: per 16-cell block the K rows are converted once, each query does 16 dot
// products into 16 lane vectors and one transposing add tree sums them (no per-cell horizontal sum), the
// softmax's exp runs 16 lanes at a time, and each V row is converted once for the group's queries.
//
// What stays true: a row's output depends only on its query, its own cells (in the given column order) and
// its bias, never on which other rows share the call or how wide the call is: every score is one cell's
// fixed add tree, masked columns are -inf (exp 0: the 16-lane totals and the value sums skip them), and the
// softmax total keeps lane_sum's order (column l in lane l % 16). So a drafted row is bitwise the row a lone
// decode step computes (engine/model/native/rows.py), and so is every decode row of a batch.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace cell_blocks {

// Lane c of the result is the sum of v[c]'s 16 lanes, each by the same add tree.
inline __m512 sum16(const __m512 v[16]) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i] folded to 8, lanes 8-15: v[2i+1]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // 128-bit chunk k: cell 4j + k folded to 4
    x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // chunk m: cells 8k + m, 8k + 4 + m, folded to 2 each
    y[k] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * k], x[2 * k + 1]), _mm512_unpackhi_ps(x[2 * k], x[2 * k + 1]));
  // chunk m, element e: cell 4e + m
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x44), _mm512_shuffle_ps(y[0], y[1], 0xEE));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// exp of 16 lanes (Cephes' polynomial on x - n ln 2, scaled by 2^n): within 2 ulp of expf; -inf and
// anything below expf's normal range give exactly 0, so masked columns add nothing.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.3f);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), _mm512_scalef_ps(p, n));
}

// 16 elements of a pool row as fp32 (bf16 widened by a shift, int8 converted; its scale applied by the caller).
inline __m512 load_row16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load_row16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Rows [t0, t1) of one group, kv head h: what one task computes.
struct Task {
  int64_t t0, t1, h;
};

// Groups of consecutive rows whose cell lists are equal, each cut into tasks of about kQueries queries
// (rows x group) per kv head: enough tasks for the threads, each block conversion shared by many queries.
inline std::vector<Task> plan_tasks(const int64_t* idx, int64_t n_tok, int64_t width, int64_t n_kv, int64_t group) {
  constexpr int64_t kQueries = 9;
  std::vector<Task> tasks;
  int64_t a = 0;
  while (a < n_tok) {
    int64_t b = a + 1;
    while (b < n_tok && std::memcmp(idx + b * width, idx + a * width, width * sizeof(int64_t)) == 0) ++b;
    const int64_t rows = b - a;
    const int64_t parts = std::min(rows, std::max<int64_t>(1, (rows * group + kQueries / 2) / kQueries));
    for (int64_t h = 0; h < n_kv; ++h)
      for (int64_t p = 0; p < parts; ++p) tasks.push_back({a + rows * p / parts, a + rows * (p + 1) / parts, h});
    a = b;
  }
  return tasks;
}

// ND: head_dim / 16. KV: the pools' element type; ks / vs the int8 rows' scales (nullptr for float pools).
template <int ND, typename T, typename KV>
void attention(const T* q, const KV* kp, const KV* vp, const float* ks, const float* vs, const int64_t* idx,
               const float* bias, T* out, int64_t n_tok, int64_t n_q, int64_t n_kv, int64_t n_cells, int64_t width,
               float scale) {
  constexpr int64_t dim = ND * 16;
  const int64_t group = n_q / n_kv, blocks = (width + 15) / 16, padded = blocks * 16;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 ninf = _mm512_set1_ps(neg_inf);
  const std::vector<Task> tasks = plan_tasks(idx, n_tok, width, n_kv, group);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;  // kept between calls: no malloc in OpenMP workers
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task task = tasks[ti];
      const int64_t rows = task.t1 - task.t0, nq = rows * group, h = task.h;
      const int64_t* cols = idx + task.t0 * width;  // every row of the task reads these cells
      scratch.resize(static_cast<size_t>(32 * dim + 32 + nq * (padded + 2 * dim + 16)));
      float* kv_block = scratch.data();     // [16, dim] K (then V) rows of one block, fp32
      float* row_scale = kv_block + 16 * dim;  // [16] their int8 scales
      float* qf = row_scale + 32;           // [nq, dim] the queries, times `scale`
      float* acc = qf + nq * dim;           // [nq, dim] value sums
      float* scores = acc + nq * dim;       // [nq, padded] scores, then softmax weights
      float* maxes = scores + nq * padded;  // [nq, 16] each query's running maximum per lane
      for (int64_t i = 0; i < nq; ++i) {
        const T* qr = q + ((task.t0 + i / group) * n_q + h * group + i % group) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[i * dim + d] = static_cast<float>(qr[d]) * scale;
      }
      // Converts the block's columns that some row of the task sees (the rest are zeros: never used).
      auto load_block = [&](const KV* pool, const float* pool_scale, int64_t blk) {
        const int64_t left = std::min<int64_t>(16, width - blk * 16);
        const __mmask16 inside = static_cast<__mmask16>((1u << left) - 1);
        __mmask16 seen = 0;  // columns some row of the task does not mask
        for (int64_t r = 0; r < rows && seen != inside; ++r) {
          const __m512 b = _mm512_mask_loadu_ps(ninf, inside, bias + (task.t0 + r) * width + blk * 16);
          seen |= _mm512_cmp_ps_mask(b, ninf, _CMP_NEQ_OQ);
        }
        for (int64_t c = 0; c < 16; ++c) {
          const int64_t l = blk * 16 + c;
          const bool used = (seen >> c) & 1;
          float* dst = kv_block + c * dim;
          if (!used) {
            std::fill(dst, dst + dim, 0.f);
            row_scale[c] = 0.f;
            continue;
          }
          TORCH_CHECK(cols[l] >= 0 && cols[l] < n_cells, "cell_attention: cell index out of range");
          const KV* src = pool + (h * n_cells + cols[l]) * dim;
          for (int j = 0; j < ND; ++j) _mm512_storeu_ps(dst + 16 * j, load_row16(src + 16 * j));
          row_scale[c] = pool_scale ? pool_scale[h * n_cells + cols[l]] : 1.f;
        }
      };
      // Scores: per block, 16 dot products per query, masked columns -inf.
      for (int64_t i = 0; i < nq; ++i) _mm512_storeu_ps(maxes + 16 * i, ninf);
      for (int64_t blk = 0; blk < blocks; ++blk) {
        load_block(kp, ks, blk);
        const __m512 kscale = _mm512_loadu_ps(row_scale);
        const int64_t left = std::min<int64_t>(16, width - blk * 16);
        const __mmask16 inside = static_cast<__mmask16>((1u << left) - 1);
        for (int64_t i = 0; i < nq; ++i) {
          __m512 qv[ND], part[16];
          for (int j = 0; j < ND; ++j) qv[j] = _mm512_loadu_ps(qf + i * dim + 16 * j);
          for (int c = 0; c < 16; ++c) {
            __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kv_block + c * dim));
            for (int j = 1; j < ND; ++j) s = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kv_block + c * dim + 16 * j), s);
            part[c] = s;
          }
          const __m512 b = _mm512_mask_loadu_ps(ninf, inside, bias + (task.t0 + i / group) * width + blk * 16);
          const __mmask16 masked = _mm512_cmp_ps_mask(b, ninf, _CMP_EQ_OQ);
          __m512 s = _mm512_add_ps(_mm512_mul_ps(sum16(part), kscale), b);
          s = _mm512_mask_mov_ps(s, masked, ninf);
          _mm512_storeu_ps(scores + i * padded + blk * 16, s);
          _mm512_storeu_ps(maxes + 16 * i, _mm512_max_ps(_mm512_loadu_ps(maxes + 16 * i), s));
        }
      }
      // Softmax per query, in fp32: exp 16 lanes at a time, the total in lane_sum's order.
      for (int64_t i = 0; i < nq; ++i) {
        float* sg = scores + i * padded;
        float m = _mm512_reduce_max_ps(_mm512_loadu_ps(maxes + 16 * i));
        m = m == neg_inf ? 0.f : m;
        const __m512 mv = _mm512_set1_ps(m);
        __m512 lanes = _mm512_setzero_ps();
        for (int64_t l = 0; l < padded; l += 16) {
          const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + l), mv));
          _mm512_storeu_ps(sg + l, e);
          lanes = _mm512_add_ps(lanes, e);
        }
        alignas(64) float lane[16];
        _mm512_store_ps(lane, lanes);
        float total = 0.f;
        for (int j = 0; j < 16; ++j) total += lane[j];
        const __m512 inv = _mm512_set1_ps(total > 0.f ? 1.f / total : 0.f);
        for (int64_t l = 0; l < padded; l += 16) _mm512_storeu_ps(sg + l, _mm512_mul_ps(_mm512_loadu_ps(sg + l), inv));
      }
      // Values: per block, each V row converted once; a query adds the rows it gives weight to, in order.
      std::fill(acc, acc + nq * dim, 0.f);
      for (int64_t blk = 0; blk < blocks; ++blk) {
        load_block(vp, vs, blk);
        for (int64_t i = 0; i < nq; ++i) {
          const float* p = scores + i * padded + blk * 16;
          __m512 a[ND];
          for (int j = 0; j < ND; ++j) a[j] = _mm512_loadu_ps(acc + i * dim + 16 * j);
          for (int c = 0; c < 16; ++c) {
            if (p[c] == 0.f) continue;  // masked (or underflowed): adds nothing
            const __m512 pv = _mm512_set1_ps(p[c] * row_scale[c]);
            for (int j = 0; j < ND; ++j) a[j] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(kv_block + c * dim + 16 * j), a[j]);
          }
          for (int j = 0; j < ND; ++j) _mm512_storeu_ps(acc + i * dim + 16 * j, a[j]);
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        T* o = out + ((task.t0 + i / group) * n_q + h * group + i % group) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[i * dim + d]);
      }
    }
  });
}

// The kernel for this head_dim, or false where it has none (the row kernel runs then).
template <typename T, typename KV>
bool run(const T* q, const KV* kp, const KV* vp, const float* ks, const float* vs, const int64_t* idx, const float* bias,
         T* out, int64_t n_tok, int64_t n_q, int64_t n_kv, int64_t n_cells, int64_t dim, int64_t width, float scale) {
  switch (dim) {
    case 64:
      attention<4>(q, kp, vp, ks, vs, idx, bias, out, n_tok, n_q, n_kv, n_cells, width, scale);
      return true;
    case 128:
      attention<8>(q, kp, vp, ks, vs, idx, bias, out, n_tok, n_q, n_kv, n_cells, width, scale);
      return true;
    default:
      return false;
  }
}

}  // namespace cell_blocks
#endif
