"""`python -m server.bench.spec_rounds report`: auto / off ratios within a round, drafts kept, same text."""

import json

from server.bench.spec_report import report, rows
from server.bench.spec_rounds import main


def _level(mode, rnd, tok_s, digests, drafted=0, accepted=0, workload="quote", clients=1):
    return {"label": "bf16", "workload": workload, "clients": clients, "mode": mode, "round": rnd, "tok_s": tok_s,
            "tokens": 100, "server_cpu_s": 100 / tok_s, "drafted": drafted, "accepted": accepted,
            "digests": digests}


def test_report_pairs_rounds_and_compares_texts(tmp_path):
    same, other = {"0:completion": "a", "1:completion": "b"}, {"0:completion": "a", "1:completion": "c"}
    levels = [_level("auto", 1, 100.0, same, 50, 40), _level("off", 1, 50.0, same),
              _level("off", 2, 40.0, same), _level("auto", 2, 60.0, other, 50, 30),
              _level("llama-ngram", 1, 70.0, same), _level("llama-none", 1, 45.0, same),
              _level("auto", 1, 9.0, {"0:answer": "x", "0:regen": "y"}, 10, 10, workload="regen"),
              _level("off", 1, 3.0, {"0:answer": "z", "0:regen": "y"}, workload="regen")]
    (tmp_path / "levels.jsonl").write_text("".join(json.dumps(lv) + "\n" for lv in levels))
    quote, regen = rows([json.loads(line) for line in (tmp_path / "levels.jsonl").read_text().splitlines()])
    assert quote["ratio"] == [2.0, 1.5] and quote["cpu_ratio"] == [2.0, 1.5]
    assert quote["kept"] == 0.7 and quote["same"] == "3/4"
    assert quote["llama-ngram"] == [70.0] and quote["llama-none"] == [45.0]
    assert regen["ratio"] == [3.0] and regen["same"] == "1/1"  # the untimed first answer is not compared
    chart = tmp_path / "chart.png"
    assert main(["report", str(tmp_path), "--plot", str(chart)]) == 0
    text = (tmp_path / "table.md").read_text()
    assert "| bf16 | quote | 1 | 50.0, 40.0 | 100.0, 60.0 | **1.50-2.00** |" in text and "45.0 / 70.0" in text
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report(tmp_path) == text.rstrip("\n")
