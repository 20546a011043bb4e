"""Headless Chromium driven over the DevTools protocol, for the tests of the status page
that need what a screenshot cannot say: the layout at a given width (each element's box)
and what the page's own script does over time.

A few protocol calls over aiohttp's WebSocket client (already a dependency) are all
that is needed; a browser-automation library would bring its own browser download,
which this machine cannot make.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp


class Page:
    """One tab of a headless Chromium, at a given viewport."""

    def __init__(self, browser: str, width: int, height: int, mobile: bool = False) -> None:
        self.browser = browser
        self.width, self.height, self.mobile = width, height, mobile
        self._ids = itertools.count(1)
        self._profile = Path(tempfile.mkdtemp(prefix="llm-streams-chromium-"))
        self._proc: asyncio.subprocess.Process | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._events: list[dict[str, Any]] = []

    async def __aenter__(self) -> Page:
        self._proc = await asyncio.create_subprocess_exec(
            self.browser, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-dev-shm-usage", "--hide-scrollbars", "--remote-debugging-port=0",
            f"--user-data-dir={self._profile}", "about:blank",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        port_file = self._profile / "DevToolsActivePort"
        for _ in range(300):
            if port_file.exists() and port_file.read_text().count("\n") >= 1:
                break
            await asyncio.sleep(0.1)
        port = port_file.read_text().splitlines()[0]
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as reply:
            targets = await reply.json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.call("Page.enable")
        await self.call("Emulation.setDeviceMetricsOverride", width=self.width,
                        height=self.height, deviceScaleFactor=1, mobile=self.mobile)  # fmt: skip
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.terminate()
            try:
                await asyncio.wait_for(self._proc.wait(), 10)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
        shutil.rmtree(self._profile, ignore_errors=True)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        ident = next(self._ids)
        await self._ws.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads((await asyncio.wait_for(self._ws.receive(), 60)).data)
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result
            self._events.append(message)

    async def open(self, url: str) -> None:
        """Navigate and wait for the load event."""
        self._events.clear()
        await self.call("Page.navigate", url=url)
        for _ in range(600):
            if any(e.get("method") == "Page.loadEventFired" for e in self._events):
                return
            await self.evaluate("1")  # reads the events that came meanwhile
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{url} did not load")

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        reply = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def boxes(self, selector: str) -> list[dict[str, float]]:
        """The bounding box of each element `selector` matches, in page coordinates."""
        found: list[dict[str, float]] = await self.evaluate(
            "Array.from(document.querySelectorAll(" + json.dumps(selector) + ")).map(e => {"
            "const r = e.getBoundingClientRect(); return {left: r.left + scrollX, "
            "top: r.top + scrollY, right: r.right + scrollX, bottom: r.bottom + scrollY}})"
        )
        return found


__all__ = ["Page"]
