"""The HTTP parser `lantau serve` runs under: httptools, as lantau's install provides
(uvicorn[standard]); without it uvicorn falls back to h11 and the server says so."""

from __future__ import annotations

import importlib.util

import uvicorn

from lantau.server.app import http_parser


def test_the_install_gives_uvicorn_httptools():
    assert http_parser() == "httptools"
    # the class uvicorn's "auto" picks for the server, the same parser
    config = uvicorn.Config(app=lambda *_: None)
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"


def test_without_httptools_the_parser_is_h11(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "httptools" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert http_parser() == "h11"
