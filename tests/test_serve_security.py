"""`anychip serve`'s guards, without vLLM: API keys, the non-loopback refusal, --verify modes, the ready message,
and what it says when the server dies (a stand-in server process plays the dying engine)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from anychip import envs, serve
from anychip.checkpoint.io import read_tensor_infos
from anychip.checkpoint.manifest import write_manifest
from anychip.checkpoint.quantize import quantize_checkpoint
from anychip.checkpoint.scheme import W4A8Scheme
from anychip.cli import main

KEY = "k3y-that-must-not-leak-0123"


@pytest.fixture(autouse=True)
def no_ambient_keys(monkeypatch):
    for name in (envs.ANYCHIP_API_KEY, "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def bf16(tiny_llama) -> Path:
    return tiny_llama()  # not compressed-tensors: serve skips verify and goes straight to the command


@pytest.fixture(scope="module")
def w4a8(tiny_llama, tmp_path_factory) -> Path:
    return quantize_checkpoint(tiny_llama(), tmp_path_factory.mktemp("serve") / "w4a8", W4A8Scheme(64))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "my-host.example"])
def test_non_loopback_without_key_is_refused(bf16, capsys, host):
    assert main(["serve", str(bf16), "--host", host, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"--host {host}" in err and "--api-key KEY" in err and "--insecure" in err


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_needs_no_key(bf16, capsys, host):
    assert main(["serve", str(bf16), "--host", host, "--dry-run"]) == 0
    assert "api key" not in capsys.readouterr().out


def test_insecure_opt_in_is_announced(bf16, capsys):
    assert main(["serve", str(bf16), "--host", "0.0.0.0", "--insecure", "--dry-run"]) == 0
    assert "api key   NONE on 0.0.0.0 (--insecure)" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["flag", "anychip-env", "vllm-env"])
def test_key_allows_any_host_and_never_prints(bf16, capsys, monkeypatch, how):
    argv = ["serve", str(bf16), "--host", "0.0.0.0", "--dry-run"]
    if how == "flag":
        argv += ["--api-key", KEY]
    else:
        monkeypatch.setenv(envs.ANYCHIP_API_KEY if how == "anychip-env" else "VLLM_API_KEY", KEY)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "api key   required on every route but /health and /ping" in out and KEY not in out
    assert f"--middleware {serve.GUARD}" in out  # vLLM itself guards /v1, /v2, /inference and /cohere only


class FakeProc:
    """Stands in for the vLLM server: records how it was started, exits at once with `rc`."""

    started: list[tuple[list[str], dict[str, str]]] = []

    def __init__(self, cmd, env=None, **kwargs):
        FakeProc.started.append((cmd, env))
        self.returncode = 0

    def wait(self, timeout=None):
        return self.returncode

    def poll(self):
        return self.returncode

    def send_signal(self, signum):
        pass


def test_key_reaches_vllm_in_its_environment_only(bf16, monkeypatch, capsys):
    FakeProc.started.clear()
    monkeypatch.setattr(serve.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(serve, "_wait_ready", lambda *a, **k: False)
    assert main(["serve", str(bf16), "--host", "0.0.0.0", "--api-key", KEY]) == 1  # exit 0 unasked: reported
    ((cmd, env),) = FakeProc.started
    assert env["VLLM_API_KEY"] == KEY
    assert KEY not in " ".join(cmd) and "--api-key" not in cmd  # argv is readable by every user (ps)
    assert KEY not in capsys.readouterr().out


def _damaged(w4a8: Path, tmp_path: Path) -> Path:
    import shutil

    import torch

    d = tmp_path / "w4a8-nan-scale"
    shutil.copytree(w4a8, d)
    info = read_tensor_infos(d)["model.layers.0.mlp.up_proj.weight_scale"]
    with open(info.file, "r+b") as f:
        f.seek(info.start)
        f.write(torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    write_manifest(d)  # checksums agree with the damage: only the value pass sees it
    return d


def test_coverage_is_promised_only_where_anychip_serves(w4a8, bf16, capsys):
    """A model the plugin serves no layer of (BF16, another quantization) gets no recorder, so no report: serve
    must not name a path that will never be written."""
    assert main(["serve", str(w4a8), "--dry-run", "--coverage", "/tmp/x.json"]) == 0
    assert "coverage  /tmp/x.json" in capsys.readouterr().out
    assert main(["serve", str(bf16), "--dry-run", "--coverage", "/tmp/x.json"]) == 0
    out = capsys.readouterr().out
    assert "coverage  none: " in out and "/tmp/x.json" not in out.split("coverage  ")[1].splitlines()[0]
    assert "coverage report" not in serve.ready_message("http://h:1", "m", "", None)


def test_verify_modes(w4a8, tmp_path, capsys):
    assert main(["serve", str(w4a8), "--dry-run"]) == 0
    assert "checksums OK, values OK" in capsys.readouterr().out
    bad = _damaged(w4a8, tmp_path)
    assert main(["serve", str(bad), "--dry-run"]) == 2  # full by default
    assert "model.layers.0.mlp.up_proj.weight_scale[0, 0] = nan" in capsys.readouterr().err
    assert main(["serve", str(bad), "--dry-run", "--verify", "fast"]) == 0
    assert "values not checked (--verify fast)" in capsys.readouterr().out
    assert main(["serve", str(bad), "--dry-run", "--verify", "none"]) == 0
    assert "verify    skipped (--verify none)" in capsys.readouterr().out


def _edited(w4a8: Path, tmp_path: Path, name: str, edit) -> Path:
    import json
    import shutil

    d = tmp_path / name
    shutil.copytree(w4a8, d)
    config = json.loads((d / "config.json").read_text())
    edit(config)
    (d / "config.json").write_text(json.dumps(config))
    write_manifest(d)  # checksums agree with the edit: only the contract sees it
    return d


def test_an_edited_anychip_checkpoint_is_verified_not_waved_through(w4a8, tmp_path, capsys):
    """A checkpoint anychip made whose config was edited to something that is not W4A8 is verified (and refused,
    naming the change), not served by stock vLLM routes as "not a compressed-tensors checkpoint"."""
    def asymmetric(c):
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False

    def static(c):
        c["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = False

    import json

    assert "anychip" in json.loads((w4a8 / "config.json").read_text())["quantization_config"]
    for name, edit, match in (("asym", asymmetric, "symmetric"), ("static", static, "dynamic")):
        assert main(["serve", str(_edited(w4a8, tmp_path, name, edit)), "--dry-run"]) == 2
        captured = capsys.readouterr()
        assert match in captured.err and "stock vLLM" not in captured.out, (name, captured)


def test_what_is_not_anychips_is_named_for_what_it_is(bf16, w4a8, tmp_path, capsys):
    assert main(["serve", str(bf16), "--dry-run"]) == 0
    assert "is not quantized (no quantization_config): served by stock vLLM routes" in capsys.readouterr().out

    def foreign(c):
        c["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}

    assert main(["serve", str(_edited(w4a8, tmp_path, "gptq", foreign)), "--dry-run"]) == 0
    assert "quantized as 'gptq', not as anychip's W4A8" in capsys.readouterr().out


def test_a_server_that_ignores_the_stop_is_stopped_with_its_group(tmp_path):
    """vLLM's server ignores a SIGTERM during its start-up: escalate_stop signals the whole process group again,
    then kills it. A stand-in server that ignores SIGTERM and has a child of its own."""
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        for _ in range(100):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        child = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)  # ignored, as vLLM does during start-up
        t0 = time.monotonic()
        sent: list[int] = []
        serve.escalate_stop(proc, grace_s=1.0, sent=sent)
        assert proc.poll() is not None and time.monotonic() - t0 < 10
        assert sent == [signal.SIGTERM, signal.SIGKILL]
        for _ in range(50):  # the child went with the group (and was reaped by init)
            try:
                os.kill(child, 0)  # ProcessLookupError once it is gone
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the server's child outlived the stop")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ready_message_uses_served_model_name_and_key_header():
    cov = Path("/tmp/cov.json")
    assert serve.served_name(Path("/m/w4a8-g32"), []) == "w4a8-g32"
    assert serve.served_name(Path("/m/w4a8-g32"), ["--served-model-name", "smol", "other"]) == "smol"
    assert serve.served_name(Path("/m/w4a8-g32"), ["--enforce-eager", "--served-model-name=smol"]) == "smol"
    msg = serve.ready_message("http://127.0.0.1:8000", "smol", "", cov)
    assert '"model": "smol"' in msg and "Authorization" not in msg
    msg = serve.ready_message("http://127.0.0.1:8000", "smol", envs.ANYCHIP_API_KEY, cov)
    assert '-H "Authorization: Bearer $ANYCHIP_API_KEY"' in msg
    assert '-H "Authorization: Bearer KEY"' in serve.ready_message("http://h:1", "smol", "--api-key", cov)


@pytest.mark.parametrize("code, rc, words", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL, "was killed by SIGKILL"),
    ("raise SystemExit(247)", 247, "exited with status 247 (its engine process was killed"),
    ("raise SystemExit(3)", 3, "exited with status 3"),
    ("pass", 1, "exited with status 0 before anything asked it to stop"),
])
def test_server_death_is_named(bf16, monkeypatch, capsys, code, rc, words):
    monkeypatch.setattr(serve, "server_command", lambda *a, **k: ([sys.executable, "-c", code], {}))
    monkeypatch.setattr(serve, "_wait_ready", lambda *a, **k: False)
    assert main(["serve", str(bf16), "--port", "9"]) == rc
    err = capsys.readouterr().err
    assert "anychip serve: error: the vLLM server " + words in err and "log above names the cause" in err


def test_exit_after_a_requested_stop_is_quiet():
    assert serve.exit_reason(0, asked_to_stop=True) is None
    assert serve.exit_reason(-signal.SIGTERM, asked_to_stop=True) is None
    assert serve.exit_reason(1, asked_to_stop=True) is not None  # a failed shutdown is still reported
    # a server that kept waiting on open streams after the stop, ended by anychip serve itself: a stop, not a death
    assert serve.exit_reason(-signal.SIGKILL, asked_to_stop=True, escalated=True) is None
    assert "killed by SIGKILL" in serve.exit_reason(-signal.SIGKILL, asked_to_stop=True)  # killed by someone else


@pytest.mark.parametrize("port", [0, -1, 65536, 99999])
def test_a_port_out_of_range_is_refused_before_the_server_starts(port):
    from anychip.errors import AnychipError

    with pytest.raises(AnychipError, match=f"--port {port}: give a TCP port from 1 to 65535"):
        serve.port_free("127.0.0.1", port)


def test_cache_directories_are_user_only(bf16, tmp_path, monkeypatch):
    from anychip.checkpoint.cache import cache_lock

    monkeypatch.setenv(envs.ANYCHIP_CACHE, str(tmp_path / "home" / ".cache" / "anychip" / "models"))
    monkeypatch.setattr(serve.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(serve, "_wait_ready", lambda *a, **k: False)
    (tmp_path / "home").mkdir(mode=0o755)
    with cache_lock(envs.cache_dir() / "some-model"):
        pass
    main(["serve", str(bf16)])  # creates the default coverage folder in the cache
    made = [tmp_path / "home" / ".cache", *(tmp_path / "home" / ".cache").rglob("*")]
    dirs = [d for d in made if d.is_dir()]
    assert {d.name for d in dirs} >= {".cache", "anychip", "models", "some-model", "coverage"}
    assert all(d.stat().st_mode & 0o777 == 0o700 for d in dirs), {str(d): oct(d.stat().st_mode) for d in dirs}
    assert (tmp_path / "home").stat().st_mode & 0o777 == 0o755  # an existing directory is left as it was


def test_no_key_no_guard(bf16, capsys):
    assert main(["serve", str(bf16), "--dry-run"]) == 0
    assert "--middleware" not in capsys.readouterr().out


def test_a_port_in_use_is_refused_before_anything_starts(bf16, monkeypatch, capsys):
    import socket

    monkeypatch.setattr(serve.subprocess, "Popen", lambda *a, **k: pytest.fail("started a server"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", str(bf16), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--port" in err


def test_the_default_coverage_report_is_named_by_model_and_port(bf16, capsys):
    assert main(["serve", str(bf16), "--port", "18123", "--dry-run"]) == 0
    assert f"coverage/{bf16.name}-18123.json" in capsys.readouterr().out


def _asgi(guard, path: str, method: str = "GET", headers: tuple = ()) -> int:
    """The status the guard answers `path` with (200: passed on to the app)."""
    import asyncio

    sent: list[dict] = []

    async def run() -> None:
        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": list(headers)}
        await guard(scope, None, send)

    asyncio.run(run())
    return sent[0]["status"]


def test_the_guard_asks_every_route_but_the_health_probes_for_the_key(monkeypatch):
    from anychip.vllm_plugin.guard import KeyOnEveryRoute

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    monkeypatch.setenv("VLLM_API_KEY", KEY)
    guard = KeyOnEveryRoute(app)
    good = ((b"authorization", f"Bearer {KEY}".encode()),)
    for path in ("/invocations", "/tokenize", "/detokenize", "/metrics", "/v1/completions", "/anything"):
        assert _asgi(guard, path) == 401, path
        assert _asgi(guard, path, headers=((b"authorization", b"Bearer wrong"),)) == 401, path
        assert _asgi(guard, path, headers=((b"Authorization", f"bearer {KEY}".encode()),)) == 200, path
        assert _asgi(guard, path, headers=good) == 200, path
    for path in ("/health", "/ping", "/health/"):
        assert _asgi(guard, path) == 200, path
    assert _asgi(guard, "/invocations", method="OPTIONS") == 200  # CORS preflights carry no credentials
    monkeypatch.delenv("VLLM_API_KEY")
    assert _asgi(KeyOnEveryRoute(app), "/invocations") == 200  # no key configured: nothing to guard


@pytest.mark.parametrize("env, strict", [({}, True), ({"ANYCHIP_STRICT": "0"}, False),
                                         ({"ANYCHIP_ALLOW_FALLBACK": "no"}, True),
                                         ({"ANYCHIP_ALLOW_FALLBACK": "yes"}, False),
                                         ({"ANYCHIP_STRICT": "off", "ANYCHIP_ALLOW_FALLBACK": "0"}, False)])
def test_the_strict_line_is_what_the_engine_will_do(w4a8, capsys, monkeypatch, env, strict):
    """serve's banner and the engine judge the same variables the same way (ANYCHIP_STRICT=0 allows the fallback
    too), and the engine gets the answer spelled out."""
    for name in (envs.ANYCHIP_STRICT, envs.ANYCHIP_ALLOW_FALLBACK):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", str(w4a8), "--verify", "none", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("strict    on:" in out) is strict and ("strict    off:" in out) is not strict
    assert f"env       ANYCHIP_ALLOW_FALLBACK={0 if strict else 1}" in out


@pytest.mark.parametrize("name, value, says", [("ANYCHIP_HEAD", "int4", "head='int4'"),
                                               ("ANYCHIP_KERNEL_ISA", "avx-512", "unknown kernel route 'avx-512'"),
                                               ("ANYCHIP_ALLOW_FALLBACK", "maybe", "is not a boolean"),
                                               ("ANYCHIP_GPU_TUNE", "always", "ANYCHIP_GPU_TUNE"),
                                               ("ANYCHIP_STRICT", "1", "contradict each other")])
def test_a_bad_anychip_variable_is_named_before_the_server_starts(w4a8, capsys, monkeypatch, name, value, says):
    if name == "ANYCHIP_STRICT":  # strict said on, and the fallback allowed: which one did the user mean?
        monkeypatch.setenv("ANYCHIP_ALLOW_FALLBACK", "1")
    monkeypatch.setenv(name, value)
    assert main(["serve", str(w4a8), "--verify", "none", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("anychip serve:") == 1, err


def test_a_forced_route_this_machine_lacks_is_named_before_the_server_starts(w4a8, capsys, monkeypatch):
    from anychip.kernels import routes

    missing = next((r for r in routes.ROUTES if r.unavailable() is not None), None)
    if missing is None:
        pytest.skip("every route is available on this machine")
    monkeypatch.setenv("ANYCHIP_KERNEL_ISA", missing.id)
    assert main(["serve", str(w4a8), "--verify", "none", "--dry-run"]) == 2
    assert f"kernel route {missing.id!r} is not available on this machine" in capsys.readouterr().err
    assert main(["serve", str(w4a8), "--verify", "none", "--dry-run", "--allow-fallback"]) == 0


def test_the_server_imports_anychip_from_a_folder_holding_a_clone_of_it(tmp_path):
    """probe 49: `anychip serve` run from the folder that holds the clone (~ with ~/anychip) started vLLM in that
    folder, whose `anychip/` directory shadowed the editable install as an empty namespace package, and vLLM died
    importing the plugin. The server's interpreter keeps the current folder off sys.path (-P)."""
    import subprocess

    (tmp_path / "anychip").mkdir()  # a clone's root: no __init__.py at its top
    cmd, _ = serve.server_command(Path("/m"), "127.0.0.1", 8000, [])
    python = cmd[:cmd.index("-m")]
    out = subprocess.run(python + ["-c", "import anychip; print(anychip.__version__)"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-500:]


def test_a_w4a8_folder_with_another_config_fails_its_checksums_at_serve(w4a8, bf16, tmp_path, capsys):
    """probe 49: a W4A8 folder whose config.json was replaced by the BF16 one read as a plain model: serve skipped
    every check and would have started vLLM on it. A folder with SHA256SUMS has it checked whatever its config."""
    import shutil

    swapped = Path(shutil.copytree(w4a8, tmp_path / "swapped"))
    shutil.copyfile(bf16 / "config.json", swapped / "config.json")
    assert main(["serve", str(swapped), "--dry-run"]) == 2
    assert "config.json" in capsys.readouterr().err
    from anychip.checkpoint.manifest import write_manifest

    release = Path(shutil.copytree(bf16, tmp_path / "bf16-release"))
    write_manifest(release)  # an intact BF16 release passes the same check
    assert main(["serve", str(release), "--dry-run"]) == 0
    assert "SHA256SUMS OK" in capsys.readouterr().out
