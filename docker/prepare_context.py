"""Put this host's pip settings and its CPU torch wheel into docker/context/ before `docker build`.

`make` installs `torch==2.13.0` with the host's pip, from wherever its configuration points (a local
wheel folder, a file index, PyPI). The image must hold that same build, and pip in the image's build stage
must reach the same index: so this asks the host's pip for the very wheel (`pip download`, its own
resolution) and writes a pip.conf with the host's http(s) indexes and a copy of its CA bundle. Dockerfile's
build stage reads them; its runtime stage copies none of them. A torch that is not a CPU build (PyPI's
default Linux wheel is CUDA's) is refused and left to the Dockerfile's CPU index.

Run with the interpreter whose pip `make` uses (the Makefile's `$(BIN)/python`).
"""

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

CONTEXT = Path(__file__).resolve().parent / "context"
TORCH = "torch==2.13.0"


def pip_settings() -> dict[str, str]:
    """`pip config list` (every file and PIP_* variable pip reads), as {"index-url": ..., ...}."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
    found: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        found[name] = value.strip().strip("'\"")
    return found


def write_pip_conf(settings: dict[str, str]) -> None:
    """The host's http(s) indexes (file:// ones are not reachable from the build) and its CA bundle."""
    conf = configparser.ConfigParser()
    conf["global"] = {}
    for key in ("index-url", "extra-index-url", "trusted-host", "timeout", "default-timeout", "retries"):
        values = [v for v in settings.get(key, "").split() if not v.startswith("file:")]
        if values:
            conf["global"][key] = " ".join(values)
    cert = settings.get("cert") or os.environ.get("PIP_CERT")
    if cert and Path(cert).is_file():
        shutil.copyfile(cert, CONTEXT / "ca.crt")
        conf["global"]["cert"] = "/tmp/context/ca.crt"
    with open(CONTEXT / "pip.conf", "w") as f:
        conf.write(f)


def fetch_torch() -> None:
    """The host pip's own torch==2.13.0 wheel, kept only if it is a CPU build."""
    wheels = CONTEXT / "wheels"
    if any(wheels.glob("torch-2.13.0+cpu-*.whl")):
        return
    wheels.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", TORCH, "-d", str(wheels)],
                   check=True)
    for whl in wheels.glob("torch-*.whl"):
        if "+cpu" not in whl.name:
            print(f"prepare_context: {whl.name} is not a CPU build; the image takes torch from its CPU index")
            whl.unlink()


def main() -> None:
    CONTEXT.mkdir(exist_ok=True)
    write_pip_conf(pip_settings())
    fetch_torch()
    print("prepare_context:", ", ".join(sorted(p.name for p in CONTEXT.rglob("*") if p.is_file())))


if __name__ == "__main__":
    main()
