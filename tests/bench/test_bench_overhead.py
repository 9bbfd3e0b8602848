"""`cellserve bench overhead` end to end on a tiny model: it runs the offline engine, a real
`cellserve serve` process and the load generator, prints each pair's ratio and writes the JSON."""

import json

from server.bench.overhead import main


def test_overhead_runs_pairs_and_reports_the_median_ratio(model_dir, tmp_path, capsys):
    out = tmp_path / "overhead.json"
    work = tmp_path / "work"
    status = main(["--model", model_dir, "--dtype", "float32", "--threads", "1", "--concurrency", "2",
                   "--requests", "4", "--prompt-len", "8", "--output-len", "6", "--pairs", "1",
                   "--work-dir", str(work), "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0
    result = json.loads(out.read_text())
    (pair,) = result["pairs"]
    assert pair["offline_tok_s"] > 0 and pair["server_tok_s"] > 0
    assert abs(pair["ratio"] - pair["server_tok_s"] / pair["offline_tok_s"]) < 1e-9
    assert result["median_ratio"] == pair["ratio"]
    assert "median server/offline" in printed and "command: cellserve bench overhead" in printed
    offline_rows = json.loads((work / "offline_0.json").read_text())["rows"]
    assert any(r["system"].startswith("cellserve") and r["generated_tokens"] == 4 * 6 for r in offline_rows)
    served = json.loads((work / "server_0.json").read_text())["levels"][0]["summary"]
    assert served["completed"] == 4 and served["total_output_tokens"] == 4 * 6
