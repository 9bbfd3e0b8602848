"""Names for what tests/docker starts (containers, compose projects, volumes, networks) and their sweep.

Every name begins with this test run's PREFIX, so tests/docker/conftest.py can remove at the end whatever a
failed or interrupted test left on the daemon (a stack whose `down` timed out, a container whose start
failed half-way), and only that: another run's containers, or a user's, are never touched."""

import subprocess
import uuid

PREFIX = f"cellserve-test-{uuid.uuid4().hex[:6]}"


def unique_name() -> str:
    """A fresh name under this run's PREFIX (lower case, digits and hyphens: valid for compose projects too)."""
    return f"{PREFIX}-{uuid.uuid4().hex[:6]}"


def _ids(*ls: str) -> list[str]:
    out = subprocess.run(["docker", *ls, "-q", "--filter", f"name={PREFIX}"], capture_output=True, text=True,
                         check=False, timeout=60)
    return out.stdout.split()


def sweep() -> list[str]:
    """Remove this run's containers (with their anonymous volumes), then its networks and named volumes;
    returns what was found (empty when every test cleaned up after itself)."""
    found = []
    for ls, rm in ((("ps", "-a"), ("rm", "-f", "-v")), (("network", "ls"), ("network", "rm")),
                   (("volume", "ls"), ("volume", "rm", "-f"))):
        ids = _ids(*ls)
        if ids:
            subprocess.run(["docker", *rm, *ids], capture_output=True, check=False, timeout=300)
            found += ids
    return found
