"""The regenerate-after-fork workload (`--workload regen`) over cellserve's stateful sequences API.

What a chat page's *regenerate* does: one job creates a sequence from a chat message (POST /v1/sequences
{messages}: the prompt, rendered with the chat template up to the assistant's turn; its `length` is where
the reply starts), lets it answer (an "answer" record), forks it where that answer began (POST
/v1/sequences/{id}/fork {"at": length}) and generates the reply again on the fork (a "regen" record, with
the fork call's latency). With speculative decoding the fork's parent, whose old answer follows the fork
point, is a draft source: a greedy regenerate repeats the old answer, so it is drafted nearly whole.
Both sequences are DELETEd at the end (failures counted in the answer record's `cleanup_failures`).

The level's throughput counts both replies; the regenerate's own speed is its records' tokens over their
latency (`regen_rate`). Servers without the sequences API are reported as skipped (`probe_sequences`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import httpx

from server.bench.client import RequestOptions, stream_request
from server.bench.copying import _word
from server.bench.forktree import _completion_body, _delete, _post_for_id
from server.bench.records import RequestRecord
from server.bench.workloads import check_lens

_QUESTIONS = (
    "Write a short story about a {a} who finds a {b} near the {c}.",
    "Explain to a child why the {a} and the {b} never meet at the {c}.",
    "Describe a day in the life of a {a} who keeps a {b} in a {c}.",
)


@dataclass
class RegenWorkload:
    """Chat questions (about `input_len` words with the filler sentence repeated) answered, then regenerated
    on a fork at the answer's start; `output_len` is each reply's max_tokens."""

    input_len: int = 16
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_lens(self, "input_len", "output_len")

    def question(self, index: int) -> str:
        rng = random.Random(f"{self.seed}:regen:{index}")
        text = rng.choice(_QUESTIONS).format(a=_word(rng), b=_word(rng), c=_word(rng))
        while len(text.split()) < self.input_len:  # longer prompts: context the answer may use
            text += f" The {_word(rng)} is {_word(rng)}."
        return text


async def run_regen(client: httpx.AsyncClient, base: str, question: str, max_tokens: int, index: int,
                    t_level: float, opts: RequestOptions) -> list[RequestRecord]:
    """One answer and its regenerate; returns the answer's record and, when it got that far, the regenerate's."""
    answer = RequestRecord(index=index, kind="answer", group=index, max_tokens=max_tokens,
                           prompt_words=len(question.split()), sent_at=time.perf_counter() - t_level)
    t0 = time.perf_counter()
    try:
        resp = await client.post(f"{base}/v1/sequences", headers=opts.headers(),
                                 json={"messages": [{"role": "user", "content": question}]})
    except httpx.HTTPError as exc:
        return [answer.fail("transport", f"create failed: {type(exc).__name__}: {exc}")]
    if resp.status_code != 200 or "id" not in resp.json():
        answer.latency = time.perf_counter() - t0
        return [answer.fail(str(resp.status_code), f"create failed: {resp.text[:200]}", resp.status_code)]
    parent, at = str(resp.json()["id"]), int(resp.json()["length"])
    body = _completion_body(opts, None, max_tokens)
    await stream_request(client, f"{base}/v1/sequences/{parent}/completions", body, answer, opts.headers())
    records, child = [answer], None
    if answer.ok:
        regen = RequestRecord(index=index, kind="regen", group=index, max_tokens=max_tokens,
                              prompt_words=answer.prompt_words, sent_at=time.perf_counter() - t_level)
        child, status, msg, took = await _post_for_id(client, f"{base}/v1/sequences/{parent}/fork", {"at": at}, opts)
        regen.fork_latency = took if child else None
        if child is None:
            regen.fail(str(status) if status else "transport", f"fork failed: {msg}", status)
        else:
            await stream_request(client, f"{base}/v1/sequences/{child}/completions", body, regen, opts.headers())
        records.append(regen)
    failures = 0 if child is None or await _delete(client, base, child, opts) else 1
    answer.cleanup_failures = failures + (0 if await _delete(client, base, parent, opts) else 1)
    return records


def regen_rate(records: list[RequestRecord]) -> float | None:
    """The regenerates' tokens per second of their own latency (None without a successful one)."""
    done = [r for r in records if r.kind == "regen" and r.ok and r.latency]
    return sum(r.output_tokens for r in done) / sum(r.latency for r in done) if done else None
