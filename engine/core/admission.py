"""Admission: what a request must pass before it is queued, checked up front so a refusal changes nothing.

`admit` is the one call that runs them all for a request (the engine's `add_request` asks nothing else).
The rules: a request id not in flight, a sequence that is not already generating, a non-empty prompt, token
ids inside the vocabulary, a prompt + `max_tokens` that fits the model's context and, with all its choices, the
whole cell pool (admitting more would preempt everything else and still not fit), a queue with room,
and a grammar that compiles in bounded time. The fit rules read only constants, so the HTTP layer may call
them from any thread before it submits. Grammars compile on a small pool of their own threads (xgrammar's
compiler is thread-safe), each waited on for at most `grammar_timeout_s`: a pathological schema costs its
client a 400 after that long and at most one of those threads, never the engine's tick nor other
requests' compiles beyond the pool's size. xgrammar, and with it torch, loads only when a request first
asks for structured output.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Container

from engine.api.errors import InvalidRequest, PromptTooLong, QueueFull, SequenceBusy
from engine.api.sampling_params import SamplingParams
from engine.core.sequence import Sequence

GRAMMAR_THREADS = 2  # compiles at once; one more waits its turn (within its own timeout)


class Admission:
    """The up-front checks of one engine (its model's context, its pool, its queue bound)."""

    def __init__(self, max_model_len: int, n_cells: int, max_queue: int, vocab_size: int, tokenizer, eos_ids,
                 grammar_timeout_s: float = 10.0):
        self.max_model_len = max_model_len
        self.n_cells = n_cells
        self.max_queue = max_queue
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.grammar_timeout_s = grammar_timeout_s
        self._grammars = None  # engine.sample.grammar.GrammarCompiler, made on the first structured-output request
        self._grammars_lock = threading.Lock()
        self._compiles: concurrent.futures.ThreadPoolExecutor | None = None

    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seq: Sequence | None, *,
              in_flight: Container[str], n_waiting: int, detokenize: bool = True):
        """Every check a new request must pass, in the order a client fixes them; raises (InvalidRequest,
        SequenceBusy, PromptTooLong, QueueFull) before anything changes. `seq`: the persistent sequence it
        continues (None: a new prompt). Returns its compiled grammar (None without structured output)."""
        if not detokenize and params.stop:
            raise InvalidRequest("stop strings need the engine's detokenizer: keep detokenize=True", "stop")
        if request_id in in_flight:
            raise InvalidRequest(f"request id {request_id!r} is already in flight", "request_id")
        if seq is not None and seq.request is not None:
            raise SequenceBusy(f"sequence {seq.seq_id} is already generating; wait or cancel it")
        if seq is not None and params.n != 1:
            raise InvalidRequest("n must be 1 when continuing a sequence; fork it for more branches", "n")
        history = len(seq.token_ids) if seq else 0
        if history + len(prompt_ids) == 0:
            raise InvalidRequest("the prompt is empty: give at least one token", "prompt")
        self.check_tokens(prompt_ids)
        params.check_vocab(self.vocab_size)
        grammar = self.compile_grammar(params)
        if params.prompt_logprobs is not None and seq is not None:
            raise InvalidRequest("prompt logprobs need the whole prompt computed; a sequence continuation reuses "
                                 "its cached history: send the text as a new prompt", "prompt_logprobs")
        self.check_fits([history + len(prompt_ids)], params.max_tokens, params.n)
        self.check_queue(n_waiting)
        return grammar

    def check_tokens(self, ids) -> None:
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})", "prompt")

    def check_queue(self, n_waiting: int) -> None:
        if n_waiting >= self.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.max_queue} requests); retry shortly")

    def max_tokens_left(self, prompt_len: int, n: int = 1) -> int:
        """The most tokens each of n choices can generate after `prompt_len` tokens: the model's context
        left, and the pool shared by the n choices (the same rule `check_fits` enforces); at least 1."""
        by_model = self.max_model_len - prompt_len
        by_pool = (self.n_cells - prompt_len) // max(1, n)
        return max(1, min(by_model, by_pool))

    def check_fits(self, prompt_lens: list[int], max_tokens: int, n: int = 1) -> None:
        """Refuse (PromptTooLong) what can never run: a prompt + max_tokens beyond the model's context,
        or all prompts x n choices beyond the whole cell pool."""
        limit = self.max_model_len
        longest = max(prompt_lens)
        if longest + max_tokens > limit:
            raise PromptTooLong(
                f"{longest} prompt tokens + max_tokens {max_tokens} exceed the model's context of {limit} tokens; "
                "shorten the prompt or lower max_tokens", "max_tokens" if longest < limit else "prompt")
        need = sum(prompt_lens) + len(prompt_lens) * n * max_tokens
        if need > self.n_cells:
            what = f"{len(prompt_lens)} prompts" if len(prompt_lens) > 1 else "the prompt"
            raise PromptTooLong(
                f"{what} ({sum(prompt_lens)} tokens) + {len(prompt_lens) * n} choices x max_tokens {max_tokens} "
                f"need {need} cells, more than the whole cell pool ({self.n_cells} cells); send fewer "
                "prompts or choices, lower max_tokens, or start the server with more cells", "prompt")

    def compile_grammar(self, params: SamplingParams):
        """The compiled grammar of a structured-output request (None without one), or InvalidRequest naming
        its field (a grammar that does not compile, or not within `grammar_timeout_s`). Thread-safe: the HTTP
        layer compiles in a worker thread before submitting, so a compile (milliseconds; seconds for a big
        schema) does not stall the tick, and admission then hits xgrammar's cache."""
        if params.guided is None or not params.max_tokens:
            return None
        if self.tokenizer is None:
            raise InvalidRequest("structured output needs the model's tokenizer, which this engine has not "
                                 "loaded", params.guided.param)
        with self._grammars_lock:
            if self._grammars is None:  # xgrammar loads only when structured output is used
                from engine.sample.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
                self._compiles = concurrent.futures.ThreadPoolExecutor(GRAMMAR_THREADS, "grammar")
        work = self._compiles.submit(self._grammars.compile, params.guided)
        try:
            return work.result(timeout=self.grammar_timeout_s)
        except concurrent.futures.TimeoutError:
            guided = params.guided
            raise InvalidRequest(
                f"{guided.param}: the {guided.kind.replace('_', ' ')} did not compile within "
                f"{self.grammar_timeout_s:g} s (too large or too deeply nested for the grammar compiler); simplify "
                "it. Its compile goes on in the background and is cached, so the same request may pass later",
                guided.param) from None

    def grammar_cache_bytes(self) -> int:
        """Bytes of compiled grammars cached (0 before the first structured-output request)."""
        return self._grammars.cache_bytes() if self._grammars is not None else 0

    def grammar_state(self, compiled):
        """A fresh matcher for one choice of a request whose grammar `compile_grammar` made."""
        return self._grammars.state(compiled)
