"""The kernel policy: which route a caller forces and whether the torch reference may stand in.

Built once at the top (the CLI from its flags, the vLLM plugin from its environment: `anychip.envs.kernel_policy`)
and passed down; nothing under anychip/kernels reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelPolicy:
    """route: a route id (or a short alias such as "avx2") every linear must take; None picks the best that
    can serve.  allow_fallback: when no fast route can serve a linear, use the reference route instead of
    refusing.  build_dir: where the C++ extension is compiled and cached (None: ~/.cache/anychip/torch_extensions).
    """

    route: str | None = None
    allow_fallback: bool = False
    build_dir: Path | None = None

    def forcing(self, route: str | None) -> KernelPolicy:
        """This policy with `route` forced (None keeps the policy's own)."""
        return self if route is None else KernelPolicy(route, self.allow_fallback, self.build_dir)
