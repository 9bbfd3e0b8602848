"""Fixtures of the server tests beyond the shared model folders of tests/conftest.py."""

import pytest
from http_support import ORPHANS
from tool_support import save_hermes_model_dir


@pytest.fixture(scope="module", autouse=True)
def no_orphaned_cells():
    """After every module: each `LiveServer` it ran held, once idle, only what live sequences and cached
    prefixes own (`LiveServer.orphan_check`, run as the server exits); the module fails otherwise."""
    ORPHANS.clear()
    yield
    found = list(ORPHANS)
    ORPHANS.clear()
    assert not found, "cells left behind: " + "; ".join(found)


@pytest.fixture(scope="session")
def hermes_dir(tmp_path_factory) -> str:
    """The bundled model with a Hermes tool-calling chat template, saved once per test run."""
    return save_hermes_model_dir(tmp_path_factory.mktemp("hermes-model"))
