"""Fixtures of the server tests beyond the shared model folders of tests/conftest.py."""

import pytest
from tool_support import save_hermes_model_dir


@pytest.fixture(scope="session")
def hermes_dir(tmp_path_factory) -> str:
    """The bundled model with a Hermes tool-calling chat template, saved once per test run."""
    return save_hermes_model_dir(tmp_path_factory.mktemp("hermes-model"))
