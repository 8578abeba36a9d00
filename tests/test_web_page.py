"""The web page at `/`, driven in headless Chromium over the DevTools protocol: a chat turn
streams the model's reply (equal to the offline engine's), the status panel is live, and the
screenshot shows the rendered page."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import struct
import subprocess
import tempfile
import time
import zlib

import httpx
import pytest
import websockets

from lantau import LLM, SamplingParams
from tests.servers import free_port
from tests.test_openai_server import API_KEY, MODEL, server  # noqa: F401 - fixture

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PROMPT = "Hi"


@pytest.fixture()
def chromium():
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: `make test` installs Debian's chromium package")
    port = free_port()
    profile = tempfile.mkdtemp(prefix="lantau-chromium-")
    proc = subprocess.Popen(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}", f"--remote-debugging-port={port}",
            "--window-size=1100,700", "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            targets = httpx.get(f"http://127.0.0.1:{port}/json", timeout=1).json()
            page = next(t for t in targets if t["type"] == "page")
            break
        except (httpx.HTTPError, StopIteration):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    yield page["webSocketDebuggerUrl"]
    proc.kill()
    proc.wait()
    shutil.rmtree(profile, ignore_errors=True)


class DevTools:
    def __init__(self, ws) -> None:
        self.ws, self.ids = ws, itertools.count(1)

    async def call(self, method: str, **params) -> dict:
        call_id = next(self.ids)
        await self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.ws.recv())
            if msg.get("id") == call_id:
                assert "error" not in msg, msg
                return msg["result"]

    async def eval(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


async def drive(ws_url: str, url: str) -> tuple[dict, bytes]:
    async with websockets.connect(ws_url, max_size=None) as ws:
        tools = DevTools(ws)
        await tools.call("Page.enable")
        await tools.call(
            "Emulation.setDeviceMetricsOverride",
            width=1100, height=700, deviceScaleFactor=1, mobile=False,
        )  # fmt: skip
        await tools.call("Page.navigate", url=url)
        deadline = time.monotonic() + 60
        while not await tools.eval("!!document.querySelector('.assistant[data-done]')"):
            assert time.monotonic() < deadline, "the reply never finished streaming"
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.5)  # one more status poll after the reply
        state = await tools.eval(
            """({reply: document.querySelector('.assistant').textContent,
                 user: document.querySelector('.user').textContent,
                 model: document.getElementById('model').textContent,
                 ready: document.getElementById('s-ready').textContent,
                 running: document.getElementById('s-running').textContent,
                 tokens: document.getElementById('s-tokens').textContent,
                 error: document.getElementById('error').textContent,
                 box: (({x, y, width, height}) => ({x, y, width, height}))(
                     document.querySelector('.assistant').getBoundingClientRect())})"""
        )
        shot = await tools.call("Page.captureScreenshot", format="png")
        return state, base64.b64decode(shot["data"])


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit truecolour PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and color in (2, 6)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw, stride = zlib.decompress(idat), width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        kind, line = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, up_left = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - up_left
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else up_left
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i] for i in range(len(r)) if i % channels < 3) for r in rows]


def test_web_page_chat_and_status(server, chromium, tmp_path):  # noqa: F811 - pytest fixture
    url = f"{server}/?key={API_KEY}&temperature=1&seed=3&max_tokens=12&prompt={PROMPT}"
    state, png = asyncio.run(drive(chromium, url))
    offline = LLM(MODEL, device="cpu", max_model_len=512, num_kv_blocks=128)
    expected = (
        offline.chat(
            [{"role": "user", "content": PROMPT}],
            SamplingParams(temperature=1.0, seed=3, max_tokens=12),
        )[0]
        .outputs[0]
        .text
    )
    assert state["error"] == ""
    assert state["user"] == PROMPT and state["reply"] == expected and expected.strip()
    assert state["model"] == MODEL and state["ready"] == "yes" and state["running"] == "0"
    assert int(state["tokens"]) >= 12
    (tmp_path / "page.png").write_bytes(png)  # kept for a look when the test fails
    width, height, rows = decode_png(png)
    assert (width, height) == (1100, 700)
    header, send_button = rows[10][30:33], None
    assert header == bytes((0x1D, 0x23, 0x30))  # the dark header bar is drawn
    blue = bytes((0x2F, 0x6F, 0xED))
    send_button = any(blue in row for row in rows[480:560])
    assert send_button, "the Send button is not on the page"
    box = state["box"]  # the reply bubble: its text is drawn in dark pixels
    x0, x1 = int(box["x"]), int(box["x"] + box["width"])
    bubble = [row[3 * x0 : 3 * x1] for row in rows[int(box["y"]) : int(box["y"] + box["height"])]]
    dark = sum(1 for row in bubble for i in range(0, len(row), 3) if max(row[i : i + 3]) < 90)
    assert dark > 50, "the reply bubble shows no rendered text"
