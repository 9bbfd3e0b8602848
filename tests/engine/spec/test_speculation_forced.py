"""The engine's core tests again with speculative decoding forced on every tick.

`CELLSERVE_SPECULATIVE=ngram` makes every engine these tests build (EngineArgs' default) draft from its
history on every tick, whatever the load: the oracle comparisons (greedy and seeded output equal to a
cacheless forward / `model.generate`), the cell invariants checked after every tick (no leaked cell, the
cells hold exactly each sequence's positions), forks, cancels, preemption, prefix sharing and durable state
must all hold with drafts verified and rejected positions dropped with seq_rm. A child pytest runs them,
so the environment reaches every EngineArgs built there.
"""

import os
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).parents[1] / "core"  # tests/engine/core


def test_the_core_suite_passes_with_drafts_on_every_tick():
    env = {**os.environ, "CELLSERVE_SPECULATIVE": "ngram"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", str(CORE)]
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
