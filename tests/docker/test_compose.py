"""docker/compose.yaml as a user starts it: the single service, and the `ray` profile (a Ray head running the
cellserve front and two workers joining it), each answering a chat over HTTP from the host. The images are the
ones `make docker-test` builds (cellserve:cpu, and cellserve:ray with the `ray` extra); compose is told not to
build them again. Each stack runs under a project name of its own, its port on a free 127.0.0.1 port, and is
taken down (volumes included) whatever happens.

Marked `docker` (not in `make test`): `make docker-test` builds the images, then runs this folder.
"""

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from docker_support import unique_name

pytestmark = pytest.mark.docker

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"
NAME = "smollm2-135m-instruct"
READY_S = 900  # a Ray cluster of three containers and two model loads on a busy 2-core machine


def compose_command() -> list[str]:
    """Debian's docker-compose (v1), or Docker's own `docker compose` plugin where that is what is installed."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if subprocess.run(["docker", "compose", "version"], check=False, capture_output=True).returncode == 0:
        return ["docker", "compose"]
    pytest.fail("neither docker-compose nor `docker compose` is installed (Debian: apt-get install docker-compose)")


class Stack:
    """One `compose up -d` under its own project name; `down -v` on exit."""

    def __init__(self, *args: str, env: dict[str, str]):
        self.project = unique_name()
        self.env = {**os.environ, **env}
        self.base = [*compose_command(), "-f", str(COMPOSE_FILE), "-p", self.project]
        self.args = args

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*self.base, *args], check=False, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def up(self, *services: str) -> None:
        out = self.run(*self.args, "up", "-d", "--no-build", *services)
        assert out.returncode == 0, out.stderr[-3000:]

    def logs(self) -> str:
        return self.run(*self.args, "logs", "--no-color").stdout[-4000:]

    def down(self) -> None:
        self.run(*self.args, "down", "-v", "--remove-orphans", timeout=180)

    def url(self, service: str) -> str:
        """The host's 127.0.0.1 port Docker chose for the service's 8000 (the port variable is `127.0.0.1:`)."""
        out = self.run(*self.args, "port", service, "8000")
        assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]
        return f"http://127.0.0.1:{out.stdout.strip().rpartition(':')[2]}"

    def wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(3)
        pytest.fail(f"{url} not ready after {READY_S} s:\n{self.logs()}")


def chat(url: str) -> str:
    body = {"model": NAME, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0}
    out = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert out.status_code == 200, out.text
    return out.json()["choices"][0]["message"]["content"]


def test_the_single_service_starts_and_answers():
    stack = Stack(env={"CELLSERVE_PORT": "127.0.0.1:"})  # "127.0.0.1::8000": a free port of Docker's choice
    try:
        stack.up("cellserve")
        url = stack.url("cellserve")
        stack.wait_ready(url)
        assert "Paris" in chat(url)
    finally:
        stack.down()


def test_the_ray_profile_starts_a_head_and_two_workers_and_answers():
    stack = Stack("--profile", "ray", env={"CELLSERVE_RAY_PORT": "127.0.0.1:",
                                           "RAY_AUTH_TOKEN": secrets.token_hex(32), "REPLICAS": "2"})
    try:
        stack.up("--scale", "worker=2", "head", "worker")
        url = stack.url("head")
        stack.wait_ready(url)
        assert "Paris" in chat(url)
        running = stack.run("--profile", "ray", "ps", "-q").stdout.split()
        assert len(running) == 3, stack.logs()  # the head and two workers, none exited
    finally:
        stack.down()
