"""llama.cpp's answer shapes for `/completion` and `/infill`: the final object (content, stop_type, tokens
counts, `timings`, `completion_probabilities`) and the streamed chunks (`{"content": ..., "stop": false}` per
step, then the final object with `"stop": true`; no `[DONE]`, as llama-server's native stream).

`Answer` accumulates one choice's engine outputs; it never touches the engine. `timings` and `prompt_progress`
are llama.cpp's (server.generation.telemetry): from the engine's instants and counts, the prompt's time from
its admission to its first token, the generation's from then on.
"""

from dataclasses import dataclass, field
from typing import Any

from engine.api.outputs import CompletionOutput, RequestOutput, TokenLogprob
from server.generation.telemetry import Telemetry


@dataclass
class Answer:
    model: str
    prompt_text: str
    prompt_len: int
    id_slot: int
    n_probs: int
    return_tokens: bool
    settings: dict[str, Any]
    telemetry: Telemetry
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    probs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None

    def note(self, out: RequestOutput, token_str) -> list[dict]:
        """Take one engine output; the stream chunks it makes (a `prompt_progress` one, then one with the new
        text; none when it carries nothing new)."""
        progress = self.telemetry.note(out)
        chunks = []
        if progress is not None:
            chunks.append(self.telemetry.stamp({**self._chunk([]), "prompt_progress": progress}))
        for co in out.outputs:
            chunk = self._apply(co, token_str)
            if chunk is not None:
                chunks.append(self.telemetry.stamp(chunk))
        return chunks

    @property
    def cached(self) -> int:
        return self.telemetry.cached

    def _chunk(self, tokens: list[int]) -> dict:
        return {"index": 0, "content": "", "tokens": tokens if self.return_tokens else [], "stop": False,
                "id_slot": self.id_slot, "tokens_predicted": len(self.token_ids), "tokens_evaluated": self.prompt_len}

    def _apply(self, co: CompletionOutput, token_str) -> dict | None:
        self.text += co.text
        self.token_ids += co.token_ids
        new_probs = [probability(lp, token_str) for lp in co.logprobs or []] if self.n_probs else []
        self.probs += new_probs
        if co.finish_reason:
            self.finish_reason, self.stop_reason, self.error = co.finish_reason, co.stop_reason, co.error
        if not (co.text or co.token_ids):
            return None
        chunk = {**self._chunk(list(co.token_ids)), "content": co.text}
        if self.n_probs:
            chunk["completion_probabilities"] = new_probs
        return chunk

    def stop_type(self) -> str:
        if self.finish_reason == "length":
            return "limit"
        if self.finish_reason == "stop":
            return "word" if isinstance(self.stop_reason, str) else "eos"
        return "none"

    def final(self, *, streamed: bool = False) -> dict:
        """The whole answer (`streamed`: the stream's last event, whose `content` is empty: the text came in
        the chunks)."""
        out = {"index": 0, "content": "" if streamed else self.text,
               "tokens": [] if streamed or not self.return_tokens else list(self.token_ids),
               "id_slot": self.id_slot, "stop": True, "model": self.model,
               "tokens_predicted": len(self.token_ids), "tokens_evaluated": self.prompt_len,
               "generation_settings": self.settings, "prompt": self.prompt_text,
               "has_new_line": "\n" in self.text, "truncated": False, "stop_type": self.stop_type(),
               "stopping_word": self.stop_reason if isinstance(self.stop_reason, str) else "",
               "tokens_cached": self.cached, "timings": self.timings()}
        if self.n_probs and not streamed:
            out["completion_probabilities"] = self.probs
        return out

    def timings(self) -> dict:
        return self.telemetry.timings()


def probability(lp: TokenLogprob, token_str) -> dict:
    """One generated token in llama.cpp's `completion_probabilities` form (logprobs, with the top-n)."""
    return {**_token(lp.token_id, lp.logprob, token_str),
            "top_logprobs": [_token(t, v, token_str) for t, v in lp.top]}


def _token(token_id: int, logprob: float, token_str) -> dict:
    text = token_str(token_id)
    return {"id": token_id, "token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}
