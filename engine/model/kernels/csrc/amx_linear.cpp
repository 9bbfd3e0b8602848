// amx_linear: `x @ W.T` in bfloat16 for 1 to 16 rows on AMX tiles, from oneDNN's packed copy of W.
//
// Why a second few-row kernel beside packed_linear: a speculative verification step runs one sequence's
// drafted tokens as extra rows, and they must round exactly as the one-row decode step does, or greedy
// output drifts from the output without drafts (engine/model/native/rows.py). packed_linear's row-dot loop
// costs one pass of vector FMAs per row (9 rows: ~4x one row's time); an AMX tile multiply does 1 to 16
// rows in the same instruction, so 16 rows cost what one does (the step stays a pass over the weights),
// and a row's sums are the same tile operations whatever the other rows are. It reads the panels
// packed_linear reads (oneDNN tag AB16b32a2b: panel p = columns [32p, 32p+32), stored [Kp/2][32][2]):
// per 32 inputs, tile A = the rows' 32 values (16 pairs), tiles B0/B1 = the pairs' 16 + 16 columns
// (64 bytes each, one pair row every 128 bytes), C0/C1 += A . B in fp32 (TDPBF16PS).
//   op "none"    y = x @ W.T + b
//   op "add"     y = other + x @ W.T + b
//   op "swiglu"  y = silu(x @ G.T + bg) * (x @ U.T + bu), panels = [G, U]
// The epilogue is fp32; the result is rounded once to bf16. Built only where the compiler targets AMX
// (-march=native on an AMX CPU); `amx_linear_fast()` says whether it runs here (the CPU, the build and the
// kernel's permission to use the tile registers).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define CELLSERVE_AMX 1
#endif

namespace {

constexpr int64_t kMaxRows = 16;  // an AMX tile's rows
constexpr int64_t kWidth = 32;    // output columns per panel
constexpr int64_t kStep = 32;     // inputs per tile multiply (16 bf16 pairs)

#if defined(CELLSERVE_AMX)
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux gives a process the tile registers' state only once it asks (oneDNN asks too; asking twice is fine).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// tmm0/tmm1: C (rows x 16 fp32), tmm2: A (rows x 16 pairs), tmm3/tmm4: B (16 pairs x 16 columns)
void configure(int64_t rows) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 3; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 3; t < 5; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// c[r][0..32) = x[r] . panel's 32 columns, for the configured rows; x rows `x_stride` bf16 apart, Kp inputs.
inline void panel_sums(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* panel, int64_t k_pad, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < k_pad; k += kStep) {
    const c10::BFloat16* w = panel + k * kWidth;  // 16 pair rows of 64 bf16
    const char* ahead = reinterpret_cast<const char*>(w) + 4096;  // one core's demand misses alone stream slowly
    for (int b = 0; b < 2048; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    _tile_loadd(2, x + k, x_stride * 2);
    _tile_loadd(3, w, 128);
    _tile_loadd(4, w + 32, 128);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, c, kWidth * 4);
  _tile_stored(1, c + 16, kWidth * 4);
}
#endif

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

struct Args {
  const c10::BFloat16* x;
  int64_t x_stride, k_pad, rows, n_out, panel_elems;
  std::vector<const c10::BFloat16*> ws;
  const float* bias;
  const c10::BFloat16* other;
  c10::BFloat16* y;
  bool swiglu;
};

// Row r's columns [n0, n0 + cols) from its sums `g` (and `u` for swiglu), one branch-free loop per op so it
// vectorizes (16 rows of the LM head: a scalar loop cost a third of the call).
inline void epilogue(const Args& a, const float* g, const float* u, int64_t r, int64_t n0, int64_t cols) {
  const float* bias = a.bias ? a.bias + n0 : nullptr;
  c10::BFloat16* y = a.y + r * a.n_out + n0;
  float v[kWidth];
#pragma omp simd
  for (int64_t j = 0; j < cols; ++j) v[j] = g[j] + (bias ? bias[j] : 0.f);
  if (a.swiglu) {
    const float* bu = a.bias ? a.bias + a.n_out + n0 : nullptr;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) v[j] = silu(v[j]) * (u[j] + (bu ? bu[j] : 0.f));
  } else if (a.other) {
    const c10::BFloat16* o = a.other + r * a.n_out + n0;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) v[j] += static_cast<float>(o[j]);
  }
