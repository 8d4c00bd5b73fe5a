"""The route registry: every kernel route, in order of preference, and the one rule that picks a route.

Adding a route is one file in this folder and one line in ROUTES. A route is chosen per linear, once, at load:
a forced route (KernelPolicy.route) must be able to serve or it is an error, never a silent downgrade; otherwise
the first route in ROUTES whose `can_serve` says yes; otherwise the reference when the policy allows fallback,
else an error that gives every route's reason and the fix.
"""

from __future__ import annotations

from anychip import envs
from anychip.kernels.policy import KernelPolicy
from anychip.kernels.routes.arm_neon import ArmDotprod, ArmI8mm
from anychip.kernels.routes.base import LinearProblem, NoKernelRoute, Route
from anychip.kernels.routes.cpu_x86 import AmxInt8, Avx2, Avx512Vnni, Portable
from anychip.kernels.routes.cuda_triton import CudaTriton
from anychip.kernels.routes.kleidiai import ArmKleidiAI
from anychip.kernels.routes.reference import Reference

#: Best first within a device; routes of other devices are skipped.
ROUTES: tuple[Route, ...] = (
    AmxInt8(),
    Avx512Vnni(),
    Avx2(),
    ArmI8mm(),
    ArmDotprod(),
    ArmKleidiAI(),
    Portable(),
    CudaTriton(),
    Reference(),
)
REFERENCE: Route = next(r for r in ROUTES if r.id == "reference")
_BY_NAME: dict[str | int, Route] = {name: r for r in ROUTES for name in (r.id, *r.aliases, r.code)}


def route_ids() -> tuple[str, ...]:
    return tuple(r.id for r in ROUTES)


def get(name: str | int) -> Route:
    """The route with this id, alias or op code (Route.code); NoKernelRoute naming the valid ids otherwise."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise NoKernelRoute(f"unknown kernel route {name!r}: use one of {route_ids()} "
                            f"(e.g. {envs.ANYCHIP_KERNEL_ISA}=cpu.avx2)") from None


def preferred(device: str) -> list[Route]:
    """The fast routes for a device type, best first (the reference is never listed)."""
    return [r for r in ROUTES if r.device == device and not r.fallback_only]


def available(device: str = "cpu") -> list[Route]:
    """The fast routes this machine can run for a device type, best first."""
    return [r for r in preferred(device) if r.unavailable() is None]


def select(problem: LinearProblem, policy: KernelPolicy) -> Route:
    """The route for one linear under `policy` (see the module docstring)."""
    if policy.route is not None:
        forced = get(policy.route)  # a name no route has is a typo, an error whatever the fallback setting
        try:
            return _forced(problem, forced)
        except NoKernelRoute:
            if policy.allow_fallback:
                return REFERENCE
            raise
    candidates = preferred(problem.device)
    reasons = [(r, r.off_by(policy) or r.can_serve(problem)) for r in candidates]
    chosen = next((r for r, why in reasons if why is None), None)
    if chosen is not None:
        return chosen
    if policy.allow_fallback:
        return REFERENCE
    runnable = [(r, why) for r, why in reasons if r.unavailable() is None] or reasons
    detail = "; ".join(f"{r.id}: {why}" for r, why in runnable) or f"no route serves {problem.device} tensors"
    raise NoKernelRoute(
        f"no fast kernel route serves N={problem.n}, K={problem.k}, G={problem.group_size} on {problem.device} "
        f"({detail}). To proceed, fix the cause, or allow the slow reference route "
        f"({envs.ANYCHIP_ALLOW_FALLBACK}=1, anychip serve --allow-fallback)")


def _forced(problem: LinearProblem, route: Route) -> Route:
    if route.fallback_only:
        return route
    if route.device != problem.device:
        others = ", ".join(r.id for r in available(problem.device)) or "none"  # those this machine has
        raise NoKernelRoute(f"kernel route {route.id!r} serves {route.device} tensors but the weights are on "
                            f"{problem.device}: set {envs.ANYCHIP_KERNEL_ISA} to one of ({others}) or unset it")
    if why := route.unavailable():
        here = ", ".join(r.id for r in available(problem.device)) or "none"
        raise NoKernelRoute(f"kernel route {route.id!r} is not available on this machine ({why}; available: "
                            f"{here}): unset {envs.ANYCHIP_KERNEL_ISA} or set it to one of those")
    if why := route.rejects(problem):
        raise NoKernelRoute(f"kernel route {route.id!r} cannot serve N={problem.n}, K={problem.k}, "
                            f"G={problem.group_size}: {why}")
    return route


__all__ = ["ROUTES", "REFERENCE", "KernelPolicy", "LinearProblem", "NoKernelRoute", "Route", "available", "get",
           "preferred", "route_ids", "select"]
