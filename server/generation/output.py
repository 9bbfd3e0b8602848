"""One choice's output accumulated from its engine outputs: what `/v1/responses` and `/v1/messages` build
their answers from (their replies are one choice, split whole or streamed by `server.generation.reply`)."""

from dataclasses import dataclass, field

from engine.api.outputs import RequestOutput


@dataclass
class Output:
    """One choice's output so far (choice 0: these APIs generate one answer per request)."""

    text: str = ""
    n_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine found in the prefix cache
    finish_reason: str | None = None  # stop | length | cancelled | error
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    last_token: int | None = None
    pieces: list[tuple[str, int]] = field(default_factory=list)  # (text, tokens) of each output, in order

    def add(self, out: RequestOutput) -> str:
        """Fold in one engine output; returns the new text."""
        self.cached_tokens = out.cached_tokens
        new, n = "", 0
        for co in out.outputs:
            new += co.text
            n += len(co.token_ids)
            if co.token_ids:
                self.last_token = co.token_ids[-1]
            if co.finish_reason:
                self.finish_reason, self.stop_reason, self.error = co.finish_reason, co.stop_reason, co.error
        self.text += new
        self.n_tokens += n
        self.pieces.append((new, n))
        return new

    def fold(self, k: int, out: RequestOutput) -> None:
        """`add` as `server.generation.driver.collect` calls it (one prompt: `k` is 0)."""
        self.add(out)

    @property
    def last_tokens(self) -> int:
        """Tokens of the output `add` folded in last."""
        return self.pieces[-1][1] if self.pieces else 0

    @property
    def ended_on_stop_token(self) -> bool:
        """The last token is a stop token (EOS, a stop token id, or the EOS a complete grammar took),
        which stays in a sequence's history; a stop *string* is cut from the text and is not one."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str) and self.last_token is not None
