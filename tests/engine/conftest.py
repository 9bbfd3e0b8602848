"""Fixtures of the engine tests: the seeded tiny Llama (GQA) most of them run, built once per module."""

import pytest
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama_gqa")
