"""`python -m engine.bench.speculative --draft-model` end to end on the tiny model (its own draft): every mode
runs in the alternation, its row reports the same output as `off`, and the draft model's drafts are kept."""

from engine.bench import speculative


def test_the_speculative_bench_runs_off_ngram_and_a_draft_model(model_dir, capsys):
    assert speculative.main(["--model", model_dir, "--dtype", "float32", "--draft-model", model_dir,
                             "--clients", "1", "--max-tokens", "8", "--repeats", "1", "--threads", "1",
                             "--workloads", "free,regen"]) == 0
    out = capsys.readouterr().out
    assert "draft tok/s" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("free ", "regen "))]
    assert [r[0] for r in rows] == ["free", "regen"]
    for r in rows:  # workload clients off | auto: tok/s x cpu-x accepted same | draft: the same five
        assert r[7] == "yes" and r[12] == "yes", r
        assert r[11] in ("0%", "100%"), r  # the model drafting for itself: every draft kept, if it drafted
    assert any(r[11] == "100%" for r in rows), rows
