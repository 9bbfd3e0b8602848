"""`cellserve bench compare`: ratios against the first server, and the chart file."""

import json

from server.bench import compare


def _result(path, name, tok_s):
    levels = [{"level": {"mode": "closed", "concurrency": c, "request_rate": None, "label": f"concurrency={c}"},
               "summary": {"output_throughput": t, "ttft": {"p50": 10.0 * c, "p99": 20.0 * c}}}
              for c, t in tok_s.items()]
    path.write_text(json.dumps({"config": {"model": name}, "levels": levels}))
    return str(path)


def test_compare_tabulates_ratios_and_plots(tmp_path, capsys):
    a = _result(tmp_path / "a.json", "cellserve", {1: 40.0, 8: 200.0})
    b = _result(tmp_path / "b.json", "other", {1: 20.0, 8: 50.0})
    png = tmp_path / "cmp.png"
    assert compare.main([a, b, "--plot", str(png)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:5]]
    assert rows[0][:4] == ["cellserve", "concurrency=1", "40.0", "1.00"]
    assert rows[3][:4] == ["other", "concurrency=8", "50.0", "0.25"]
    assert rows[3][4:6] == ["80.0", "160.0"]
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
