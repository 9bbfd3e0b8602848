"""What a request may ask for: the request's contract.

`SamplingParams` is the validated, torch-free description of how to pick a completion's tokens.

The one source of every sampling limit and default (the HTTP schema in `server/protocol.py` reads its
bounds from here). Validation happens once, at construction, and raises `SamplingError` (a `ValueError`
carrying `.param`, the offending field) so the HTTP layer can answer 400 with `param` set. Limits that
need the model's vocabulary size are checked by `SamplingParams.check_vocab`, which the engine calls at
admission. No torch here: the server imports this module without loading the engine's tensors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from engine.api.errors import InvalidRequest
from engine.api.lora import LoraRef

MAX_LOGPROBS = 20
MAX_N = 64
MAX_TEMPERATURE = 2.0  # OpenAI's cap: above it sampling is close to uniform noise
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties (OpenAI's range)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# Stop strings are matched on the engine thread after every token of every row: these caps bound that
# cost whatever a request sends (OpenAI allows 4 stop strings; lm-eval and agents send a handful).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
GREEDY_EPS = 1e-5
GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")
MAX_GUIDED_CHARS = 1 << 20  # a schema/regex/grammar larger than 1 MiB is refused before compiling
# Token lists the sampler masks every step (vLLM's allowed_token_ids, bad_words): bounded so a request
# cannot make each step's mask cost grow without limit.
MAX_ALLOWED_TOKENS = 1 << 16
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 32
MAX_PREDICTION_TOKENS = 1 << 15  # a predicted output longer than this is refused (it is searched every draft)
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed accepts


class SamplingError(InvalidRequest, ValueError):
    """A sampling parameter is invalid. `param` names the field; as an `InvalidRequest` it maps to a 400."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}", param=param)


