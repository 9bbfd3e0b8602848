"""Shared pytest set-up: one torch thread (the CI box has 2 shared cores), offline Hugging Face, and the
session-wide model folders every layer's tests use (tests/engine, tests/server, tests/bench)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(1)

import pytest
from tiny_models import save_tiny_model_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny seeded Llama + byte-level BPE tokenizer with a chat template, saved once per session."""
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"), seed=0, max_positions=512))


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory) -> str:
    """The same tiny model with a 4096-token context: generations long enough (thousands of ticks) that a
    test can act on them mid-way (cancel, 409, fork a busy sequence) whatever the machine's speed."""
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("tiny-model-long"), seed=0, max_positions=4096))
