"""Prebuilt kernel levels (engine/model/kernels/variants.py): the best level a CPU has is picked, a stale or
missing build is refused, and with `CELLSERVE_KERNELS_PREBUILT` a process loads the prebuilt library and
builds nothing. The image's real levels, compiled in its build stage, are run by tests/docker/."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model.kernels import build, variants

KEY = variants.sources_key(build.SOURCES + build.HEADERS)
ROOT = Path(__file__).resolve().parents[3]


def fake_levels(root: Path, key: str = KEY, names=None) -> Path:
    for v in variants.VARIANTS:
        if names is None or v.name in names:
            (root / v.name).mkdir(parents=True)
            (root / v.name / f"{variants.NAME}.so").write_bytes(b"")
            (root / v.name / "variant.json").write_text(json.dumps({"variant": v.name, "sources": key}))
    return root


def level(name: str) -> variants.Variant:
    return next(v for v in variants.VARIANTS if v.name == name)


@pytest.mark.parametrize("cpu, expected", [("avx512-bf16", "avx512-bf16"), ("avx512", "avx512"), ("avx2", "avx2")])
def test_the_best_level_the_cpu_has_is_picked(tmp_path, cpu, expected):
    root = fake_levels(tmp_path)
    got = variants.pick(root, KEY, level(cpu).needs | {"sse4_2", "aes"})
    assert got is not None and got[0].name == expected and got[1] == root / expected / "cellserve_kernels.so"


def test_a_cpu_below_every_level_stale_sources_or_a_missing_build_pick_nothing(tmp_path, caplog):
    root = fake_levels(tmp_path / "a")
    assert variants.pick(root, KEY, frozenset({"sse4_2", "avx", "fma"})) is None  # no AVX2: no level
    assert "none of the prebuilt kernels' levels" in caplog.text
    stale = fake_levels(tmp_path / "b", key="0" * 16)
    assert variants.pick(stale, KEY, level("avx2").needs) is None
    assert "other sources or another torch" in caplog.text
    partial = fake_levels(tmp_path / "c", names={"avx2"})  # the CPU's best level missing: no silent step down
    assert variants.pick(partial, KEY, level("avx512").needs) is None
    assert "no prebuilt avx512 kernels" in caplog.text


def test_the_key_names_the_sources_and_torch():
    assert variants.sources_key(build.SOURCES[:1]) != KEY
    assert len(KEY) == 16 and KEY == variants.sources_key(build.SOURCES + build.HEADERS)


def test_each_level_replaces_march_native_with_its_own_target():
    for v in variants.VARIANTS:
        flags = variants.cflags(v, build._CFLAGS)
        assert "-march=native" not in flags and flags.count("-O3") == 1 and v.cflags[0] in flags


def test_a_process_with_prebuilt_kernels_loads_them_and_builds_nothing(tmp_path):
    """This machine's own build (make's, -march=native) stands in as the prebuilt library of its level; the
    child process has no compiler on PATH and no ninja, so it can only have loaded the prebuilt file."""
    if not build.load():
        pytest.skip(f"the fused kernels do not build here: {build.why_not()}")
    name = next(v.name for v in variants.VARIANTS if v.needs <= variants.cpu_flags())
    root = fake_levels(tmp_path / "prebuilt", names={name})
    lib = root / name / f"{variants.NAME}.so"
    lib.write_bytes((build.build_directory() / f"{variants.NAME}.so").read_bytes())
    env = {**os.environ, "CELLSERVE_KERNELS_PREBUILT": str(root), "PATH": "/nonexistent",
           "CELLSERVE_KERNEL_CACHE": str(tmp_path / "no-builds-here"), "PYTHONPATH": str(ROOT)}
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "import torch; from engine.model.kernels import build\n"
            "assert build.load(), build.why_not()\n"
            "print(hasattr(torch.ops.cellserve, 'small_linear_fast'))")
    out = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    assert f"fused CPU kernels: the prebuilt {name} build ({lib})" in out.stderr
    assert "fused CPU kernels on" in out.stderr
    assert not (tmp_path / "no-builds-here").exists()
