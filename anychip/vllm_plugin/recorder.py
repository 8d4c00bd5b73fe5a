"""The process-wide coverage recorder: layers register their route when prepared; the kernels count calls per
phase; a daemon thread writes coverage.json atomically while the engine runs: within a second of the engine going
idle, and at most every BUSY_FLUSH_SECONDS while it keeps stepping (a write is milliseconds of Python).

Layers whose kernels count themselves get a row of an int64 table [calls, tokens] per phase slot, which the kernel
bumps at the slot the step hook (compat.install_step_hook) writes before every model-runner step; the table is read
when the report is written. Two such tables: the C++ CPU routes' (hooks.KernelCounts, installed when the first such
layer is prepared: their ops run no Python per call), and one per CUDA device for the CUDA route (CUDA graphs replay
without Python; allocated at the first call). Other layers (the torch reference, arm.kleidiai) are counted in
Python, per call, through hooks.notify.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
import time
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anychip import envs
from anychip.coverage import (UNUSED_HEAD, Coverage, LayerRoute, platform_summary, rank_path, write_atomic,
                              write_rank_index)
from anychip.errors import AnychipError
from anychip.kernels import hooks, machine, routes
from anychip.kernels.policy import KernelPolicy
from anychip.vllm_plugin import compat
from anychip.vllm_plugin.head import PREPARED, adopt_head

logger = logging.getLogger("anychip")
FLUSH_SECONDS = 0.5  # how often the report thread looks for news
#: No model step for this long: the engine is idle, and a pending report is written at the next look.
IDLE_SECONDS = 0.1
#: While the engine keeps stepping, the report is rewritten at most this often. A write takes about 6 ms of Python
#: (building the document, JSON, the file), holding the GIL the engine thread needs: at every look (twice a second)
#: that was 1% of a batch-one CPU decode (docs/kernels-cpu.md).
BUSY_FLUSH_SECONDS = 10.0
KERNEL_TABLE_ROWS = 256  # first size of the C++ routes' table (layer ids); doubled when a model has more


class Recorder:
    """The coverage of one engine: the one whose model it saw built (`engine`, its vLLM config; a later engine in
    the same process, as vLLM runs them with VLLM_ENABLE_V1_MULTIPROCESSING=0, gets a recorder of its own, and the
    steps of an engine anychip does not serve are not counted here)."""

    def __init__(self, path: Path | None, policy: KernelPolicy, rank: int = 0, world_size: int = 1,
                 engine: Any = None) -> None:
        self.path = path
        self._engine: weakref.ref | None = None
        self._joined: list[weakref.ref] = []  # other engine configs built while this engine lived (a draft model's)
        self._active = True  # the last step was this engine's (on_step): logits then are its head's
        self.policy = policy  # built once for the engine process, passed to every layer's prepare
        strict = not policy.allow_fallback
        self.coverage = Coverage(strict=strict, fallback_allowed=not strict, platform_info=platform_summary())
        self.coverage.vllm_version = compat.vllm_version()
        self.coverage.vllm_tested = compat.VLLM_TESTED
        self.coverage.tensor_parallel = {"rank": rank, "world_size": world_size}
        self._phase = "warmup"
        self._first_layer: int | None = None
        self._embeddings: dict[str, weakref.ref] = {}  # prefix -> VocabParallelEmbedding / ParallelLMHead
        self._head_name: str | None = None
        # the module vLLM first computed logits with (compat.install_logits_hook), and its name in the model
        self._used_head: weakref.ref | None = None
        self._pooling = False  # a pooling runner: the model's output head computes nothing
        self._used_name: str | None = None
        # the served model's module, other than the head, that holds the head's weight: a tied input embedding that
        # the quantization config never saw (vLLM 0.32's Gemma builds it without one); "" when none
        self._tied_name = ""
        self._stop = threading.Event()
        self._tables: dict[torch.device, _DeviceTable] = {}
        self._counters: dict[int, hooks.DeviceCounter | None] = {}  # layer id -> its row (None: counted here)
        self._kernel_counts: hooks.KernelCounts | None = None  # the C++ routes' table
        self._in_kernel: set[int] = set()  # layer ids counted in it
        self._steps: dict[str, Counter] = {}  # phase -> forward passes, tokens (device-counted engines)
        self._device_dirty = False
        self._step_running = False  # between on_step and on_step_end of a counted step
        self._written_counts: tuple | None = None  # _count_totals of the last report written
        self._full_names: dict[str, str] = {}  # embedding prefix as noted -> its name in the served model
        self._tied_config = False  # the loaded model's config ties its head (note_model)
        # registration (model build, possibly on another thread than the report's) and document() hold it, so that
        # a report never pairs a snapshot of the layers with counters of layers the snapshot does not hold
        self._lock = threading.RLock()
        self._write_error: str | None = None  # the last failed write's error, logged once
        self._last_step = self._last_write = float("-inf")  # time.monotonic() of the last model step, write
        self._heap_trimmed = False
        self.adopt(engine)
        hooks.install(self.on_call)
        compat.install_logits_hook(self.on_logits)
        if path is not None:
            thread = threading.Thread(target=self._flush_loop, name="anychip-coverage", daemon=True)
            thread.start()
            atexit.register(self.flush)

    def adopt(self, engine: Any) -> bool:
        """Whether this recorder is `engine`'s (a vLLM config; None: unknown, as outside vLLM), taking it when it
        has none yet."""
        if engine is None:
            return True
        if self._engine is None:
            try:
                self._engine = weakref.ref(engine)
            except TypeError:
                self._engine = lambda engine=engine: engine  # type: ignore[assignment]
            self.coverage.model = compat.engine_model_name(engine)
            return True
        return self._engine() is engine or any(ref() is engine for ref in self._joined)

    def join(self, engine: Any) -> None:
        """`engine` (another config) builds layers while this recorder's engine lives: they join this report."""
        try:
            self._joined.append(weakref.ref(engine))
        except TypeError:
            self._joined.append(lambda engine=engine: engine)  # type: ignore[arg-type]

    def engine_alive(self) -> bool:
        """Whether the engine this recorder is for still exists (collecting what a deleted engine left in cycles
        first); True when it is unknown. Another engine's config while this one lives (a draft model's, a second
        engine of the process) joins this report."""
        if self._engine is None:
            return True
        if self._engine() is not None:
            gc.collect()
        return self._engine() is not None

    def retire(self) -> None:
        """Another engine of this process builds its model: this report is final (written now, not at exit, where
        it would overwrite a later engine's at the same path)."""
        self._stop.set()
        if self.path is not None:
            atexit.unregister(self.flush)
        self.flush()

    # -- filled while the model is built and loaded --
    def add_layer(self, route: LayerRoute) -> int:
        with self._lock:
            layer_id = self.coverage.add_layer(route)
            if self._first_layer is None and not route.route.startswith("vllm."):
                self._first_layer = layer_id  # the first linear our ops run in every forward pass
            if not route.route.startswith("vllm.") and routes.get(route.route).counts_in_kernel:
                self._count_in_kernel(layer_id)
            return layer_id

    def _count_in_kernel(self, layer_id: int) -> None:
        """Give the layer a row of the C++ routes' table (growing it, and installing it for the ops)."""
        table = self._kernel_counts
        if table is None or layer_id >= table.counts.shape[0]:
            grown = hooks.KernelCounts.zeros(max(KERNEL_TABLE_ROWS, 2 * (layer_id + 1)))
            if table is not None:
                grown.counts[: table.counts.shape[0]] = table.counts
                grown.slot.copy_(table.slot)
            hooks.install_kernel_counts(grown)
            self._kernel_counts = grown
            if table is None and not compat.install_step_hook(self.on_step, self.on_step_end):
                logger.warning("anychip: this vLLM has no model runner to hook: coverage phases are all counted "
                               "as warmup")
        self._in_kernel.add(layer_id)

    def note_unquantized_linear(self, prefix: str, layer: Any, ignored: bool) -> None:
        """A linear vLLM serves unquantized (BF16): in the checkpoint's ignore list, or not targeted at all."""
        why = "in the checkpoint's ignore list" if ignored else "not targeted by any quantization config group"
        self.add_layer(LayerRoute(
            name=prefix, route="vllm.unquantized", kernel="UnquantizedLinearMethod", isa="vllm", group_size=0,
            n=getattr(layer, "output_size_per_partition", 0), k=getattr(layer, "input_size_per_partition", 0),
            checkpoint_format="unquantized", quantized=False, ignored=ignored, reason=why))

    def note_embedding(self, prefix: str, layer: Any, is_head: bool) -> None:
        """Remember the output head (for its GEMM route) and the input embedding (to report tying)."""
        prefix = prefix or "embed_tokens"  # vLLM's Llama builds its input embedding without a prefix
        pooling = compat.pooling_runner()
        with self._lock:
            self._pooling = pooling
            self._embeddings[prefix] = weakref.ref(layer)
            if is_head:
                self._head_name = prefix

    def on_logits(self, lm_head: Any) -> None:
        """Before vLLM computes logits with `lm_head` (compat.install_logits_hook): at its first time, an unquantized
        CPU head that the quantization config never saw gets an anychip head route (adopt_head), and the
        module is kept as the head the report names when none was noted while the model was built."""
        if getattr(lm_head, "_anychip_logits_seen", False) or not self._active or (
                self._engine is not None and self._engine() is None):  # another engine's, or this one is gone
            return
        lm_head._anychip_logits_seen = True
        if adopt_head(lm_head, self.policy):
            logger.info("anychip: the output head vLLM built without the quantization config runs on %s",
                        getattr(lm_head, PREPARED).route.id)
        with self._lock:
            self._used_head = weakref.ref(lm_head)

    def head_route(self) -> dict[str, Any] | None:
        if self._pooling:
            return {"layer": self._head_name or "lm_head", "dtype": None, "tied_to": None, "quantized": False,
                    "route": None, "head": UNUSED_HEAD, "reason": "a pooling runner computes no logits"}
        layers = {name: ref() for name, ref in self._embeddings.items()}
        head = layers.get(self._head_name) if self._head_name else None
        others = [(name, layer) for name, layer in layers.items() if layer is not None and name != self._head_name]
        used = self._used_head() if self._used_head is not None else None
        layer_name = self._head_name or "lm_head"
        if used is None and self._used_head is not None:
            # the module that computed the logits is freed (an engine exiting, whose last report is written while
            # the model comes apart): the route read while it lived stands, not a guess from what is left
            return None
        if head is None and len(others) == 1:
            # vLLM ties a head by replacing it with the input embedding, which then computes the logits: after
            # building a head (noted, then dropped) or instead of building one (vLLM 0.26's Qwen2 and Qwen3: no
            # head layer was ever created, so none was noted)
            tied_to, head = others[0]
        elif head is None and used is not None:
            # nothing noted: the model built its head (or the embedding that computes its logits) without the
            # quantization config (vLLM 0.32's Gemma 2); it is known from the logits it computed
            head = used
            if isinstance(used, compat.ParallelLMHead):
                layer_name, tied_to = self._used_name or layer_name, self._tied_name or None
            else:  # the input embedding itself
                tied_to = self._used_name or "embed_tokens"
        elif head is None:
            return None
        else:
            weight = getattr(head, "weight", None)
            tied_to = next((name for name, other in others
                            if weight is not None and getattr(other, "weight", None) is weight), None)
            if tied_to is None and head is used:  # the embedding was built without the quantization config
                tied_to = self._tied_name or None
        weight = getattr(head, "weight", None)
        prepared = getattr(head, PREPARED, None)  # vllm_plugin/head.py: an anychip head route serves it
        route = prepared.route.id if prepared is not None else compat.head_gemm_route(head)
        quantized = prepared is not None and prepared.route.kind != "bf16"
        dtype = str(getattr(weight, "dtype", "unknown")).replace("torch.", "")
        full = self._full_names
        if tied_to is None and self._tied_config:  # tied by the config, the head's weight a copy of its own
            tied_to = next((name for name, _ in others), None)
        return {"layer": full.get(layer_name, layer_name), "dtype": dtype,
                "tied_to": full.get(tied_to, tied_to) if tied_to else tied_to, "quantized": quantized, "route": route,
                "head": prepared.route.kind if prepared is not None else "bf16"}

    # -- at run time, from inside the anychip ops --
    def on_call(self, layer_id: int, tokens: int) -> hooks.DeviceCounter | None:
        counter = self._counters[layer_id] if layer_id in self._counters else self._device_counter(layer_id)
        if counter is not None:  # the kernel counts (also at every CUDA-graph replay); nothing to count here
            if layer_id == self._first_layer and self.coverage.attention_backend is None:
                self._first_forward()
            return counter
        forward_tokens = None
        if layer_id == self._first_layer:  # the first anychip linear of every forward pass
            self._phase, forward_tokens = compat.current_phase()
            forward_tokens = forward_tokens or tokens
            if self.coverage.attention_backend is None:
                self._first_forward()
        self.coverage.record(layer_id, self._phase, tokens, forward_tokens)
        return None

    def _first_forward(self) -> None:
        """Once, in the first forward pass: the attention backend, and the output head's route."""
        self.coverage.attention_backend = compat.attention_backend_name()
        self._remember_head()

    def _name_used_head(self, runner: Any) -> None:
        """The name in the served model of the module logits were computed with (once; "" when not found)."""
        used, model = self._used_head(), compat.runner_model(runner)
        modules = list(model.named_modules()) if used is not None and model is not None else []
        name = next((n for n, m in modules if m is used), "")
        weight = getattr(used, "weight", None)
        tied = next((n for n, m in modules if m is not used and weight is not None
                     and getattr(m, "weight", None) is weight), "")
        full = self._served_names(modules)
        with self._lock:
            self._used_name = name
            self._tied_name = tied
            self._full_names.update(full)
            self.coverage.head_route = None  # read again, with the name

    def _remember_head(self) -> None:
        """Read the output head's route while the model is alive: the layers are held by weak references, which may
        be dead when an exiting engine writes its last report; that report then keeps what was read here."""
        with self._lock:
            self.coverage.head_route = self.head_route() or self.coverage.head_route

    def _device_counter(self, layer_id: int) -> hooks.DeviceCounter | None:
        """The layer's row of its device's table, allocated at the first call (every layer is prepared by then,
        and vLLM's first forward pass is eager, never a CUDA-graph capture); None to count in Python."""
        with self._lock:  # the report iterates _counters and _tables
            layer = self.coverage.layers[layer_id]
            route = routes.get(layer.route) if not layer.route.startswith("vllm.") else None
            counter = None
            if getattr(route, "counts_on_device", False) and torch.cuda.is_available():
                device = torch.device("cuda", torch.cuda.current_device())
                table = self._tables.get(device)
                if table is None and not torch.cuda.is_current_stream_capturing():
                    table = self._tables[device] = _DeviceTable(len(self.coverage.layers), device)
                    if not compat.install_step_hook(self.on_step, self.on_step_end):
                        logger.warning("anychip: this vLLM has no GPU model runner to hook: coverage phases on %s "
                                       "are all counted as warmup", device)
                if table is not None and layer_id < table.layers:
                    counter = hooks.DeviceCounter(table.counts[layer_id], table.slot)
                else:
                    logger.warning("anychip: layer %s is counted in Python: its calls inside CUDA graphs are missed",
                                   layer.name)
            self._counters[layer_id] = counter
            return counter

    def on_step(self, phase: str, tokens: int, runner: Any = None) -> None:
        """Before every model-runner step (compat.install_step_hook): the phase slot the kernels count at. An
        "idle" step (nothing scheduled: no forward pass) is not counted."""
        if runner is not None and self._engine is not None:
            config = getattr(runner, "vllm_config", None)  # the config object the model was built under, or a copy
            self._active = config is None or config is self._engine() or (
                compat.engine_model_name(config) == self.coverage.model)
            if not self._active:  # an engine of this process that anychip does not serve
                return
        if phase == "idle":
            return
        counts = self._steps.get(phase)
        if counts is None:  # a new key: not while document() iterates the dict
            with self._lock:
                counts = self._steps.setdefault(phase, Counter())
        counts["forward_passes"] += 1
        counts["tokens"] += tokens
        for table in self._tables.values():
            table.set_phase(phase)
        if self._kernel_counts is not None:
            self._kernel_counts.slot.fill_(hooks.SLOTS.index(phase))
        if self.coverage.attention_backend is None and runner is not None:
            self.coverage.attention_backend = compat.attention_backend_name(runner)
        if self._used_name is None and self._used_head is not None and runner is not None:
            self._name_used_head(runner)
        if self.coverage.head_route is None:
            self._remember_head()
        if not self._heap_trimmed and phase != "warmup" and self._kernel_counts is not None:
            self._trim_after_start()
        self._device_dirty = True
        self._step_running = True
        self._last_step = time.monotonic()

    def on_step_end(self) -> None:
        """After each model-runner step (compat.install_step_hook): the idle time that lets a report out counts
        from here, so a report is not written in the middle of a long step (a long prefill, a loaded machine),
        with that step's pass counted and only part of its layers' calls, and then left so."""
        if self._step_running:
            self._step_running = False
            self._device_dirty = True
            self._last_step = time.monotonic()

    def _served_names(self, modules: list[tuple[str, Any]]) -> dict[str, str]:
        """The noted embeddings as the served model names them: vLLM hands some over with a shorter prefix (Llama's
        input embedding: none), which made one module two names in reports of different routes."""
        return {key: next((n for n, m in modules if m is ref()), key) for key, ref in self._embeddings.items()
                if ref() is not None}

    def note_model(self, model: Any, vllm_config: Any) -> None:
        """The loaded model (the model runners' load hooks): the noted embeddings named as the served model names
        them (vLLM hands Llama's input embedding over with no prefix), and whether the config ties the head, which
        the report then says also where the head's weight is not the embedding's object (a route's own copy)."""
        modules = list(model.named_modules())
        head_ref = self._embeddings.get(self._head_name) if self._head_name else None
        head = head_ref() if head_ref is not None else None
        weight = getattr(head, "weight", None)
        tied = next((n for n, m in modules if m is not head and weight is not None
                     and getattr(m, "weight", None) is weight), "")  # an embedding the config never saw (Gemma)
        full = self._served_names(modules)
        with self._lock:
            self._full_names.update(full)
            self._tied_config = compat.ties_word_embeddings(vllm_config)
            self._tied_name = self._tied_name or tied
            self.coverage.dirty = True

    def _trim_after_start(self) -> None:
        """Once, at the first step that serves a request (loading, compiling and warm-up are over): the freed heap
        those left behind goes back to the OS (CPU engines, the C++ routes' processes)."""
        self._heap_trimmed = True
        t0 = time.perf_counter()
        returned = machine.trim_heap()
        if returned is not None:
            logger.info("anychip: returned %.0f MiB of freed start-up heap to the OS (%.1f ms)", returned / 2**20,
                        1e3 * (time.perf_counter() - t0))

    def document(self) -> dict[str, Any]:
        with self._lock:
            self._remember_head()  # or keep what was read while the model was alive
            for layer_id, what in hooks.fused_layers().items():
                if layer_id < len(self.coverage.layers):
                    self.coverage.layers[layer_id].fused = tuple(sorted(what))
            doc = self.coverage.snapshot()
            simd = machine.inductor_simd()  # what the compiled graph's own kernels were generated for
            if simd is not None:
                doc["platform"] = {**doc["platform"], "inductor_simd": simd}
            calls = doc.get("attention_calls")
            if calls and calls.get("prefill_kernel"):  # the C++ op counts the layer calls its kernel served
                doc["attention_calls"] = {**calls, "prefill_kernel_calls": int(torch.ops.anychip.attn_prefill_calls())}
            if self._tables or self._kernel_counts is not None:
                self._device_dirty = self._step_running  # a step in flight: its calls go out with the next write
                self._written_counts = self._merge_device_counts(doc)
            return doc

    def _count_totals(self, tables: dict | None = None, in_kernel: np.ndarray | None = None) -> tuple:
        """What the kernel-counted layers and the step hook have counted, in sums: a report whose totals differ is
        out of date (calls that landed after it was written: a GPU step's kernels after execute_model returned, the
        warm-up's calls counted before the first step hook). In numpy: this runs on the report thread, where a
        torch op can leave an OpenMP team that aborts the process at exit ("terminate called without an active
        exception": 4 of 40 exits of a script summing a tensor on a daemon thread, none with numpy)."""
        if tables is None:
            tables = {device: table.read() for device, table in self._tables.items()}
        if in_kernel is None and self._kernel_counts is not None:
            in_kernel = self._kernel_counts.counts.numpy()
        sums = [int(t.sum()) for t in tables.values()] + ([int(in_kernel.sum())] if in_kernel is not None else [])
        return tuple(sums), tuple((p, c["forward_passes"]) for p, c in list(self._steps.items()))

    def counts_changed(self) -> bool:
        """Whether kernel counts moved since the report was last written (the report thread asks when nothing
        marked the report dirty)."""
        if not (self._tables or self._kernel_counts is not None) or self._written_counts is None:
            return False
        return self._count_totals() != self._written_counts

    def _merge_device_counts(self, doc: dict[str, Any]) -> tuple:
        """Kernel-counted layers' calls and rows, and the step hook's passes and tokens per phase, into `doc`;
        returns their totals (_count_totals)."""
        tables = {device: table.read() for device, table in self._tables.items()}
        in_kernel = self._kernel_counts.counts.numpy().copy() if self._kernel_counts is not None else None
        rows = {layer_id: tables[counter.cell.device][layer_id]
                for layer_id, counter in self._counters.items() if counter is not None}
        rows |= {layer_id: in_kernel[layer_id] for layer_id in self._in_kernel}
        for layer_id, counts in rows.items():  # counts: (slots, 2)
            entry = doc["layers"][self.coverage.layers[layer_id].name]
            entry["calls"] = {p: int(counts[i, 0]) for i, p in enumerate(hooks.SLOTS) if counts[i, 0]}
            entry["tokens"] = {p: int(counts[i, 1]) for i, p in enumerate(hooks.SLOTS) if counts[i, 0]}
        doc["phases"] = {p: {"forward_passes": c["forward_passes"], "tokens": c["tokens"]}
                         for p, c in self._steps.items()}
        return self._count_totals(tables, in_kernel)

    def write_due(self, now: float) -> bool:
        """Whether a pending report goes out at time.monotonic() `now`: the engine is idle, or has been stepping
        for BUSY_FLUSH_SECONDS since the last write."""
        idle = not self._step_running and now - self._last_step >= IDLE_SECONDS
        return idle or now - self._last_write >= BUSY_FLUSH_SECONDS

    def note_refusal(self, message: str) -> None:
        """The engine is refused (EngineRefusal): recorded in the report, written now."""
        with self._lock:
            self.coverage.refused = message
            self.coverage.dirty = True
        self.flush()

    def flush(self) -> None:
        if self.path is not None:
            self._last_write = time.monotonic()
            try:
                write_atomic(self.path, self.document())
            except Exception as exc:  # never take the engine (or the report thread) down for a report
                self.coverage.dirty = True  # what this write missed goes out with the next one
                if repr(exc) != self._write_error:  # retried every FLUSH_SECONDS: each new failure logged once
                    logger.warning("anychip: could not write coverage report %s: %r", self.path, exc)
                self._write_error = repr(exc)
            else:
                self._write_error = None

    def _flush_loop(self) -> None:
        while not self._stop.wait(FLUSH_SECONDS):
            now = time.monotonic()
            if not (self.coverage.dirty or self._device_dirty) and not self._step_running and self.counts_changed():
                self._device_dirty = True
            if (self.coverage.dirty or self._device_dirty) and self.write_due(now):
                self.flush()


