// quant_tiles: `x @ W.T` for any number of rows over the 32-weight kinds (q8_0, q4_0, q4_1, q5_0, q5_1) kept in 16-row
// tiles (engine/model/native/quant_tiles.py lays them out once at load): one kernel for decode, speculative
// verification and batched decode, and every row computed bitwise as a call with it alone.
//
// The tiles are the weight tiles quant_gemm.cpp builds per call by unpacking and transposing 16 row-layout
// weight rows (quant_blocks.h), kept that way instead, packed (no byte more than the row layout):
//   qs [T, P, L, 16, 4] uint8: tile t (weight rows 16t..16t+15), pair p, then per 64-byte record the 4 bytes
//      of lane l of each of the 16 rows side by side. q8_0: L = 16 records, lane l = pair positions 4l..4l+3;
//      q4_0 / q4_1 / q5_0 / q5_1: L = 8, record l holds the row-layout bytes 4l..4l+3 of the pair, whose low
//      nibbles are lane l and whose high nibbles lane l + 8 (the pair order puts both blocks' elements j and
//      j + 16 in one byte).
//   d, m [T, P, 2, 16] fp16: per pair, block and row the scale (and q4_1's / q5_1's minimum); zero past K or N.
//   qh [T, P, 8, 2, 8] uint8 (q5_0 / q5_1): per pair and record l two little-endian uint64 masks, the low
//      nibbles' then the high nibbles': bit 4j + b is bit 4 of row j's byte b of the record, so one masked
//      byte add puts the fifth bits into an unpacked record (no byte more than the row layout's qh).
// So the unpacking the row kernel does per weight row and row of x (load_pair, load_scales) and the transpose
// quant_gemm does per call are gone: a `vpdpbusd` multiplies 16 weight rows x 4 inputs by one broadcast
// activation lane, and the float work is per block for 16 weight rows at once. At one row the kernel streams
// the weight once (decode is memory-bound); at 9-16 rows (verification) it does ~1/4 of the row kernel's work.
//
// Row invariance: each (row of x, weight row) has its own int32 and fp32 accumulators and takes the same
// instructions in the same order (per pair, per block: int32 dot from -z * s, then acc += dv * float(dot) * da
// (+ mv * da * s)) whatever the call's other rows are; rows are quantized each on their own (quant_gemm.h).
// Hence engine/model/native/rows.py's guarantee for these kinds at every row count, with no routing.
// Epilogues as quant_linear's: "none", "add" (y = other + x W^T + b), "swiglu" (W = [gate; up], each half
// tiled apart: parts = 2). With `parts` P', W's n rows are P' parts of n / P' rows, each padded to whole tiles.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "quant_gemm.h"

