"""Prompt generators for the benchmark workloads.

Prompts are built from random common English words, so lengths are given in *words*: with the BPE
tokenizers of common models one such word (with its leading space) is usually one token, but the
real count depends on the server's tokenizer. The server's `usage.prompt_tokens` is recorded when
it reports one. Every prompt is a pure function of (seed, request index), so runs are reproducible
and a `--duration` run can draw as many prompts as it needs.

Lengths are drawn uniformly from [L * (1 - r), L * (1 + r)] (rounded, at least 1) for a range ratio
r in [0, 1), as `vllm bench serve --random-range-ratio` does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if "
    "will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who oil its now "
    "find long down day did get come made may part over new sound take only little work know place "
    "year live me back give most very after thing our just name good sentence man think say great "
    "where help through much before line right too mean old any same tell boy follow came want show "
    "also around form three small set put end does another well large must big even such because turn "
    "here why ask went men read need land different home us move try kind hand picture again change "
    "off play spell air away animal house point page letter mother answer found study still learn "
    "should world high every near add food between own below country plant last school father keep "
    "tree never start city earth eye light thought head under story saw left few while along might "
    "close something seem next hard open example begin life always those both paper together got group "
    "often run important until children side feet car mile night walk white sea began grow took river"
)
WORDS = tuple(_WORD_TEXT.split())


def check_lens(workload, *fields: str) -> None:
    """Raise ValueError with a hint when one of the workload's length `fields` (named by their flags) or
    its range ratio is unusable."""
    for name in fields:
        value = getattr(workload, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if not 0 <= workload.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {workload.range_ratio}")


def sample_len(rng: random.Random, mean: int, ratio: float) -> int:
    """A length drawn uniformly from [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    lo = max(1, round(mean * (1 - ratio)))
    hi = max(lo, round(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def sample_in_out(rng: random.Random, workload) -> tuple[int, int]:
    """A request's input words and output tokens, drawn around the workload's `input_len` and `output_len`."""
    return (sample_len(rng, workload.input_len, workload.range_ratio),
            sample_len(rng, workload.output_len, workload.range_ratio))


def random_text(rng: random.Random, n_words: int) -> str:
    """`n_words` random common words joined by spaces."""
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Prompt:
    """One request's prompt: an optional shared `system` part, the `user` part, and its budget."""

    user: str
    max_tokens: int
    words: int
    system: str | None = None
    group: int | None = None

    def as_text(self) -> str:
        """The prompt for /v1/completions: the system part (if any), a blank line, the user part."""
        return f"{self.system}\n\n{self.user}" if self.system else self.user

    def as_messages(self) -> list[dict]:
        """The prompt for /v1/chat/completions: a system message (if any) and a user message."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return messages + [{"role": "user", "content": self.user}]


@dataclass
class RandomWorkload:
    """Independent prompts of about `input_len` words asking for about `output_len` tokens."""

    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_lens(self, "input_len", "output_len")

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"{self.seed}:random:{index}")
        n_in, n_out = sample_in_out(rng, self)
        return Prompt(user=random_text(rng, n_in), max_tokens=n_out, words=n_in)


@dataclass
class SharedPrefixWorkload:
    """`num_groups` long system prompts of `prefix_len` words; request i uses group i % num_groups
    and adds its own question of about `input_len` words (SGLang's generated-shared-prefix)."""

    num_groups: int = 4
    prefix_len: int = 1024
    input_len: int = 64
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_groups < 1:
            raise ValueError(f"--num-groups must be >= 1, got {self.num_groups}")
        check_lens(self, "prefix_len", "input_len", "output_len")
        self._prefixes: dict[int, str] = {}

    def prefix(self, group: int) -> str:
        """The shared system prompt of `group` (same text for every request of the group)."""
        if group not in self._prefixes:
            rng = random.Random(f"{self.seed}:prefix:{group}")
            self._prefixes[group] = f"System {group}: " + random_text(rng, self.prefix_len)
        return self._prefixes[group]

    def prompt(self, index: int) -> Prompt:
        group = index % self.num_groups
        rng = random.Random(f"{self.seed}:question:{index}")
        n_in, n_out = sample_in_out(rng, self)
        return Prompt(user=random_text(rng, n_in), max_tokens=n_out, words=n_in + self.prefix_len,
                      system=self.prefix(group), group=group)


@dataclass
class TreePlan:
    """One fork tree: a trunk prompt, then one short continuation per branch."""

    trunk: str
    branches: list[str]
    max_tokens: int
    trunk_words: int


@dataclass
class ForkTreeWorkload:
    """Trees of a trunk (about `input_len` words) forked into `branches` continuations of about
    `branch_len` words each; every completion asks for about `output_len` tokens."""

    branches: int = 4
    input_len: int = 256
    branch_len: int = 16
    output_len: int = 64
    range_ratio: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.branches < 1:
            raise ValueError(f"--branches must be >= 1, got {self.branches}")
        check_lens(self, "input_len", "branch_len", "output_len")

    def tree(self, index: int) -> TreePlan:
        rng = random.Random(f"{self.seed}:tree:{index}")
        n_in, n_out = sample_in_out(rng, self)
        trunk = random_text(rng, n_in)
        branches = [" " + random_text(rng, sample_len(rng, self.branch_len, self.range_ratio))
                    for _ in range(self.branches)]
        return TreePlan(trunk=trunk, branches=branches, max_tokens=n_out, trunk_words=n_in)
