"""oneDNN's primitive caches are bounded before the model's first matmul (engine/model/onednn.py, issue #47):
importing the model code sets both capacities, and a value the environment already names wins."""

import os
import subprocess
import sys

from engine.model.onednn import CAPACITIES

NAMES = sorted(CAPACITIES)


def capacities_after_import(env: dict[str, str]) -> list[str]:
    code = f"import os, engine.model; print(' '.join(os.environ[n] for n in {NAMES!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_importing_the_model_code_caps_the_caches():
    env = {k: v for k, v in os.environ.items() if k not in CAPACITIES}
    assert capacities_after_import(env) == [CAPACITIES[n] for n in NAMES]
    assert all(0 < int(v) <= 128 for v in CAPACITIES.values())  # 0 crashes ideep; 1,024 is the default we cap


def test_the_environment_wins():
    env = {**os.environ, "LRU_CACHE_CAPACITY": "7", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "9"}
    assert capacities_after_import(env) == [{"LRU_CACHE_CAPACITY": "7", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "9"}[n]
                                            for n in NAMES]
