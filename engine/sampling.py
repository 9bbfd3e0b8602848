"""Sampling parameters and the vectorised sampler.

`SamplingParams` is the validated, per-request description of how to pick tokens. Validation happens
once, at construction, and raises `SamplingError` (a `ValueError` carrying `.param`, the offending field)
so the HTTP layer can answer 400 with `param` set. Limits that need the model's vocabulary size are
checked by `SamplingParams.check_vocab`, which the engine calls at admission.

`Sampler` turns a step's logits `[B, V]` into one token per row with batched tensor ops: logit bias and
penalties by scatter, then temperature, min-p, top-k and top-p by one sort and masks over the whole
matrix, then a Gumbel-max / exponential race draw whose noise comes from each row's own
`torch.Generator`. A seeded row therefore yields the same tokens whatever else shares the batch.

Processing order (the vLLM v1 order): logit_bias -> repetition penalty -> frequency/presence penalty ->
greedy argmax, or temperature -> min_p -> top_k -> top_p -> draw.

Logprobs are "raw" (vLLM v1's default `raw_logprobs`): `log_softmax` of the logits exactly as the model
produced them, before bias, penalties, temperature and truncation. They describe the model, not the
sampling transform.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_N = 64
# Stop strings are matched on the engine thread after every token of every row: these caps bound that
# cost whatever a request sends (OpenAI allows 4 stop strings; lm-eval and agents send a handful).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
GREEDY_EPS = 1e-5
GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")
MAX_GUIDED_CHARS = 1 << 20  # a schema/regex/grammar larger than 1 MiB is refused before compiling
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
    the engine (engine/grammar.py) at admission. Torch-free and hashable.

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

    def __post_init__(self):
        self.max_tokens = _integer("max_tokens", self.max_tokens, 0, 2**31 - 1)
        self.temperature = _number("temperature", self.temperature, 0.0, math.inf)
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        self.top_k = _integer("top_k", self.top_k, -1, 2**31 - 1)
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, _SEED_MIN, _SEED_MAX)
        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_token_list("stop_token_ids", self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        self.presence_penalty = _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                                          lo_open=True)
        self.logit_bias = self._check_logit_bias(self.logit_bias)
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self.n = _integer("n", self.n, 1, MAX_N)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
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

    @staticmethod
    def _check_logit_bias(bias) -> dict[int, float]:
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
            out[key] = _number("logit_bias", value, -100.0, 100.0)
        return out

    def check_vocab(self, vocab_size: int) -> None:
        """Raise SamplingError if a token id in logit_bias or stop_token_ids is outside the vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias.keys()), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise SamplingError(name, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        """temperature 0 (or below 1e-5, where logits / T would overflow, as in vLLM) means argmax."""
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

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


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one sequence: seeded from `params.seed`, or from a fresh random seed if None.

    The engine creates one per sequence when it is admitted and keeps it for the sequence's lifetime
    (including across preemption), so seeded outputs are reproducible.
    """
    g = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    g.manual_seed(seed % 2**64)
    return g


def check_stop_token(params: SamplingParams, token_id: int, num_generated: int,
                     eos_token_ids: Sequence[int] = ()) -> tuple[str, int | None] | None:
    """Token-level stop check after `token_id` became the `num_generated`-th output token.

    Returns (finish_reason, stop_reason) as in vLLM: ("stop", token_id) for a stop_token_id, ("stop", None)
    for EOS (unless ignore_eos), ("length", None) at max_tokens, else None (keep going). A stop or EOS
    token stays in the output token ids but its text should not be pushed to the detokenizer. Stop
    *strings* are the detokenizer's job (engine/detok.py).
    """
    if token_id in params.stop_token_ids:
        return "stop", token_id
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop", None
    if num_generated >= params.max_tokens:
        return "length", None
    return None


@dataclass
class SampleResult:
    """One entry per row. `logprobs[i]` / `top_logprobs[i]` are None for rows that did not ask for them;
    `top_logprobs[i]` holds `params.logprobs` (token id, logprob) pairs, most likely first."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Picks one token per logits row. Stateless: all randomness comes from the per-row generators.

    Call once per step with the rows whose logits were kept:
        sampler(logits, params, generators, output_ids, prompt_ids)
    - logits: [B, V] float tensor (not modified).
    - params: B SamplingParams.
    - generators: B generators (from `make_generator`); None is allowed for greedy rows. Noise is drawn on
      each generator's device and moved to the logits' device, so a CPU generator works with CUDA logits
      (and gives the same tokens as on CPU); a generator on the logits' device avoids the copy.
      Only non-greedy rows consume randomness, exactly V exponential draws per call.
    - output_ids: B lists of the row's previously generated token ids (presence/frequency penalties use
      these; repetition penalty uses prompt + output). Only read for rows with penalties.
    - prompt_ids: B lists of prompt token ids, or None (then repetition penalty sees only the output).
    - grammars: B `engine.grammar.GrammarState` or None (structured output): a row with one may only
      pick a token its grammar allows. The mask is applied after bias and penalties, before
      temperature and truncation (vLLM's order); logprobs stay raw (the unmasked model).
    """

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 output_ids: Sequence[Sequence[int]] | None = None,
                 prompt_ids: Sequence[Sequence[int]] | None = None,
                 grammars: Sequence[object | None] | None = None) -> SampleResult:
        B = self._check_inputs(logits, params, generators, output_ids, prompt_ids, grammars)
        want_lp = any(p.logprobs is not None for p in params)
        plain = not any(p.has_penalties or p.logit_bias for p in params)
        constrained = [i for i, g in enumerate(grammars or ()) if g is not None]
        if plain and not want_lp and not constrained and all(p.greedy for p in params):
            return SampleResult(logits.argmax(dim=-1).tolist(), [None] * B, [None] * B)

        x = logits.float().clone()
        if not plain:
            self._apply_bias_and_penalties(x, params, output_ids, prompt_ids)
        if constrained:
            from engine.grammar import apply_masks  # xgrammar is loaded only once a grammar is used

            apply_masks(x, constrained, [grammars[i] for i in constrained])
        tokens = self._choose(x, params, generators)
        lp, top = self._logprobs(logits, tokens, params) if want_lp else ([None] * B, [None] * B)
        return SampleResult(tokens.tolist(), lp, top)

    @staticmethod
    def _check_inputs(logits, params, generators, output_ids, prompt_ids, grammars=None) -> int:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        B = logits.shape[0]
        for name, rows in (("params", params), ("generators", generators),
                           ("output_ids", output_ids), ("prompt_ids", prompt_ids), ("grammars", grammars)):
            if rows is not None and len(rows) != B:
                raise ValueError(f"{name} has {len(rows)} entries but logits has {B} rows; pass one per row")
        for i, (p, g) in enumerate(zip(params, generators)):
            if g is None and not p.greedy:
                raise ValueError(f"row {i} samples (temperature {p.temperature}) but has no generator; "
                                 "create one per sequence with make_generator(params)")
        return B

    @staticmethod
    def _apply_bias_and_penalties(x: torch.Tensor, params, output_ids, prompt_ids) -> None:
        """In place on x [B, V]: logit_bias, then repetition (HF), then frequency/presence (OpenAI)."""
        B, V = x.shape
        dev = x.device
        bias_rows = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
        if bias_rows:
            r, t, b = zip(*bias_rows)
            x.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                         torch.tensor(b, device=dev, dtype=x.dtype), accumulate=True)

        out = output_ids if output_ids is not None else [()] * B
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep:
            seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
            seqs = [list(out[i]) + (list(prompt_ids[i]) if prompt_ids is not None else []) for i in rep]
            r, t = _flat_index(rep, seqs, dev)
            seen[r, t] = True
            rp = torch.tensor([p.repetition_penalty for p in params], device=dev, dtype=x.dtype)[:, None]
            x.copy_(torch.where(seen, torch.where(x > 0, x / rp, x * rp), x))

        pf = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        if pf:
            counts = torch.zeros(B, V, dtype=x.dtype, device=dev)
            r, t = _flat_index(pf, [out[i] for i in pf], dev)
            counts.index_put_((r, t), torch.ones_like(t, dtype=x.dtype), accumulate=True)
            freq = torch.tensor([p.frequency_penalty for p in params], device=dev, dtype=x.dtype)[:, None]
            pres = torch.tensor([p.presence_penalty for p in params], device=dev, dtype=x.dtype)[:, None]
            x.sub_(freq * counts + pres * (counts > 0).to(x.dtype))

    def _choose(self, x: torch.Tensor, params, generators) -> torch.Tensor:
        """Greedy rows: argmax of x. Other rows: truncate x / T, then the exponential race per row."""
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return x.argmax(dim=-1)
        dev = x.device
        idx = torch.tensor(sampled, device=dev)
        rows = [params[i] for i in sampled]
        temp = torch.tensor([p.temperature for p in rows], device=dev, dtype=x.dtype)[:, None]
        scaled = x.index_select(0, idx) / temp
        if any(p.truncates for p in rows):
            scaled = _truncate(scaled, rows)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; in log space logit - log(E).
        # The noise of row i comes only from generator i, so its token ignores the rest of the batch.
        noise = torch.stack([_exponential(x.shape[1], generators[i], x.dtype).to(dev) for i in sampled])
        noise.clamp_(min=torch.finfo(x.dtype).tiny)  # never log(0): a masked -inf logit stays -inf
        tokens = x.argmax(dim=-1)
        tokens[idx] = (scaled - noise.log()).argmax(dim=-1)
        return tokens

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params):
        """Raw logprobs (see module docstring) of the chosen tokens and the top-k alternatives."""
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        idx = torch.tensor(want, device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
        chosen = lp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0].tolist()
        k = max(params[i].logprobs for i in want)
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        out_lp: list[float | None] = [None] * len(params)
        out_top: list[list[tuple[int, float]] | None] = [None] * len(params)
        for j, i in enumerate(want):
            n = params[i].logprobs
            out_lp[i] = chosen[j]
            out_top[i] = list(zip(top_i[j][:n], top_v[j][:n]))
        return out_lp, out_top


def _exponential(n: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """n Exp(1) draws from g, made on g's own device (a CPU generator also serves CUDA logits)."""
    return torch.empty(n, device=g.device, dtype=dtype).exponential_(generator=g)


def _flat_index(rows: list[int], seqs: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors for scattering each row's token ids into a [B, V] matrix."""
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    r = torch.repeat_interleave(torch.tensor(rows, device=device), lengths)
    # One tensor per row, concatenated: no Python loop over the (possibly long) token histories.
    t = torch.cat([torch.as_tensor(s, dtype=torch.long) for s in seqs]).to(device)
    return r, t


def _truncate(scaled: torch.Tensor, rows: list[SamplingParams]) -> torch.Tensor:
    """min_p, then top_k, then top_p (vLLM's order) on temperature-scaled logits, by one sort.

    top_p keeps the smallest most-likely set whose probability reaches p (computed after min_p and
    top_k removed tokens); the most likely token is always kept. Removed logits become -inf.
    """
    dev, dt = scaled.device, scaled.dtype
    V = scaled.shape[1]
    srt, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=dev)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in rows], device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in rows], device=dev, dtype=dt)[:, None]
    min_p = torch.tensor([p.min_p for p in rows], device=dev, dtype=dt)[:, None]

    probs = torch.softmax(srt, dim=-1)
    drop = (probs < min_p * probs[:, :1]) | (rank >= top_k)
    srt = srt.masked_fill(drop, float("-inf"))
    probs = torch.softmax(srt, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly more likely than this token
    drop = (before >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, srt)