namespace {

using namespace cq;

struct Tiled {
  const uint8_t* qs;
  const c10::Half* d;
  const c10::Half* m;
  int64_t pairs, tiles, part_rows, part_tiles;
  const uint64_t* qh;  // q5_0 / q5_1: [T, P, 8, 2] masks
};

#ifdef CELLSERVE_QUANT_VNNI
// The kNC column tiles a task multiplies: tile t's arrays from pair 0.
struct Cols {
  const uint8_t* qs[kNC];
  const c10::Half* d[kNC];
  const c10::Half* m[kNC];
  const uint64_t* qh[kNC];
};

template <int KIND>
constexpr int64_t kRecords = KIND == Q8_0 ? 16 : 8;  // 64-byte records a pair and tile

inline __m512 scales16(const c10::Half* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

// out[r][c * 16 + j] (+)= row r of x . weight row j of column tile c over pairs [p0, p1), R rows (acts: p0's).
template <int KIND, int R>
void micro(const Cols& w, const PairActs* acts, int64_t p0, int64_t p1, bool add, float* out) {
  constexpr int64_t rec = kRecords<KIND> * 64;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 af[R][kNC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kNC; ++c) af[r][c] = add ? _mm512_loadu_ps(out + (r * kNC + c) * 16) : _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    const PairActs& A = acts[p - p0];
    for (int c = 0; c < kNC; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w.qs[c] + p * rec + 4096), _MM_HINT_T0);
      if (five_bits(KIND)) _mm_prefetch(reinterpret_cast<const char*>(w.qh[c] + p * 16 + 4096 / 32), _MM_HINT_T0);
    }
    for (int g = 0; g < 2; ++g) {  // the pair's two blocks
      __m512i ai[R][kNC];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kNC; ++c) ai[r][c] = _mm512_set1_epi32(A.zi[g][r]);
      const auto dot = [&](const __m512i* wv, int lane) {
        for (int r = 0; r < R; ++r) {
          int32_t raw;
          std::memcpy(&raw, A.q[r] + 4 * lane, 4);
          const __m512i av = _mm512_set1_epi32(raw);
          for (int c = 0; c < kNC; ++c) ai[r][c] = _mm512_dpbusd_epi32(ai[r][c], wv[c], av);
        }
      };
      for (int i = 0; i < 4; ++i) {
        __m512i lo[kNC], hi[kNC];
        if (KIND == Q8_0) {  // block g: lanes 8g .. 8g + 7
          const int l = 8 * g + 2 * i;
          for (int c = 0; c < kNC; ++c) {
            lo[c] = _mm512_loadu_si512(w.qs[c] + p * rec + l * 64);
            hi[c] = _mm512_loadu_si512(w.qs[c] + p * rec + (l + 1) * 64);
          }
          dot(lo, l);
          dot(hi, l + 1);
        } else {  // block g: records 4g .. 4g + 3, low nibbles lane l, high nibbles lane l + 8
          const int l = 4 * g + i;
          for (int c = 0; c < kNC; ++c) {
            const __m512i v = _mm512_loadu_si512(w.qs[c] + p * rec + l * 64);
            lo[c] = _mm512_and_si512(v, low4);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            if (five_bits(KIND)) {  // bit 4: + 16 where the record's masks say
              const __m512i sixteen = _mm512_set1_epi8(16);
              lo[c] = _mm512_mask_add_epi8(lo[c], _cvtu64_mask64(w.qh[c][(p * 8 + l) * 2]), lo[c], sixteen);
              hi[c] = _mm512_mask_add_epi8(hi[c], _cvtu64_mask64(w.qh[c][(p * 8 + l) * 2 + 1]), hi[c], sixteen);
            }
          }
          dot(lo, l);
          dot(hi, l + 8);
        }
      }
      for (int c = 0; c < kNC; ++c) {
        const __m512 dv = scales16(w.d[c] + (p * 2 + g) * 16);
        for (int r = 0; r < R; ++r)
          af[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ai[r][c]), dv), _mm512_set1_ps(A.da[g][r]), af[r][c]);
        if (has_mins(KIND)) {
          const __m512 mv = scales16(w.m[c] + (p * 2 + g) * 16);
          for (int r = 0; r < R; ++r) af[r][c] = _mm512_fmadd_ps(mv, _mm512_set1_ps(A.ms[g][r]), af[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kNC; ++c) _mm512_storeu_ps(out + (r * kNC + c) * 16, af[r][c]);
}

// Task i's column tiles and the weight rows they hold (start, count): "none"/"add" tiles kNC i.., "swiglu"
// gate tile i and up tile part_tiles + i.
template <int KIND>
Cols task_columns(const Tiled& w, const Call& c, int64_t i, int64_t* start, int* count) {
  Cols cols;
  for (int v = 0; v < kNC; ++v) {
    int64_t t = c.swiglu ? v * w.part_tiles + i : i * kNC + v;
    const int64_t part = t / w.part_tiles, j0 = (t % w.part_tiles) * 16;
    start[v] = part * w.part_rows + j0;
    count[v] = t < w.tiles ? static_cast<int>(std::clamp<int64_t>(w.part_rows - j0, 0, 16)) : 0;
    t = std::min(t, w.tiles - 1);  // a task's missing tile: computed over a real one, not written
    cols.qs[v] = w.qs + t * w.pairs * kRecords<KIND> * 64;
    cols.d[v] = w.d + t * w.pairs * 32;
    cols.m[v] = w.m ? w.m + t * w.pairs * 32 : nullptr;
    cols.qh[v] = w.qh ? w.qh + t * w.pairs * 16 : nullptr;
  }
  return cols;
}

template <int KIND>
void tiled(const Tiled& w, const Call& c, float* y) {
  const Acts a = quantize_rows<KIND>(c.x.data_ptr<float>(), c.rows, c.w.k, /*balanced=*/true);
  const int64_t tasks = c.swiglu ? w.part_tiles : (w.tiles + kNC - 1) / kNC;
  constexpr int64_t tile_out = kR * kNC * 16;
  at::parallel_for(0, tasks, 1, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> out;  // no malloc in an OpenMP worker once the widest call has run
    out.resize(static_cast<size_t>(a.tiles() * tile_out));
    int64_t start[kNC];
    int count[kNC];
    for (int64_t i = i0; i < i1; ++i) {
      const Cols cols = task_columns<KIND>(w, c, i, start, count);
      for (int64_t p0 = 0; p0 < a.pairs; p0 += kKB) {  // K blocks: each stays in L1 across the row tiles
        const int64_t p1 = std::min(a.pairs, p0 + kKB);
        for (int64_t tile = 0; tile < a.tiles(); ++tile) {
          const PairActs* acts = a.v.data() + tile * a.pairs + p0;
          float* o = out.data() + tile * tile_out;
          switch (a.rows(tile)) {
            case 1: micro<KIND, 1>(cols, acts, p0, p1, p0 > 0, o); break;
            case 2: micro<KIND, 2>(cols, acts, p0, p1, p0 > 0, o); break;
            case 3: micro<KIND, 3>(cols, acts, p0, p1, p0 > 0, o); break;
            case 4: micro<KIND, 4>(cols, acts, p0, p1, p0 > 0, o); break;
            case 5: micro<KIND, 5>(cols, acts, p0, p1, p0 > 0, o); break;
            default: micro<KIND, kR>(cols, acts, p0, p1, p0 > 0, o); break;
          }
        }
      }
      for (int64_t tile = 0; tile < a.tiles(); ++tile)
        epilogue(c, start, count, a.starts[tile], a.rows(tile), out.data() + tile * tile_out, y);
    }
  });
}
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