#pragma omp simd
  for (int64_t j = 0; j < cols; ++j) y[j] = static_cast<c10::BFloat16>(v[j]);
}

void panels_range(const Args& a, int64_t p0, int64_t p1) {
#if defined(CELLSERVE_AMX)
  configure(a.rows);
  float g[kMaxRows * kWidth], u[kMaxRows * kWidth];
  for (int64_t p = p0; p < p1; ++p) {
    panel_sums(a.x, a.x_stride, a.ws[0] + p * a.panel_elems, a.k_pad, g);
    if (a.swiglu) panel_sums(a.x, a.x_stride, a.ws[1] + p * a.panel_elems, a.k_pad, u);
    const int64_t n0 = p * kWidth, cols = std::min(a.n_out, n0 + kWidth) - n0;
    for (int64_t r = 0; r < a.rows; ++r) epilogue(a, g + r * kWidth, u + r * kWidth, r, n0, cols);
  }
  _tile_release();
#else
  (void)a, (void)p0, (void)p1;
  TORCH_CHECK(false, "amx_linear: this build has no AMX (check amx_linear_fast() first)");
#endif
}

bool amx_linear_fast() {
#if defined(CELLSERVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// panels: [P, Kp / 2 * 64] bfloat16 (the packed bytes viewed as such), one tensor (or [gate, up] for swiglu);
// n_out: the weight's true row count (the last panel may be padding).
at::Tensor amx_linear(const at::Tensor& x, at::TensorList panels, int64_t n_out, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& other, c10::string_view op_view) {
  const std::string op(op_view);
  TORCH_CHECK(amx_linear_fast(), "amx_linear: AMX is not available here (check amx_linear_fast() first)");
  TORCH_CHECK(op == "none" || op == "add" || op == "swiglu", "amx_linear: op must be none, add or swiglu, got ", op);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "amx_linear: x must be a bfloat16 [rows, K] tensor with 1 to ", kMaxRows, " rows");
  const bool swiglu = op == "swiglu";
  TORCH_CHECK(panels.size() == (swiglu ? 2u : 1u), "amx_linear: one packed weight (swiglu: [gate, up])");
  const int64_t K = x.size(1), k_pad = (K + kStep - 1) / kStep * kStep;
  for (const auto& p : panels) {
    TORCH_CHECK(p.dim() == 2 && p.is_contiguous() && p.scalar_type() == at::kBFloat16 &&
                    p.size(0) == (n_out + kWidth - 1) / kWidth && p.size(1) == k_pad * kWidth,
                "amx_linear: a packed weight must be bfloat16 [ceil(N/32), ", k_pad * kWidth, "]");
  }
  // the A tile reads whole 32-input steps: rows padded with zeros to Kp (the panels' padding is zeros too)
  at::Tensor xs = K == k_pad ? x.contiguous() : at::constant_pad_nd(x, {0, k_pad - K}, 0).contiguous();
  at::Tensor b, o;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.numel() == n_out * (swiglu ? 2 : 1), "amx_linear: bias: one value per row");
  }
  if (op == "add") {
    TORCH_CHECK(other.has_value(), "amx_linear: op add needs `other`");
    o = other->contiguous();
    TORCH_CHECK(o.scalar_type() == at::kBFloat16 && o.dim() == 2 && o.size(0) == x.size(0) && o.size(1) == n_out,
                "amx_linear: `other` must be bfloat16 [rows, N]");
  }
  auto y = at::empty({x.size(0), n_out}, x.options());
  Args a{xs.data_ptr<c10::BFloat16>(), k_pad, k_pad, x.size(0), n_out, panels[0].stride(0), {},
         b.defined() ? b.data_ptr<float>() : nullptr, o.defined() ? o.data_ptr<c10::BFloat16>() : nullptr,
         y.data_ptr<c10::BFloat16>(), swiglu};
  for (const auto& p : panels) a.ws.push_back(p.data_ptr<c10::BFloat16>());
  at::parallel_for(0, panels[0].size(0), 1, [&](int64_t p0, int64_t p1) { panels_range(a, p0, p1); });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cellserve, m) {
  m.def("amx_linear(Tensor x, Tensor[] panels, int n_out, Tensor? bias, Tensor? other, str op) -> Tensor");
  m.def("amx_linear_fast() -> bool", &amx_linear_fast);
}

TORCH_LIBRARY_IMPL(cellserve, CPU, m) {
  m.impl("amx_linear", &amx_linear);
}