def _number(name: str, value, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingError(name, f"must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise SamplingError(name, f"must be finite, got {value!r}")
    if value < lo or (lo_open and value == lo) or value > hi:
        if hi == math.inf:
            allowed = f"{'>' if lo_open else '>='} {lo}"
        else:
            allowed = f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise SamplingError(name, f"must be {allowed}, got {value!r}")
    return float(value)


def _integer(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(name, f"must be an integer, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise SamplingError(name, f"must be in [{lo}, {hi}], got {value!r}")
    return value


@dataclass(frozen=True)
class GuidedDecoding:
    """What a completion's text must match (structured output), checked for shape here and compiled by
    the engine (engine/sample/grammar.py) at admission. Torch-free and hashable.

    kind: json_object (any JSON object) | json_schema (spec: the schema as JSON text) | regex (spec) |
    choice (choices: one of these strings) | grammar (spec: EBNF/GBNF) | structural_tag (spec: JSON text).
    `param` is the request field it came from, so a compile error names what the client sent.
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    param: str = "response_format"

    def __post_init__(self):
        if self.kind not in GUIDED_KINDS:
            raise SamplingError(self.param, f"unknown guided decoding kind {self.kind!r}; one of {GUIDED_KINDS}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_GUIDED_CHARS:
            raise SamplingError(self.param, f"must be text of at most {MAX_GUIDED_CHARS} characters")
        if self.kind in ("json_schema", "regex", "grammar", "structural_tag") and not self.spec.strip():
            raise SamplingError(self.param, f"the {self.kind} is empty; give one")
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise SamplingError(self.param, "give a non-empty list of non-empty strings to choose from")
            if sum(len(c) for c in self.choices) > MAX_GUIDED_CHARS:
                raise SamplingError(self.param, f"the choices exceed {MAX_GUIDED_CHARS} characters")


@dataclass
class SamplingParams:
    """How to pick the tokens of one completion. Guarantees: every field is in range after construction.

    max_tokens 0 means "prefill only" (the engine never calls the sampler for it). temperature 0 is greedy
    (argmax, no randomness consumed). top_k 0 or -1 and top_p 1 disable those filters. `stop` may be given
    as one string; it is stored as a list. `logit_bias` keys may be ints or decimal strings (the OpenAI JSON
    form); they are stored as ints. `logprobs` None means off; k >= 0 returns the chosen token's logprob
    and the k most likely tokens.

    Token rules (vLLM's extras), applied by the Sampler as masks before sampling:
    - `min_tokens`: until that many tokens are generated, `stop_token_ids` and `eos_token_ids` cannot
      be sampled (and do not stop the choice, engine/core/output_processor.py), so the reply is at
      least that long unless max_tokens or a stop string ends it first.
    - `allowed_token_ids`: only these ids can be sampled (None: all).
    - `bad_words_ids`: token sequences that are never completed: a one-token word is never sampled;
      a longer one's last token is masked when the output ends with the rest of it.
    `priority` (lower first, vLLM's convention): the scheduler admits waiting requests in (priority,
    arrival) order and preempts the running request of the highest value first (engine/core/scheduler.py).
    `prediction_ids`: the output the client expects (OpenAI's predicted outputs), tokenized: a draft source
    for speculative decoding (engine/spec/decoder.py) when the engine speculates; it never changes
    what is generated, only how many tokens one step may keep.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    n: int = 1
    guided: GuidedDecoding | None = None  # structured output: the text must match this grammar
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens too (+ this many alternatives each)
    min_tokens: int = 0
    eos_token_ids: list[int] = field(default_factory=list)  # ids that end a reply, masked until min_tokens
    allowed_token_ids: list[int] | None = None
    bad_words_ids: list[list[int]] = field(default_factory=list)
    priority: int = 0
    skip_special_tokens: bool = True  # the detokenizer leaves special tokens' text out (vLLM's default)
    prediction_ids: list[int] = field(default_factory=list)
    report_progress: bool = False  # an output with `prompt_progress` at admission and after each prompt chunk
    lora: LoraRef | None = None  # the LoRA adapter the request runs under (None: the base model; engine/api/lora.py)

    def __post_init__(self):
        self.max_tokens = _integer("max_tokens", self.max_tokens, 0, 2**31 - 1)
        self.temperature = _number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        self.top_k = _integer("top_k", self.top_k, -1, 2**31 - 1)
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, _SEED_MIN, _SEED_MAX)
        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_token_list("stop_token_ids", self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingError(name, f"must be true or false, got {getattr(self, name)!r}")
        self.presence_penalty = _number("presence_penalty", self.presence_penalty, *PENALTY_RANGE)
        self.frequency_penalty = _number("frequency_penalty", self.frequency_penalty, *PENALTY_RANGE)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                                          lo_open=True)
        self.logit_bias = check_logit_bias(self.logit_bias)
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self.n = _integer("n", self.n, 1, MAX_N)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        self.min_tokens = _integer("min_tokens", self.min_tokens, 0, 2**31 - 1)
        if self.min_tokens > self.max_tokens:
            raise SamplingError("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self.eos_token_ids = self._check_token_list("eos_token_ids", self.eos_token_ids)
        if self.lora is not None and not isinstance(self.lora, LoraRef):
            raise SamplingError("lora", f"must be a LoraRef, got {type(self.lora).__name__}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._check_token_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise SamplingError("allowed_token_ids", "give at least one token id (or leave it unset)")
            if len(self.allowed_token_ids) > MAX_ALLOWED_TOKENS:
                raise SamplingError("allowed_token_ids", f"at most {MAX_ALLOWED_TOKENS} ids")
        if not isinstance(self.bad_words_ids, (list, tuple)) or len(self.bad_words_ids) > MAX_BAD_WORDS:
            raise SamplingError("bad_words", f"must be a list of at most {MAX_BAD_WORDS} words")
        self.bad_words_ids = [self._check_token_list("bad_words", w) for w in self.bad_words_ids]
        if any(not w or len(w) > MAX_BAD_WORD_TOKENS for w in self.bad_words_ids):
            raise SamplingError("bad_words", f"each word must be 1 to {MAX_BAD_WORD_TOKENS} tokens")
        self.priority = _integer("priority", self.priority, *PRIORITY_RANGE)
        self.prediction_ids = self._check_token_list("prediction", self.prediction_ids)
        if len(self.prediction_ids) > MAX_PREDICTION_TOKENS:
            raise SamplingError("prediction", f"is {len(self.prediction_ids)} tokens; at most "
                                f"{MAX_PREDICTION_TOKENS} are accepted")
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise SamplingError("guided", f"must be a GuidedDecoding, got {type(self.guided).__name__}")

    @staticmethod
    def _check_stop(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise SamplingError("stop", f"must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise SamplingError("stop", "stop strings must be non-empty; remove the empty string")
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        longest = max((len(s) for s in stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise SamplingError("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}")
        return list(stop)

    @staticmethod
    def _check_token_list(name: str, ids) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise SamplingError(name, f"must be a list of token ids, got {ids!r}")
        return [_integer(name, t, 0, 2**31 - 1) for t in ids]

    def check_vocab(self, vocab_size: int) -> None:
        """Raise SamplingError if a token id in logit_bias or stop_token_ids is outside the vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias.keys()), ("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words", [t for w in self.bad_words_ids for t in w]),
                          ("prediction", self.prediction_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise SamplingError(name, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        """temperature 0 (or below 1e-5, where logits / T would overflow, as in vLLM) means argmax."""
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """The sampler reads this row's token history (the engine passes it only then): penalties, and
        the rules that depend on what was generated (min_tokens, bad_words)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.bad_words_ids)

    @property
    def masks_tokens(self) -> bool:
        """A token rule (min_tokens, allowed_token_ids, bad_words) may mask logits of this row."""
        return bool(self.min_tokens or self.allowed_token_ids is not None or self.bad_words_ids)

    @property
    def truncates(self) -> bool:
        """True if top_k, top_p or min_p removes anything (only meaningful when sampling)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def for_child(self, i: int) -> SamplingParams:
        """The params of completion `i` of an n > 1 request: n = 1 and seed + i (vLLM's rule)."""
        seed = self.seed
        if seed is not None:
            seed += i
            if seed > _SEED_MAX:  # wrap; the generator sees seed mod 2**64 anyway
                seed -= 2**64
        return dataclasses.replace(self, n=1, seed=seed)


def check_logit_bias(bias) -> dict[int, float]:
    """Token id -> bias, with ids given as ints or decimal strings (OpenAI's JSON form) and each bias in
    LOGIT_BIAS_RANGE; raises SamplingError naming `logit_bias`."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise SamplingError("logit_bias", f"must map token ids to numbers, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise SamplingError("logit_bias", f"keys must be token ids (integers >= 0), got {key!r}")
        out[key] = _number("logit_bias", value, *LOGIT_BIAS_RANGE)
    return out