#if defined(CELLSERVE_QUANT_VNNI) && defined(__AVX512BF16__)
// A 4- or 5-bit block's 16 or 32 possible weights as bf16 (words 0..31 of the result): dv * (q - z), then + mv,
// rounded to nearest even: the operations quant_dequant_bf16 does per weight, done once per value.
template <int KIND>
__attribute__((optimize("fp-contract=off"))) inline __m512i nibble_table(float dv, float mv, __m512 z) {
  const auto at = [&](__m512 q) {
    __m512 v = _mm512_mul_ps(_mm512_set1_ps(dv), _mm512_sub_ps(q, z));
    return has_mins(KIND) ? _mm512_add_ps(v, _mm512_set1_ps(mv)) : v;
  };
  const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  if (!five_bits(KIND)) return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(at(q)));
  return (__m512i)_mm512_cvtne2ps_pbh(at(_mm512_add_ps(q, _mm512_set1_ps(16.f))), at(q));
}

// Row j's fifth bits of one pair from its tile's masks (m: the pair's [8][2]), as the row layout's 64-bit mask in
// the pair order: position 4l + b from the low-nibble mask of record l, 32 + 4l + b from its high-nibble one.
inline uint64_t row_high_bits(const uint64_t* m, int64_t j) {
  uint64_t out = 0;
  for (int l = 0; l < 8; ++l) {
    out |= ((m[2 * l] >> (4 * j)) & 0xF) << (4 * l);
    out |= ((m[2 * l + 1] >> (4 * j)) & 0xF) << (32 + 4 * l);
  }
  return out;
}

