"""A served key guards every route: `anychip serve --api-key` on the tiny synthetic checkpoint, where vLLM alone
checks the key under /v1, /v2, /inference and /cohere only and answers SageMaker's /invocations, /tokenize and
/metrics without it. The guard (vllm_plugin/guard.py, passed as vLLM's --middleware) leaves the health probes open."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from conftest import model_cache
from serve_process import anychip_serve

pytestmark = pytest.mark.slow
KEY = "s3rved-key-0123"


def _status(port: int, path: str, body: dict | None = None, key: str | None = None) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_key_guards_every_route_but_health(tmp_path, monkeypatch):
    from anychip.bench.server import free_port
    from anychip.checkpoint.synthetic import PRESETS, make_synthetic

    model = make_synthetic(PRESETS["tiny"], cache=model_cache()).path
    port = free_port()
    monkeypatch.setenv("ANYCHIP_API_KEY", KEY)
    args = ["--coverage", str(tmp_path / "coverage.json"), "--verify", "fast", "--enforce-eager",
            "--max-model-len", "256"]
    completion = {"model": model.name, "prompt": [1000, 1001, 1002], "max_tokens": 1}
    with anychip_serve(model, port, args, tmp_path / "serve.log", 900, ready_path="/health"):
        assert _status(port, "/health") == 200
        assert _status(port, "/v1/models") == 401 and _status(port, "/v1/models", key=KEY) == 200
        for path, body in (("/invocations", completion), ("/tokenize", {"model": model.name, "prompt": "hi"}),
                           ("/metrics", None)):
            assert _status(port, path, body) == 401, path
            assert _status(port, path, body, key="wrong") == 401, path
        assert _status(port, "/invocations", completion, key=KEY) == 200
        assert _status(port, "/metrics", key=KEY) == 200
