"""Headless Chromium for the chat page's tests, and `cellserve serve` as a real process to point it at.

The browser is Debian's `chromium` driven through Debian's `chromium-driver` by Selenium, both named by
path, so Selenium's own manager never downloads anything. Without them the browser tests skip with the
reason; where a run must be whole (`.ci/run`, which installs them) tests/conftest.py turns that skip into
a failure, as every other skip.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars")


def missing_browser() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            return f"{path} is missing: install Debian's {package} (apt-get install -y chromium chromium-driver)"
    return None


def need_browser() -> None:
    reason = missing_browser()
    if reason is not None:
        pytest.skip(reason)


def chromium(width: int = 1200, height: int = 860):
    """A headless Chromium with a throwaway profile (quit() it; the profile folder goes with the driver)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="cellserve-chromium-")
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.profile_dir = profile
    return driver


def quit_chromium(driver) -> None:
    try:
        driver.quit()
    finally:
        shutil.rmtree(driver.profile_dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`with ServeProcess(["--api-key", "k"], log) as srv:` runs `cellserve serve` (the bundled model unless
    the arguments name one) on a free port of 127.0.0.1; `wait_healthy()` waits for the model."""

    def __init__(self, args: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(self.port), "--threads", "1",
                    "--log-level", "warning", *args]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        return self

    def wait_listening(self, timeout: float = 60) -> None:
        self._wait(lambda code: True, timeout)

    def wait_healthy(self, timeout: float = 120) -> None:
        self._wait(lambda code: code == 200, timeout)

    def _wait(self, done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if done(httpx.get(self.url + "/health", timeout=5).status_code):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"`cellserve serve` did not come up (exit code {self.proc.poll()}):\n"
                             f"{self.log.read_text()[-2000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
