"""mla_fast: the fast path (planner, CPU emulation, Triton kernel, peer adapters). Imports are lazy: no triton here."""

from importlib import import_module

_EXPORTS = {
    "plan_decode": "mla_fast.planner",
    "WorkPlan": "mla_fast.planner",
    "run_plan_reference": "mla_fast.emulate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mla_fast' has no attribute {name!r}")
