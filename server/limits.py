"""Request limits checked at the edge, before any expensive work: one source for each limit.

Guarantees:
- A body larger than `max_body_bytes` is refused with 413 before it is read: at once when its
  `Content-Length` says so, else as soon as the bytes received pass the limit (chunked uploads), so a
  20 MB body never costs 20 MB of parsing, tokenization or memory (`server.middleware.BodySizeLimit`).
- A request with more prompts than `max_prompts`, or more choices (prompts x n) than `max_choices`,
  is a 400 naming the field before anything is tokenized or submitted.
- Text that cannot fit the model's context whatever it tokenizes to is refused before tokenization
  (see `server.tokenization.TokenizerService`); the exact token check against the context and the
  pool comes after.
"""

from dataclasses import dataclass

from server.errors import APIError

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_MAX_PROMPTS = 256
DEFAULT_MAX_CHOICES = 1024
DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class Limits:
    """What one request may ask for. `cellserve serve --max-body-bytes/--max-prompts/--max-choices`."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_choices: int = DEFAULT_MAX_CHOICES
    # /v1/responses with store: at most this many stored responses (each a prefix of a persistent
    # sequence); storing one more forgets the least recently used (server.responses.store)
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES

    def check_choices(self, n_prompts: int, n: int) -> None:
        if n_prompts > self.max_prompts:
            raise APIError(400, f"{n_prompts} prompts in one request; at most {self.max_prompts} are allowed "
                           "(--max-prompts): split the request", param="prompt", code="too_many_prompts")
        if n_prompts * n > self.max_choices:
            raise APIError(400, f"{n_prompts} prompts x n={n} = {n_prompts * n} choices in one request; at most "
                           f"{self.max_choices} are allowed (--max-choices): lower n or send fewer prompts",
                           param="n", code="too_many_choices")

    def body_too_large(self, size: int | None = None) -> str:
        got = f" ({size} bytes)" if size is not None else ""
        return (f"request body is too large{got}: at most {self.max_body_bytes} bytes are accepted "
                "(--max-body-bytes); send a shorter prompt")
