"""Row invariance: how many rows a step may hold while each row is computed exactly as it would be alone.

Up to `INVARIANT_ROWS` rows, every kernel of the native forward (the linears, the quantized linears and the
fused cell attention) does the same float operations, in the same order, for a row whatever the other rows
of its call are: rows are grouped for speed, never summed across, and a row's attention reads its cells in
position order (not in the pool's order) with sums that do not depend on how wide the step's gather is.

Why: a speculative verification step runs a sequence's drafted tokens as extra rows; if those rows rounded
differently from the one-row decode step, greedy output would drift from the output without speculation
(bf16 and the quantized kernels round visibly). With this, greedy output with and without drafts is token
for token the same, and so is one sequence's output whether it decodes alone or beside others, as long as
the step stays within the limit. Larger steps (prefill, many sequences) take the faster many-row kernels,
and so do steps without drafts where the row-invariant kernel is the slower one (`drafted_step`).

Where it holds (the native forward with its fused kernels, the default on CPU):
- bf16 on a CPU with AMX: the linears run on `amx_linear` up to the limit (bitwise oneDNN's AMX result for the
  row at any row count), attention on the fused cell kernel;
- quantized weights (a GGUF's blocks, `--quantize`): q8_0 / q4_0 / q4_1 on `quant_tiles` at every row count
  (engine/model/native/quant_tiles.py: one kernel, no routing); the K-quants on the integer row kernel up to
  the limit (engine/model/native/quant.py); float32 activations, int8 or float cells;
- not in float32 (the one-row kernel and oneDNN's sum in different orders: ~1e-7 of a logit, greedy output
  matched in every run measured, but no guarantee), not in bf16 without AMX (the one-row kernel, then
  oneDNN), not on the transformers path.
Tests: tests/engine/model/test_row_invariance.py, test_linear.py (AMX), test_quant_rows_invariant.py,
test_kernels.py (attention rows sharing cells, each bitwise as alone).
"""

import contextlib
import threading

INVARIANT_ROWS = 16  # one sequence's 1 + 8 drafted rows, or a few sequences' decodes and drafts

_step = threading.local()


@contextlib.contextmanager
def drafted_step(drafts: bool):
    """Run this thread's forward as a step that carries drafted rows (`drafts`) or not. Kernels whose
    row-invariant form is slower than another at some row counts (the K-quants' row kernel against the GEMM
    past 8-12 rows; torch's elementwise ops row by row) take it only in steps with drafts: those are the steps
    whose rows must round as the one-row decode does; a plain batched decode takes the fastest kernel, as
    batching always did."""
    before = getattr(_step, "drafts", False)
    _step.drafts = drafts
    try:
        yield
    finally:
        _step.drafts = before


def must_match_alone(rows: int) -> bool:
    """Whether a call of `rows` rows, in the step now running, must compute each row as it would alone."""
    return rows <= INVARIANT_ROWS and getattr(_step, "drafts", False)
