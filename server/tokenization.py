"""The tokenizer layer between HTTP and the engine: text and chat messages <-> token ids.

Guarantees:
- Encoding, chat templating and whole-text decoding run in a worker thread (`asyncio.to_thread`),
  never on the event loop and never on the engine's loop thread, so a long prompt cannot stall
  other streams.
- A prompt never reaches the engine empty: an empty text becomes `[bos]` when the model has a BOS
  token, otherwise it is a 400 that says so.
- Per-token strings (for logprobs) come from a bounded cache, so formatting top-k logprobs does not
  re-run the tokenizer for tokens it has already seen.
"""

import asyncio
from collections.abc import Sequence
from typing import Any

from server.errors import APIError

TOKEN_STR_CACHE = 1 << 16


class TokenizerService:
    """Wraps a Hugging Face tokenizer (only `encode`, `decode`, `apply_chat_template` are used)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._token_strs: dict[int, str] = {}

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    async def encode(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        ids = await asyncio.to_thread(self.tok.encode, text, add_special_tokens=add_special_tokens)
        return self._non_empty(list(ids), param)

    async def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions with a "
                           "plain prompt instead", param="messages")
        try:
            out = await asyncio.to_thread(
                self.tok.apply_chat_template, list(messages), add_generation_prompt=add_generation_prompt,
                tokenize=True, return_dict=False,
            )
        except Exception as exc:  # jinja errors: template rejects the roles/order given
            raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        if ids and isinstance(ids[0], list):  # some tokenizers return a batch of one
            ids = ids[0]
        return self._non_empty([int(t) for t in ids], "messages")

    async def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return await asyncio.to_thread(self.tok.decode, list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """The text of one token (may be a partial character for byte-level vocabularies)."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tok.decode([token_id])
            if len(self._token_strs) < TOKEN_STR_CACHE:
                self._token_strs[token_id] = s
        return s

    def _non_empty(self, ids: list[int], param: str) -> list[int]:
        if ids:
            return ids
        bos = getattr(self.tok, "bos_token_id", None)
        if bos is not None:
            return [bos]
        raise APIError(400, f"{param} is empty after tokenization and the model has no BOS token to start "
                       "from; send some text", param=param)
