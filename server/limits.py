"""Request limits checked at the edge, before any expensive work: one source for each limit.

Guarantees:
- A body larger than `max_body_bytes` is refused with 413 before it is read: at once when its
  `Content-Length` says so, else as soon as the bytes received pass the limit (chunked uploads), so a
  20 MB body never costs 20 MB of parsing, tokenization or memory (`server.middleware.BodySizeLimit`).
- A request head (request line and headers) over `max_header_bytes`, or one header line over
  `header_line_bytes` (an eighth of it), is refused with 431 before the app sees it; a URL over a
  line's limit with 414 (`server.http_edge.EdgeProtocol`, JSON bodies as everywhere).
- After any refusal that closes the connection while the client may still be sending (413, 431, ...)
  the server reads and drops up to `LINGER_MAX_BYTES` for at most `LINGER_S` (lingering close), so
  the client reads the answer instead of a connection reset.
- A request with more prompts than `max_prompts`, or more choices (prompts x n) than `max_choices`,
  is a 400 naming the field before anything is tokenized or submitted.
- Text that cannot fit the model's context whatever it tokenizes to is refused before tokenization
  (see `server.tokenization.TokenizerService`); the exact token check against the context and the
  pool comes after.
"""

from dataclasses import dataclass

from server.errors import APIError

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_MAX_HEADER_BYTES = 64 * 2**10  # request line + headers; a line may take an eighth (8 KiB, as nginx)
LINGER_S = 10.0  # lingering close: how long a refused client may go on sending (nginx: lingering_time)
LINGER_MAX_BYTES = 64 * 2**20  # ... and how many bytes of it are read and dropped
DEFAULT_MAX_PROMPTS = 256
DEFAULT_MAX_CHOICES = 1024
DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class Limits:
    """What one request may ask for. `cellserve serve --max-body-bytes/--max-header-bytes/--max-prompts/
    --max-choices`."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_choices: int = DEFAULT_MAX_CHOICES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    # /v1/responses with store: at most this many stored responses (each a prefix of a persistent
    # sequence); storing one more forgets the least recently used (server.responses.store)
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES

    @property
    def header_line_bytes(self) -> int:
        """The longest header line (name, value, ': ' and CRLF) or URL accepted."""
        return max(1, self.max_header_bytes // 8)

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
