"""Workloads whose answer repeats the prompt: where speculative decoding from the prompt pays.

`--workload edit`: "rename this function everywhere and return the whole code", over a short Python
module; `--workload quote`: "repeat this passage word for word", over a passage of plain sentences;
`--workload summarise`: "summarise this passage, quoting its key sentences word for word". All three ask for the chat endpoint (an instruction-following model copies; a completion would not) and are
pure functions of (seed, request index): names, numbers and words vary per request, so no two prompts
are the same text and neither server answers one from a cached reply. `--input-len` sets about how many
words the code or passage holds; the answer is about as long, so `--output-len` should be at least that.
"""

from __future__ import annotations

import keyword
import random
from dataclasses import dataclass

from server.bench.workloads import WORDS, Prompt, check_lens

_FUNCTION = '''def {name}({a}, {b}):
    """The {noun} of {a} and {b}."""
    return {a} {op} {b} {op2} {k}


'''
_SENTENCES = (
    "The {a} {b} kept the {c} near the {d}.",
    "Every {a} has a {b}, and every {b} has a {c}.",
    "When the {a} came back, the {b} was still {c} by the {d}.",
    "A {a} is not a {b}, but it can {c} like one.",
)


COPY_KINDS = ("edit", "quote", "summarise")
_NAMES = tuple(w for w in WORDS if len(w) > 2 and not keyword.iskeyword(w))  # words that can name things


def _word(rng: random.Random) -> str:
    return rng.choice(_NAMES)


def program(rng: random.Random, n_words: int) -> tuple[str, str]:
    """A Python module of about `n_words` words and the name of its first function."""
    parts, names = [], []
    while sum(len(p.split()) for p in parts) < n_words or not parts:
        name = f"{_word(rng)}_{_word(rng)}"
        names.append(name)
        parts.append(_FUNCTION.format(name=name, a=_word(rng), b=_word(rng) + "_count", noun=_word(rng),
                                      op=rng.choice("+-*"), op2=rng.choice("+-"), k=rng.randint(2, 99)))
    calls = ", ".join(f"{n}(1, 2)" for n in names)
    return "".join(parts) + f"def main():\n    return [{calls}]\n", names[0]


def passage(rng: random.Random, n_words: int) -> str:
    """Plain sentences of about `n_words` words."""
    out: list[str] = []
    while sum(len(s.split()) for s in out) < n_words:
        out.append(rng.choice(_SENTENCES).format(a=_word(rng), b=_word(rng), c=_word(rng), d=_word(rng)))
    return " ".join(out)


@dataclass
class CopyWorkload:
    """`kind` "edit", "quote" or "summarise": prompts whose answer repeats (all or some of) about `input_len`
    words of the prompt."""

    kind: str = "quote"
    input_len: int = 128
    output_len: int = 256
    range_ratio: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in COPY_KINDS:
            raise ValueError(f"copy workload kind {self.kind!r}: use one of {', '.join(COPY_KINDS)}")
        check_lens(self, "input_len", "output_len")

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"{self.seed}:{self.kind}:{index}")
        if self.kind == "edit":
            code, name = program(rng, self.input_len)
            user = (f"Rename the function `{name}` to `new_{name}` everywhere in this code and return the whole "
                    f"code.\n\n```python\n{code}```")
        elif self.kind == "summarise":
            user = (f"Summarise the following passage in a few sentences. Quote its most important sentences "
                    f"word for word, in quotation marks.\n\n{passage(rng, self.input_len)}")
        else:
            user = f"Repeat the following passage word for word.\n\n{passage(rng, self.input_len)}"
        return Prompt(user=user, max_tokens=self.output_len, words=len(user.split()))
