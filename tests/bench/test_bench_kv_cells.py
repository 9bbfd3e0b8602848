"""`python -m engine.bench.kv_cells` prints the machine, the cell sizes (int8's scales counted) and one
row per (sequences, context) with both KV dtypes' decode rates and their ratio."""

import re

from engine.bench import kv_cells


def test_kv_cells_bench_prints_cell_sizes_and_a_ratio_per_level(capsys):
    assert kv_cells.main(["--concurrency", "2", "--prompt-len", "8", "--output-len", "4", "--repeats", "1",
                          "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "machine:" in out and "command: python -m engine.bench.kv_cells" in out
    # the bench model: 8 layers x 4 kv heads x 64; float32 256 B a row of K or V, int8 64 + a 4-byte scale
    assert "16384 B, 65,536 cells per GiB" in out and "4352 B, 246,723 cells per GiB" in out
    row = next(line for line in out.splitlines() if re.match(r"\s+2\s+8\s", line))
    assert len(re.findall(r"\d+\.\d+", row)) >= 6  # float, int8 and their ratio, by wall and by CPU time
