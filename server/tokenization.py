"""The tokenizer layer between HTTP and the engine: text and chat messages <-> token ids.

Guarantees:
- Encoding, chat templating and whole-text decoding run in a worker thread (`asyncio.to_thread`),
  never on the event loop and never on the engine's loop thread, so a long prompt cannot stall
  other streams.
- A prompt never reaches the engine empty: an empty text becomes `[bos]` when the model has a BOS
  token, otherwise it is a 400 that says so.
- Per-token strings (for logprobs) come from a bounded cache, so formatting top-k logprobs does not
  re-run the tokenizer for tokens it has already seen.
- Text that cannot fit the context whatever it tokenizes to (more non-whitespace characters than
  `max_model_len` x the longest vocabulary entry) is a 400 `context_length_exceeded` before any
  tokenization, so a huge prompt costs a count, not seconds of CPU and a tokenizer's memory.
  (Whitespace is not counted: some tokenizers drop it. A tokenizer that maps a long unknown word to
  one token could in principle fit such text; no prompt worth serving looks like that.)
"""

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any

from server.errors import APIError

log = logging.getLogger("cellserve.server")

TOKEN_STR_CACHE = 1 << 16


class TokenizerService:
    """Wraps a Hugging Face tokenizer (only `encode`, `decode`, `apply_chat_template` are used)."""

    def __init__(self, tokenizer: Any, max_model_len: int | None = None):
        self.tok = tokenizer
        self._token_strs: dict[int, str] = {}
        self.max_chars = None if max_model_len is None else max_model_len * _longest_token_chars(tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    async def prompt_ids(self, prompt: str | Sequence[int] | None, messages: Sequence[Any] | None = None, *,
                         add_generation_prompt: bool = True, add_special_tokens: bool = True,
                         empty_ok: bool = False, tools: list[dict] | None = None,
                         template_kwargs: dict | None = None) -> list[int]:
        """The one way a request's prompt becomes token ids: chat `messages` through the template, text
        through the tokenizer, token ids as given. `empty_ok`: an empty text stays empty (a sequence
        continuation with nothing to append, /tokenize of ""); otherwise it becomes `[bos]` (or a 400).
        `tools`: tool definitions for a chat template that renders them."""
        if messages is not None:
            dicts = [m.as_template_dict() for m in messages]
            return await self.encode_chat(dicts, add_generation_prompt=add_generation_prompt, tools=tools,
                                          template_kwargs=template_kwargs)
        if isinstance(prompt, str):
            if not prompt and empty_ok:
                return []
            return await self.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt or [])

    async def encode(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_length([text], param)
        try:
            ids = await asyncio.to_thread(self.tok.encode, text, add_special_tokens=add_special_tokens)
        except Exception as exc:  # a tokenizer bug met by this input: the request's 400, never the server's 500
            log.warning("the tokenizer raised on a %s of %d characters: %r", param, len(text), exc)
            raise APIError(400, f"the model's tokenizer could not encode this {param}: {exc}", param=param) from exc
        return self._non_empty(list(ids), param)

    async def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                          tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """`tools`: OpenAI tool definitions for templates that render them
        (`server.generation.tools.supports_tools`); `template_kwargs`: extra template variables
        (`chat_template_kwargs`, e.g. enable_thinking)."""
        if not self.has_chat_template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions with a "
                           "plain prompt instead", param="messages")
        self.check_length([m.get("content") or "" for m in messages] + [json.dumps(tools or "")], "messages")
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        for reserved in ("conversation", "tokenize", "return_dict", "add_generation_prompt", "messages"):
            extra.pop(reserved, None)
        try:
            out = await asyncio.to_thread(
                self.tok.apply_chat_template, list(messages), add_generation_prompt=add_generation_prompt,
                tokenize=True, return_dict=False, **extra,
            )
        except Exception as exc:  # jinja errors: template rejects the roles/order given
            raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        if ids and isinstance(ids[0], list):  # some tokenizers return a batch of one
            ids = ids[0]
        return self._non_empty([int(t) for t in ids], "messages")

    async def bad_words_ids(self, words: Sequence[str]) -> list[list[int]]:
        """vLLM's rule: each word as it tokenizes alone and after a space (both are banned)."""
        def run() -> list[list[int]]:
            out: list[list[int]] = []
            for word in words:
                for text in (word, " " + word.lstrip()):
                    ids = list(self.tok.encode(text, add_special_tokens=False))
                    if ids and ids not in out:
                        out.append(ids)
            return out
        return await asyncio.to_thread(run)

    def eos_ids(self) -> list[int]:
        eos = getattr(self.tok, "eos_token_id", None)
        return [eos] if isinstance(eos, int) else list(eos or [])

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

    def check_length(self, texts: Sequence[str], param: str) -> None:
        """400 `context_length_exceeded` if these texts cannot fit the context whatever their tokens."""
        if self.max_chars is None:
            return
        chars = sum(len(t) - sum(t.count(w) for w in _WHITESPACE) for t in texts)
        if chars > self.max_chars:
            raise APIError(400, f"{param} has {chars} non-whitespace characters, more than can fit the model's "
                           f"context (at most {self.max_chars}); shorten it", param=param,
                           code="context_length_exceeded")

    def _non_empty(self, ids: list[int], param: str) -> list[int]:
        if ids:
            return ids
        bos = getattr(self.tok, "bos_token_id", None)
        if bos is not None:
            return [bos]
        raise APIError(400, f"{param} is empty after tokenization and the model has no BOS token to start "
                       "from; send some text", param=param)


_WHITESPACE = (" ", "\n", "\t", "\r")


def _longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (vocabulary entries, byte-level ones 1 char a byte)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:  # a tokenizer without a vocabulary listing: assume a generous bound
        return 64
    return max((len(t) for t in get_vocab()), default=64) or 64
