"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages separated by NUL bytes, Chromium reading fd 3 and writing fd 4), so the tests need
no websocket client and no port for the browser."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

# Debian names the package and its command ``chromium``; other systems ship one of the others.
_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    return next((path for path in map(shutil.which, _NAMES) if path), None)


class Chromium:
    def __init__(self, executable: str, profile_dir: Path, width: int = 1280, height: int = 1400):
        to_browser, self._write = os.pipe()
        self._read, from_browser = os.pipe()

        def to_fds_3_and_4():  # in the child, before exec
            a = fcntl.fcntl(to_browser, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(from_browser, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [executable, "--headless", "--remote-debugging-pipe", f"--user-data-dir={profile_dir}",
                "--no-first-run", "--no-default-browser-check", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-proxy-server", f"--window-size={width},{height}",
                # The page under test must keep its one-second timer even when nothing is on screen.
                "--disable-background-timer-throttling", "--disable-renderer-backgrounding"]
        if os.geteuid() == 0:
            args.append("--no-sandbox")  # Chromium's sandbox refuses to run as root (CI is root)
        self.log = open(profile_dir / "chromium.log", "wb")
        self.proc = subprocess.Popen([*args, "about:blank"], pass_fds=(3, 4), preexec_fn=to_fds_3_and_4,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        os.close(to_browser)
        os.close(from_browser)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.page(f"{domain}.enable")

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("Browser.close", timeout=5)
            except (OSError, RuntimeError, TimeoutError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self.log.close()

    # -- the protocol ---------------------------------------------------------------------------

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30.0):
        self._next_id += 1
        msg_id = self._next_id
        msg = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._write, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            msg = self._receive(deadline, method)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            self.events.append(msg)

    def _receive(self, deadline: float, waiting_for: str) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError(f"no reply from Chromium to {waiting_for}")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited (status {self.proc.poll()}); see {self.log.name}")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)

    def page(self, method: str, params: dict | None = None, timeout: float = 30.0):
        return self.call(method, params, self.session, timeout)

    # -- what the tests use ---------------------------------------------------------------------

    def open(self, url: str, timeout: float = 30.0) -> None:
        """Navigate and wait for the page (and its scripts) to have loaded."""
        self.page("Page.navigate", {"url": url})
        self.wait_for(lambda: self.js(f"location.href === {json.dumps(url)} && document.readyState === 'complete'"),
                      what=f"{url} to load", timeout=timeout)

    def js(self, expression: str):
        """The expression's value (JSON-able), evaluated in the page."""
        r = self.page("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r} threw: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, condition, what: str, timeout: float = 30.0, interval: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}; page errors: {self.errors()}")
            time.sleep(interval)

    def errors(self) -> list[str]:
        """Every console error and warning, uncaught exception and failed load so far."""
        self.js("0")  # collects the events that arrived since the last call
        out = []
        for e in self.events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "warning", "assert"):
                out.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif method == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
                out.append(f"log: {p['entry']['text']} ({p['entry'].get('url', '')})")
        return out

    def screenshot(self, path: Path) -> Path:
        """The whole page, not only the window, as PNG."""
        size = self.page("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        data = self.page("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(data["data"]))
        return path
