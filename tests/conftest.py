"""Shared pytest set-up: one torch thread (the CI box has 2 shared cores), offline Hugging Face, the
model folders every layer's tests use, built once per test run (tests/engine, tests/server, tests/bench),
and no skipped test where a run must be whole.

A test may skip itself where what it needs is missing (a browser, the fused kernels, a CPU feature, an
optional client library), so a user's `make test` on another machine still runs the rest. Where the run
must be complete (env `CI`, or `CELLSERVE_NO_SKIP`, which `.ci/run` sets), a skip is reported as a
failure with its reason: a skipped test is not a passing one."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(1)

import pytest
from tiny_models import save_tiny_model_dir

NO_SKIP = bool(os.environ.get("CI") or os.environ.get("CELLSERVE_NO_SKIP"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With NO_SKIP, a test that skipped itself (pytest.skip, importorskip, skipif) fails with the reason."""
    outcome = yield
    report = outcome.get_result()
    if NO_SKIP and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome, report.longrepr = "failed", f"skipped where every test must run (CI / CELLSERVE_NO_SKIP): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module that skips itself at import (a module-level importorskip)."""
    outcome = yield
    report = outcome.get_result()
    if NO_SKIP and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome, report.longrepr = "failed", f"module skipped where every test must run: {reason}"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny seeded Llama + byte-level BPE tokenizer with a chat template, saved once per test run."""
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"), seed=0, max_positions=512))


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory) -> str:
    """The same tiny model with a 4096-token context: generations long enough (thousands of ticks) that a
    test can act on them mid-way (cancel, 409, fork a busy sequence) whatever the machine's speed."""
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("tiny-model-long"), seed=0, max_positions=4096))
