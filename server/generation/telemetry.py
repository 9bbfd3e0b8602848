"""llama-server's per-request telemetry, from the engine's own outputs: `timings` (prompt and generation counts,
times and rates) and `prompt_progress` (`total`, `cache`, `processed`, `time_ms`) while the prompt prefills.

A request asks with llama.cpp's fields (`TelemetryFields`): `timings_per_token` puts `timings` in every streamed
chunk (the final answer always has them on llama.cpp's own routes); `return_progress`, on a stream, makes the
engine send an output at admission and after each prompt chunk it prefills (`SamplingParams.report_progress`),
each carrying `engine.api.outputs.PromptProgress`, which becomes one `prompt_progress` event. Nothing here is
estimated: counts are the engine's (cached tokens at admission, tokens with cells after each chunk) and times
are the engine's instants (`Timing.prompt_started`, each chunk's `PromptProgress.at`, `Timing.first_token`).

`Telemetry` guarantees llama.cpp's arithmetic (tools/server/server-common.h, `server_slot_stats`):
- `prompt_n` counts the prompt tokens prefilled (not those the cache held, `cache_n`), `prompt_ms` runs from the
  request's admission to its last prefilled chunk (to its first token once it has one): 0 before any chunk ran;
- `predicted_ms` runs from the first token to the latest, and the generation rate is over `predicted_n - 1`
  steps: the first token comes from the prompt's last chunk and costs no decode step;
- every value is a finite number >= 0 (a rate with a zero divisor is 0), and times never go backwards.
"""

import time

from engine.api.outputs import RequestOutput
from server.schema import StrictModel


class TelemetryFields(StrictModel):
    """llama.cpp's telemetry switches, on every route where llama-server takes them."""

    timings_per_token: bool = False  # `timings` in each streamed chunk
    return_progress: bool = False  # stream `prompt_progress` while the prompt is prefilled
    verbose: bool = False  # `__verbose` in a JSON answer: the prompt as text, llama.cpp's counts (`verbose_of`)

    def wants_progress(self) -> bool:
        """Progress is streamed only (llama-server: `stream && return_progress`)."""
        return self.return_progress and bool(getattr(self, "stream", False))

    def wants_telemetry(self) -> bool:
        return self.timings_per_token or self.wants_progress()


class Telemetry:
    """One engine request's llama.cpp telemetry. `kept`: prompt tokens already in place before the engine saw
    the request (a llama.cpp slot's kept prefix), counted as cached; `prompt_len` includes them."""

    def __init__(self, prompt_len: int, *, per_token: bool = False, kept: int = 0):
        self.prompt_len, self.per_token, self.kept = prompt_len, per_token, kept
        self.cached = kept
        self.processed = kept
        self.started: float | None = None
        self.prompt_last: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.n_gen = 0

    def note(self, out: RequestOutput) -> dict | None:
        """Fold in one engine output; its `prompt_progress` event (None when it carries none)."""
        tm, now = out.timing, time.monotonic()
        self.started = self.started or tm.prompt_started
        self.cached = self.kept + out.cached_tokens
        self.processed = max(self.processed, self.cached)
        n = sum(len(c.token_ids) for c in out.outputs[:1])  # choice 0 (llama.cpp's requests have one)
        if n:
            self.first_token = self.first_token or tm.first_token or now
            self.prompt_last = self.first_token
            self.processed = self.prompt_len
            self.n_gen += n
            # the latest token's instant: the finish, else its arrival (the first token: its own instant)
            self.last_token = max(tm.finished or (now if self.n_gen > n else self.first_token), self.first_token)
        p = out.prompt_progress
        if p is None:
            return None
        self.started = self.started or p.at
        self.processed = max(self.processed, self.kept + p.processed)
        if p.processed > p.cached and self.first_token is None:  # a chunk ran (not the admission's report)
            self.prompt_last = max(p.at, self.prompt_last or p.at)
        return {"total": self.prompt_len, "cache": self.cached, "processed": self.processed,
                "time_ms": int(max(p.at - self.started, 0.0) * 1e3)}

    def timings(self) -> dict:
        """llama.cpp's `timings` object as of now."""
        prompt_n = max(self.processed - self.cached, 0)
        prompt_ms = (self.prompt_last - self.started) * 1e3 if self.prompt_last and self.started else 0.0
        prompt_ms = max(prompt_ms, 0.0)
        steps = max(self.n_gen - 1, 0)
        gen_ms = max((self.last_token - self.first_token) * 1e3, 1e-3) if self.n_gen and self.first_token else 0.0
        return {"cache_n": self.cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
                "predicted_n": self.n_gen, "predicted_ms": gen_ms,
                "predicted_per_token_ms": gen_ms / steps if steps else 0.0,
                "predicted_per_second": 1e3 / gen_ms * steps if gen_ms > 0 else 0.0}

    def stamp(self, payload: dict, *, final: bool = False) -> dict:
        """`payload` with `timings` added when every chunk carries them (`timings_per_token`) or it is the last."""
        if self.per_token or final:
            payload["timings"] = self.timings()
        return payload


def verbose_of(prompt_text: str, content: str, prompt_len: int, n_tokens: int, cached: int) -> dict:
    """llama-server's `__verbose` debugging object of a JSON answer (its native fields, so a client sees what
    the model was given): the prompt as text, the generated text and the token counts."""
    return {"prompt": prompt_text, "content": content, "stop": True, "tokens_evaluated": prompt_len,
            "tokens_predicted": n_tokens, "tokens_cached": cached}
