"""What the browser tests share: Debian's chromium through Playwright, the tiny studio served in-process or as a
process of its own, and a record of requests that leave 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
OUTPUT = Path(__file__).resolve().parents[1] / "test-output"
ROOT = Path(__file__).resolve().parents[1]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


def need_chromium() -> None:
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        pytest.skip("Debian chromium is not installed (apt-get install -y chromium)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def chromium():
    """-> (browser, outside): ``outside`` collects every request a page sends beyond 127.0.0.1."""
    from playwright.sync_api import sync_playwright

    outside: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)

        def watch(page):
            page.on("request", lambda req: outside.append(req.url)
                    if not req.url.startswith(("http://127.0.0.1", "data:", "blob:")) else None)

        browser.watch = watch
        try:
            yield browser, outside
        finally:
            browser.close()


def open_page(browser, url: str, viewport=DESKTOP, context=None):
    page = (context or browser).new_page()
    page.set_viewport_size(viewport)
    browser.watch(page)
    page.goto(url)
    return page


def reload(page, timeout_s: float = 60) -> None:
    """Reload the tab. A tab whose page is being replaced (Gradio's client reconnecting after a server restart)
    is detached for a moment, and a reload then fails at once: retried until the page is attached again."""
    from playwright.sync_api import Error

    deadline = time.time() + timeout_s
    while True:
        try:
            page.reload()
            return
        except Error as err:
            if "Not attached" not in str(err) or time.time() > deadline:
                raise
            time.sleep(0.2)


def pick(page, elem_id: str, name: str) -> None:
    """Choose ``name`` in a dropdown by clicking its option (typing and pressing Enter races the option list)."""
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=name, exact=True).click()


def pick_example(page, name: str) -> None:
    pick(page, "example", name)
    page.wait_for_function("document.querySelector('#prompt textarea').value.length > 0")


def set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")
    box.blur()


def shot(page, name: str) -> None:
    OUTPUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUTPUT / f"{name}.png"), full_page=True)


class StudioProcess:
    """The tiny studio as a separate process on one database (``tests/tiny_studio.py``)."""

    def __init__(self, database_url: str, seconds_per_forward: float = 0.0):
        self.database_url = database_url
        self.delay = seconds_per_forward
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 90, same_port: bool = False) -> str:
        """``same_port``: come back where the last process was (a restart, as a browser tab sees it)."""
        port = self.port if same_port and getattr(self, "port", None) else free_port()
        self.port = port
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GRADIO_ANALYTICS_ENABLED": "False"}
        command = [sys.executable, "-m", "tests.tiny_studio", str(port), self.database_url, str(self.delay)]
        self.process = subprocess.Popen(command,
                                        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                urllib.request.urlopen(self.url, timeout=2)
                return self.url
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the studio process exited with {self.process.returncode}")
                time.sleep(0.5)
        raise RuntimeError("the studio process did not start in time")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
