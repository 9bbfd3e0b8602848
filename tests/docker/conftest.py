"""After the docker tests, nothing they started stays on the daemon (docker_support.sweep: by name)."""

import pytest
from docker_support import sweep


@pytest.fixture(scope="session", autouse=True)
def _remove_what_the_tests_started():
    yield
    left = sweep()
    if left:
        print(f"tests/docker: removed {len(left)} leftover containers, networks or volumes")
