"""The process-wide coverage recorder: layers register their route when prepared; the kernels' call hook
counts calls per phase; a daemon thread writes coverage.json atomically while the engine runs."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from pathlib import Path
from typing import Any

from anychip import envs
from anychip.coverage import Coverage, LayerRoute, platform_summary, write_atomic
from anychip.kernels import hooks
from anychip.vllm_plugin import compat

logger = logging.getLogger("anychip")
FLUSH_SECONDS = 0.5


class Recorder:
    def __init__(self, path: Path | None, strict: bool) -> None:
        self.path = path
        self.coverage = Coverage(strict=strict, fallback_allowed=not strict, platform_info=platform_summary())
        self.coverage.vllm_version = compat.vllm_version()
        self._phase = "warmup"
        self._embeddings: dict[str, weakref.ref] = {}  # prefix -> VocabParallelEmbedding / ParallelLMHead
        self._head_name: str | None = None
        self._stop = threading.Event()
        hooks.install(self.on_call)
        if path is not None:
            thread = threading.Thread(target=self._flush_loop, name="anychip-coverage", daemon=True)
            thread.start()
            atexit.register(self.flush)

    # -- filled while the model is built and loaded --
    def add_layer(self, route: LayerRoute) -> int:
        return self.coverage.add_layer(route)

    def note_embedding(self, prefix: str, layer: Any, is_head: bool) -> None:
        """Remember the output head (for its GEMM route) and the input embedding (to report tying)."""
        prefix = prefix or "embed_tokens"  # vLLM's Llama builds its input embedding without a prefix
        self._embeddings[prefix] = weakref.ref(layer)
        if is_head:
            self._head_name = prefix

    def head_route(self) -> dict[str, Any] | None:
        layers = {name: ref() for name, ref in self._embeddings.items()}
        head = layers.get(self._head_name) if self._head_name else None
        if head is None:
            return None
        weight = getattr(head, "weight", None)
        tied_to = next((name for name, other in layers.items() if other is not None and name != self._head_name
                        and weight is not None and getattr(other, "weight", None) is weight), None)
        return {"layer": self._head_name, "dtype": str(getattr(weight, "dtype", "unknown")).replace("torch.", ""),
                "tied_to": tied_to, "quantized": False, "route": compat.head_gemm_route(head)}

    # -- at run time, from inside the anychip ops --
    def on_call(self, layer_id: int, tokens: int) -> None:
        forward_tokens = None
        if layer_id == 0:  # the first quantized linear of every forward pass
            self._phase, forward_tokens = compat.current_phase()
            forward_tokens = forward_tokens or tokens
            if self.coverage.attention_backend is None:
                self.coverage.attention_backend = compat.attention_backend_name()
        self.coverage.record(layer_id, self._phase, tokens, forward_tokens)

    def document(self) -> dict[str, Any]:
        self.coverage.head_route = self.head_route()
        return self.coverage.snapshot()

    def flush(self) -> None:
        if self.path is not None:
            try:
                write_atomic(self.path, self.document())
            except OSError as exc:  # never take the engine down for a report
                logger.warning("anychip: could not write coverage report %s: %s", self.path, exc)

    def _flush_loop(self) -> None:
        while not self._stop.wait(FLUSH_SECONDS):
            if self.coverage.dirty:
                self.flush()


_recorder: Recorder | None = None
_lock = threading.Lock()


def get_recorder() -> Recorder:
    global _recorder
    with _lock:
        if _recorder is None:
            _recorder = Recorder(envs.coverage_path(), strict=not envs.fallback_allowed())
        return _recorder
