"""The multi-turn chat workload: conversations resent in full through /v1/chat/completions.

One conversation (one job) has `turns` turns. Turn k sends the whole history so far (an optional
system prompt, every earlier user message and, as an assistant message, the answer the server
streamed for it) plus a new user message of about `input_len` words, and waits for the answer
before the next turn: closed loop within a conversation, `--concurrency` conversations at once.
Each turn gives one record (kind "turn", `group` = conversation, `turn` = 1..turns); a failed turn
ends its conversation (later turns would resend a broken history).

The per-turn statistics (`turn_stats`, printed by report.py) give the TTFT of turn 1, 2, ... with the prompt tokens the server
reported and, where it reports `usage.prompt_tokens_details.cached_tokens`, how many came from its
prefix cache: with prefix sharing a later turn prefills only its new messages, so its TTFT should
not grow with the history.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass

import httpx

from server.bench.client import RequestOptions, stream_request
from server.bench.metrics import Dist, distribution
from server.bench.records import RequestRecord
from server.bench.workloads import check_lens, random_text, sample_in_out


@dataclass
class Conversation:
    """One conversation's plan: the user messages of each turn and each turn's max_tokens."""

    system: str | None
    users: list[str]
    max_tokens: list[int]


@dataclass
class MultiTurnWorkload:
    """Conversations of `turns` turns; each turn adds a user message of about `input_len` words and asks
    for about `output_len` tokens; `system_len` > 0 starts each conversation with its own system prompt."""

    turns: int = 6
    input_len: int = 64
    output_len: int = 128
    system_len: int = 0
    range_ratio: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError(f"--turns must be >= 1, got {self.turns}")
        if self.system_len < 0:
            raise ValueError(f"--system-len must be >= 0, got {self.system_len}")
        check_lens(self, "input_len", "output_len")

    def conversation(self, index: int) -> Conversation:
        rng = random.Random(f"{self.seed}:conversation:{index}")
        system = f"System {index}: " + random_text(rng, self.system_len) if self.system_len else None
        users, budgets = [], []
        for _ in range(self.turns):
            n_in, n_out = sample_in_out(rng, self)
            users.append(random_text(rng, n_in))
            budgets.append(n_out)
        return Conversation(system=system, users=users, max_tokens=budgets)


def chat_body(opts: RequestOptions, messages: list[dict], max_tokens: int) -> dict:
    """The /v1/chat/completions body of one turn (a copy of `messages`, so later turns don't alias it)."""
    body = {"model": opts.model, "messages": [dict(m) for m in messages]}
    body.update(opts.sampling(max_tokens))
    return body


async def run_conversation(
    client: httpx.AsyncClient, base: str, plan: Conversation, index: int, t_level: float, opts: RequestOptions
) -> list[RequestRecord]:
    """Run one conversation turn after turn; returns one record per turn sent."""
    messages: list[dict] = [{"role": "system", "content": plan.system}] if plan.system else []
    history_words = len(plan.system.split()) if plan.system else 0
    records: list[RequestRecord] = []
    for turn, (user, max_tokens) in enumerate(zip(plan.users, plan.max_tokens), start=1):
        messages.append({"role": "user", "content": user})
        history_words += len(user.split())
        rec = RequestRecord(index=index, kind="turn", group=index, turn=turn, max_tokens=max_tokens,
                            prompt_words=history_words, sent_at=time.perf_counter() - t_level)
        answer: list[str] = []
        await stream_request(client, base + "/v1/chat/completions", chat_body(opts, messages, max_tokens),
                             rec, opts.headers(), text_sink=answer)
        records.append(rec)
        if not rec.ok:
            break
        text = "".join(answer)
        messages.append({"role": "assistant", "content": text})
        history_words += len(text.split())
    return records


@dataclass
class TurnStats:
    """One turn number's results over every conversation of a level."""

    turn: int
    count: int
    prompt_tokens: float | None
    cached_tokens: float | None
    ttft: Dist


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def turn_stats(records: list[RequestRecord]) -> list[TurnStats]:
    """Per turn number (successful turns only): mean prompt and cached tokens, and the TTFT distribution."""
    by_turn: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.turn is not None and r.ok:
            by_turn.setdefault(r.turn, []).append(r)
    return [
        TurnStats(turn=t, count=len(rs),
                  prompt_tokens=_mean([r.prompt_tokens for r in rs if r.prompt_tokens is not None]),
                  cached_tokens=_mean([r.cached_tokens for r in rs if r.cached_tokens is not None]),
                  ttft=distribution([r.ttft for r in rs if r.ttft is not None]))
        for t, rs in sorted(by_turn.items())
    ]


def turns_json(records: list[RequestRecord]) -> list[dict]:
    """`turn_stats` as JSON-ready dicts."""
    return [asdict(s) for s in turn_stats(records)]