class _DeviceTable:
    """counts (layers, len(SLOTS), 2) int64 [calls, rows] and slot (1,) int32 on one device, for the process
    lifetime: CUDA graphs hold their addresses."""

    def __init__(self, layers: int, device: torch.device) -> None:
        self.layers = layers
        # made at the first forward pass, inside vLLM's inference mode: as normal tensors, so that the step hook
        # and the report thread (outside it) may write them
        with torch.inference_mode(False):
            self.counts = torch.zeros((layers, len(hooks.SLOTS), 2), dtype=torch.int64, device=device)
            self.slot = torch.zeros(1, dtype=torch.int32, device=device)
            self._host = torch.empty(self.counts.shape, dtype=torch.int64, pin_memory=True)
        self._phase = hooks.SLOTS[0]
        self._stream: torch.cuda.Stream | None = None
        self._read_lock = threading.Lock()

    def set_phase(self, phase: str) -> None:
        """Written on the current stream, so it lands between the previous step's kernels and the next's."""
        if phase != self._phase and not torch.cuda.is_current_stream_capturing():
            self.slot.fill_(hooks.SLOTS.index(phase))
            self._phase = phase

    def read(self) -> np.ndarray:
        """A host copy of counts, made on a side stream so that the engine's stream never waits for it."""
        with self._read_lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.counts.device)
            with torch.cuda.stream(self._stream):
                self._host.copy_(self.counts, non_blocking=True)
            self._stream.synchronize()
            return self._host.numpy().copy()  # numpy from here on: see Recorder._count_totals