// A block's 16 bytes (element j in the low nibble of byte j, element j + 16 in the high one) as 32 word indices
// in element order.
inline __m512i nibble_index(__m128i bytes) {
  const __m256i w = _mm256_cvtepu8_epi16(bytes);
  const __m256i lo = _mm256_and_si256(w, _mm256_set1_epi16(0x0F)), hi = _mm256_srli_epi16(w, 4);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Weight rows [a, b) as bf16 rows of out (row r0 first): bitwise what untiling them and quant_dequant_bf16 give
// (dv * (q - z), then + mv, no fused multiply-add, rounded to nearest even), without the row-layout copy: a
// row's pair bytes are gathered from its lane of the tile's records (one 4-byte lane a record, in order);
// 4-bit weights are looked up in their block's table of 16 (nibble_table: ~2x fewer operations a weight).
template <int KIND>
__attribute__((optimize("fp-contract=off"))) void tiles_bf16_rows(const Tiled& w, int64_t r0, int64_t a, int64_t b,
                                                                   at::BFloat16* out) {
  constexpr int64_t records = kRecords<KIND>;
  const __m512 z = _mm512_set1_ps(static_cast<float>(zero_point(KIND)));
  const __m512i at_record = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(16));  // record l's lane 0, in int32s
  const int64_t k = w.pairs * 64;
  for (int64_t n = a; n < b; ++n) {
    const int64_t part = n / w.part_rows, within = n % w.part_rows;
    const int64_t t = part * w.part_tiles + within / 16, j = within % 16;
    const int32_t* lanes = reinterpret_cast<const int32_t*>(w.qs) + t * w.pairs * records * 16 + j;
    const c10::Half* d = w.d + t * w.pairs * 32 + j;
    const c10::Half* m = w.m ? w.m + t * w.pairs * 32 + j : nullptr;
    at::BFloat16* dst = out + (n - r0) * k;
    for (int64_t p = 0; p < w.pairs; ++p) {
      const int32_t* rec = lanes + p * records * 16;
      if (KIND != Q8_0) {  // 4/5-bit: each block's 16 or 32 possible values, then a table lookup per weight
        const __m256i bytes = _mm256_i32gather_epi32(rec, _mm512_castsi512_si256(at_record), 4);
        const uint64_t high = five_bits(KIND) ? row_high_bits(w.qh + (t * w.pairs + p) * 16, j) : 0;
        for (int g = 0; g < 2; ++g) {
          const float mg = has_mins(KIND) ? static_cast<float>(m[(p * 2 + g) * 16]) : 0.f;
          const __m512i table = nibble_table<KIND>(static_cast<float>(d[(p * 2 + g) * 16]), mg, z);
          __m512i v = nibble_index(g == 0 ? _mm256_castsi256_si128(bytes) : _mm256_extracti128_si256(bytes, 1));
          if (five_bits(KIND)) {  // element order: block g's elements 0..15, then 16..31
            const uint32_t bits = static_cast<uint32_t>((high >> (16 * g)) & 0xFFFF) |
                                  static_cast<uint32_t>((high >> (32 + 16 * g)) & 0xFFFF) << 16;
            v = _mm512_mask_add_epi16(v, _cvtu32_mask32(bits), v, _mm512_set1_epi16(16));
          }
          _mm512_storeu_si512(dst + p * 64 + g * 32, _mm512_permutexvar_epi16(v, table));
        }
        continue;
      }
      const __m512i q = _mm512_i32gather_epi32(at_record, rec, 4);
      for (int c = 0; c < 4; ++c) {
        const int g = chunk_block(KIND, c), half = chunk_half(KIND, c);
        __m512 v = _mm512_mul_ps(_mm512_set1_ps(static_cast<float>(d[(p * 2 + g) * 16])), _mm512_sub_ps(chunk_floats(q, c), z));
        if (has_mins(KIND)) v = _mm512_add_ps(v, _mm512_set1_ps(static_cast<float>(m[(p * 2 + g) * 16])));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + p * 64 + g * 32 + half * 16), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}
constexpr bool kTilesBf16 = true;
#else
constexpr bool kTilesBf16 = false;
#endif

const c10::Half* halves(const at::Tensor& t, const at::Tensor& qs, int64_t pairs, const char* what) {
  TORCH_CHECK(t.dim() == 4 && t.is_contiguous() && t.scalar_type() == at::kHalf && t.size(0) == qs.size(0) &&
                  t.size(1) == pairs && t.size(2) == 2 && t.size(3) == 16,
              "quant_tiles: ", what, " must be contiguous fp16 [T, P, 2, 16]");
  return reinterpret_cast<const c10::Half*>(t.data_ptr());
}

// The tiled weight [qs, d, m, qh] of `n` rows in `parts` parts, checked (errors name `op`).
Tiled tiled_of(at::TensorList wl, int64_t kind, int64_t n, int64_t parts, const char* op) {
  TORCH_CHECK(kind == Q8_0 || kind == Q4_0 || kind == Q4_1 || kind == Q5_0 || kind == Q5_1, op,
              ": kind must be q8_0, q4_0, q4_1, q5_0 or q5_1 (0..2, 6, 7)");
  TORCH_CHECK(wl.size() == 4, op, ": the weight is [qs, d, m, qh] (m empty but for q4_1 / q5_1, qh but for q5_0 / q5_1)");
  const at::Tensor& qs = wl[0];
  const int64_t records = kind == Q8_0 ? 16 : 8;
  TORCH_CHECK(qs.dim() == 5 && qs.is_contiguous() && qs.scalar_type() == at::kByte && qs.size(2) == records &&
                  qs.size(3) == 16 && qs.size(4) == 4,
              op, ": qs must be contiguous uint8 [T, P, ", records, ", 16, 4]");
  TORCH_CHECK(parts >= 1 && n % parts == 0 && qs.size(0) % parts == 0, op, ": n and the tiles must split into `parts`");
  Tiled w{qs.data_ptr<uint8_t>(), nullptr, nullptr, qs.size(1), qs.size(0), n / parts, qs.size(0) / parts, nullptr};
  TORCH_CHECK(w.part_tiles == (w.part_rows + 15) / 16, op, ": each part must be ceil(rows / 16) tiles");
  w.d = halves(wl[1], qs, w.pairs, "d");
  TORCH_CHECK((wl[2].numel() > 0) == has_mins(kind), op, ": m is given exactly for q4_1 and q5_1");
  if (has_mins(kind)) w.m = halves(wl[2], qs, w.pairs, "m");
  const at::Tensor& qh = wl[3];
  TORCH_CHECK((qh.numel() > 0) == five_bits(kind), op, ": qh is given exactly for q5_0 and q5_1");
  if (five_bits(kind)) {
    TORCH_CHECK(qh.dim() == 5 && qh.is_contiguous() && qh.scalar_type() == at::kByte && qh.size(0) == qs.size(0) &&
                    qh.size(1) == w.pairs && qh.size(2) == 8 && qh.size(3) == 2 && qh.size(4) == 8,
                op, ": qh must be contiguous uint8 [T, P, 8, 2, 8]");
    w.qh = reinterpret_cast<const uint64_t*>(qh.data_ptr());
  }
  return w;
}

at::Tensor quant_tiles(const at::Tensor& x, at::TensorList wl, int64_t kind, int64_t n, int64_t parts,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& other,
                       c10::string_view op_view) {
  TORCH_CHECK(kVnni, "quant_tiles needs AVX-512 VNNI; without it QuantLinear untiles the weight (fp32 tiles)");
  Tiled w = tiled_of(wl, kind, n, parts, "quant_tiles");
  const int64_t k = w.pairs * 64;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(0) >= 1 &&
                  x.size(1) == k,
              "quant_tiles: x must be contiguous float32 [rows >= 1, K] with K the weight's");
  const std::string op(op_view);
  TORCH_CHECK(op == "none" || op == "add" || op == "swiglu", "quant_tiles: op must be none, add or swiglu");
  Call c;
  c.w.k = x.size(1);
  c.x = x;
  c.rows = x.size(0);
  c.swiglu = op == "swiglu";
  if (c.swiglu && parts == 1 && n % 32 == 0) {  // whole tiles a half: the halves lie apart already
    w.part_rows = n / 2;
    w.part_tiles = w.tiles / 2;
  }
  TORCH_CHECK(!c.swiglu || w.part_rows * 2 == n, "quant_tiles: swiglu needs the [gate; up] halves tiled apart "
              "(parts = 2, or 16-row halves)");
  c.n_out = c.swiglu ? w.part_rows : n;
  if (bias.has_value() && bias->defined()) {
    c.bias = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(c.bias.numel() == n, "quant_tiles: bias must have one value per weight row");
  }
  if (op == "add") {
    TORCH_CHECK(other.has_value(), "quant_tiles: op add needs `other`");
    c.other = other->to(at::kFloat).contiguous();
    TORCH_CHECK(c.other.dim() == 2 && c.other.size(0) == c.rows && c.other.size(1) == c.n_out,
                "quant_tiles: `other` must be [rows, N]");
  }
  auto y = at::empty({c.rows, c.n_out}, x.options());
#ifdef CELLSERVE_QUANT_VNNI
  float* yp = y.data_ptr<float>();
  switch (kind) {
    case Q8_0: tiled<Q8_0>(w, c, yp); break;
    case Q4_0: tiled<Q4_0>(w, c, yp); break;
    case Q5_0: tiled<Q5_0>(w, c, yp); break;
    case Q5_1: tiled<Q5_1>(w, c, yp); break;
    default: tiled<Q4_1>(w, c, yp); break;
  }
#endif
  return y;
}

// Weight rows [r0, r1) of tiles as bf16 rows [r1 - r0, K] (the bf16 path of prefill; see tiles_bf16_rows).
at::Tensor quant_tiles_bf16(at::TensorList wl, int64_t kind, int64_t n, int64_t parts, int64_t r0, int64_t r1) {
  TORCH_CHECK(kTilesBf16, "quant_tiles_bf16 needs AVX-512 VNNI and AVX512-BF16; untile the rows instead");
  const Tiled w = tiled_of(wl, kind, n, parts, "quant_tiles_bf16");
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= n, "quant_tiles_bf16: rows out of range");
  auto out = at::empty({r1 - r0, w.pairs * 64}, wl[0].options().dtype(at::kBFloat16));
#if defined(CELLSERVE_QUANT_VNNI) && defined(__AVX512BF16__)
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) {
    switch (kind) {
      case Q8_0: tiles_bf16_rows<Q8_0>(w, r0, a, b, op); break;
      case Q4_0: tiles_bf16_rows<Q4_0>(w, r0, a, b, op); break;
      case Q5_0: tiles_bf16_rows<Q5_0>(w, r0, a, b, op); break;
      case Q5_1: tiles_bf16_rows<Q5_1>(w, r0, a, b, op); break;
      default: tiles_bf16_rows<Q4_1>(w, r0, a, b, op); break;
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cellserve, m) {
  m.def("quant_tiles(Tensor x, Tensor[] w, int kind, int n, int parts, Tensor? bias, Tensor? other, str op) -> Tensor");
  m.def("quant_tiles_bf16(Tensor[] w, int kind, int n, int parts, int r0, int r1) -> Tensor");
}

TORCH_LIBRARY_IMPL(cellserve, CPU, m) {
  m.impl("quant_tiles", &quant_tiles);
  m.impl("quant_tiles_bf16", &quant_tiles_bf16);
}
