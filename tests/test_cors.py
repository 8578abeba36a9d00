"""CORS for a browser page on another origin (a support site's chat widget): off by default
(no CORS headers), `lantau serve --allowed-origins` answers the preflight before the API key
is asked for, marks the answers (errors too) for the allowed origins and no others; the
flags' values checked at start."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from lantau.bench.echo_engine import EchoEngine
from lantau.server.app import ServerConfig, build_app

SITE = "https://support.example.com"
PREFLIGHT = {
    "Origin": SITE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
BODY = {"model": "lantau", "prompt": "hi", "max_tokens": 2}


def client(**cors) -> TestClient:
    config = ServerConfig(grpc_port=0, api_keys=("secret",), **cors)
    return TestClient(build_app(EchoEngine(), config))


def test_allowed_origin_preflight_and_answers():
    c = client(allowed_origins=(SITE,))
    pre = c.options("/v1/completions", headers=PREFLIGHT)
    assert pre.status_code == 200  # no API key on a preflight
    assert pre.headers["access-control-allow-origin"] == SITE
    assert "POST" in pre.headers["access-control-allow-methods"]
    auth = {"Origin": SITE, "Authorization": "Bearer secret"}
    r = c.post("/v1/completions", json=BODY, headers=auth)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == SITE
    denied = c.post("/v1/completions", json=BODY, headers={"Origin": SITE})
    assert denied.status_code == 401  # the page can read why
    assert denied.headers["access-control-allow-origin"] == SITE


def test_other_origins_and_the_default_get_no_cors():
    c = client(allowed_origins=(SITE,))
    other = c.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.test"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    plain = client()
    r = plain.post("/v1/completions", json=BODY,
                   headers={"Origin": SITE, "Authorization": "Bearer secret"})  # fmt: skip
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert plain.options("/v1/completions", headers=PREFLIGHT).status_code in (401, 405)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--allowed-origins", "https://a.com"], "--allowed-origins: expected a JSON list"),
        (["--allowed-methods", '["GET", 3]'], "--allowed-methods: expected a JSON list"),
        (["--allowed-origins", '["*"]', "--allow-credentials"], "--allow-credentials: name the"),
    ],
)
def test_bad_flags_stop_the_start(flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "lantau.cli", "serve", "random:tiny", *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and message in result.stderr, result.stderr