_recorder: Recorder | None = None
_lock = threading.Lock()


class EngineRefusal(AnychipError, RuntimeError):
    """An error that stops the engine while the model is built or loaded (strict mode, damaged weights): its
    message goes into the coverage report as `refused` when it is made, so the report an engine that never started
    writes says why, instead of an empty strict report over the last good one."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        if _recorder is not None:
            _recorder.note_refusal(message)


def note_model(model: torch.nn.Module, vllm_config: Any) -> None:
    """The model runners' load hooks: the loaded model to this process's recorder, if any (Recorder.note_model)."""
    if _recorder is not None:
        _recorder.note_model(model, vllm_config)


def get_recorder() -> Recorder:
    global _recorder
    with _lock:
        engine = compat.current_vllm_config()
        if _recorder is not None and not _recorder.adopt(engine):
            if _recorder.engine_alive():  # a draft model's config, or a second live engine: this report
                _recorder.join(engine)
            else:  # a later engine of this process, the earlier one gone: a report of its own
                _recorder.retire()
                _recorder = None
        if _recorder is None:
            path = envs.coverage_path()
            rank, world = compat.tensor_parallel()  # the model is built after vLLM set up its groups
            if path is not None and world > 1:
                if rank == 0:  # the file the user named lists every rank's report
                    write_rank_index(path, world)
                path = rank_path(path, rank)
            _recorder = Recorder(path, envs.kernel_policy(), rank, world, engine)
        return _recorder
