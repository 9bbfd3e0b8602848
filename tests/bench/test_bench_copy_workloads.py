"""The `summarise` and `regen` workloads of `cellserve bench serve` (issue 29) against a real cellserve server
(the tiny float32 model): prompts, records, what the server generated, and that drafts change no output."""

from __future__ import annotations

import json

import httpx
from http_support import LiveServer

from server.bench.copying import CopyWorkload
from server.bench.records import RequestRecord
from server.bench.regen import RegenWorkload, regen_rate
from server.bench.serve import main


def _records(path) -> list[RequestRecord]:
    (level,) = json.loads(path.read_text())["levels"]
    return [RequestRecord.from_dict(r) for r in level["records"]]


def _bench(srv: LiveServer, out, *argv: str) -> list[RequestRecord]:
    assert main(["--url", srv.url, "--endpoint", "chat", "--concurrency", "1", "--no-progress", "--temperature", "0",
                 "--ignore-eos", "--out", str(out), *argv]) == 0
    return _records(out)


def _spec_tokens(srv: LiveServer) -> tuple[float, float]:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    values = {line.split()[0].split(":")[-1]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("cellserve:spec_decode_num_")}
    return values["spec_decode_num_draft_tokens_total"], values["spec_decode_num_accepted_tokens_total"]


def test_summarise_and_regen_prompts_are_deterministic_and_shaped():
    a = [CopyWorkload(kind="summarise", input_len=60, output_len=50, seed=3).prompt(i) for i in range(4)]
    assert a == [CopyWorkload(kind="summarise", input_len=60, output_len=50, seed=3).prompt(i) for i in range(4)]
    assert len({p.user for p in a}) == 4 and all(p.max_tokens == 50 for p in a)
    instruction, text = a[0].user.split("\n\n", 1)
    assert instruction.startswith("Summarise") and "word for word" in instruction and len(text.split()) >= 60
    regen = RegenWorkload(input_len=30, output_len=20, seed=1)
    questions = [regen.question(i) for i in range(4)]
    assert questions == [RegenWorkload(input_len=30, output_len=20, seed=1).question(i) for i in range(4)]
    assert len(set(questions)) == 4 and all(len(q.split()) >= 30 for q in questions)
    assert regen_rate([]) is None


def test_regen_forks_at_the_answer_and_regenerates_it_with_the_parent_as_draft(model_dir, tmp_path):
    """Each job: a sequence answers (an "answer" record), a fork at the answer's start regenerates it (a
    "regen" record): greedy, the same text, and with drafts on most of it drafted from the parent's answer."""
    digests = {}
    for spec in ("off", "auto"):
        with LiveServer(model_dir, speculative=spec) as srv:
            recs = _bench(srv, tmp_path / f"{spec}.json", "--workload", "regen", "--num-requests", "3",
                          "--input-len", "12", "--output-len", "24")
            drafted, accepted = _spec_tokens(srv)
            assert httpx.get(f"{srv.url}/v1/sequences", timeout=10).json()["data"] == []  # all deleted
        assert [(r.index, r.kind) for r in recs if r.kind == "answer"] == [(i, "answer") for i in range(3)]
        assert sorted(r.index for r in recs if r.kind == "regen") == [0, 1, 2]
        assert all(r.ok and r.output_tokens == 24 and r.cleanup_failures == 0 for r in recs)
        by = {(r.index, r.kind): r for r in recs}
        for i in range(3):  # the regenerate repeats the answer: the fork started where the answer began
            answer, regen = by[i, "answer"], by[i, "regen"]
            assert regen.output_digest == answer.output_digest and regen.output_chars == answer.output_chars
            assert regen.fork_latency is not None and regen.prompt_tokens == answer.prompt_tokens
        digests[spec] = [r.output_digest for r in recs]
        regens = [r for r in recs if r.kind == "regen"]
        if spec == "auto":  # the old answer drafts the regenerate: no draft token rejected, and at least every other
            # token drafted (a drafted tick adds one token after its draft; how long the drafts are follows the step
            # costs this machine measured, engine/spec/costs.py, so the tick count is not fixed)
            assert all(r.rejected_draft_tokens == 0 and r.accepted_draft_tokens >= 11 for r in regens)
            assert accepted >= 3 * 11 and drafted > 0
        else:
            assert drafted == accepted == 0 and all(r.accepted_draft_tokens is None for r in regens)
    assert digests["auto"] == digests["off"]  # drafts change no output


def test_summarise_outputs_are_the_same_with_drafts_on_and_off(model_dir, tmp_path):
    got = {}
    for spec in ("off", "ngram"):
        with LiveServer(model_dir, speculative=spec) as srv:
            recs = _bench(srv, tmp_path / f"{spec}.json", "--workload", "summarise", "--num-requests", "3",
                          "--input-len", "40", "--output-len", "32")
            drafted, _ = _spec_tokens(srv)
        assert all(r.ok and r.output_tokens == 32 and r.prompt_tokens > 40 for r in recs)
        assert (drafted > 0) == (spec == "ngram")
        got[spec] = sorted((r.index, r.output_digest) for r in recs)
    assert got["ngram"] == got["off"] and all(d for _, d in got["off"])
