"""`cellserve bench engine`'s closed loop on a tiny model: both forward paths, the prefill cap, and
the gap between a stream's tokens are reported (a smoke test of the measurement, not of speed)."""

from tiny_models import tiny_model

from engine.bench.common import prompts_for
from engine.bench.engine import print_table, run_cellserve


def test_closed_loop_reports_paths_and_gaps(capsys):
    model = tiny_model("llama_gqa")
    prompts = prompts_for(6, 8, vocab_size=101)
    native = run_cellserve(model, prompts, 6, "fast", 3, native=None, prefill_cap=4, range_ratio=0.5)
    modules = run_cellserve(model, prompts, 6, "fast", 3, native=False)
    assert native.system == "cellserve (fast, native, cap 4)" and modules.system == "cellserve (fast)"
    assert modules.generated_tokens == 6 * 6
    assert native.generated_tokens != 6 * 6  # output lengths drawn from [3, 9]
    for row in (native, modules):
        assert 0 < row.gap_p50_ms <= row.gap_p99_ms and row.gap_cpu_p99_ms > 0
        assert 0 <= row.outside_forward < 1  # the forward was timed: a share of the step, not none of it
    print_table([native, modules], modules)
    assert "gap p50/p99" in capsys.readouterr().out
