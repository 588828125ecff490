"""Count what is compiled or planned on the serving path after warm-up.

A kernel that Triton compiles for a new specialisation, or a cuDNN attention plan built for a new
shape, costs tens to hundreds of milliseconds inside a request: the slow turns at new lengths that
warm-up exists to prevent. The warm-up arms the watch when it is done; from then each compilation
or plan is counted in the stats (``compiles_after_warmup``, ``plans_after_warmup``; ``/metrics``
``sluice_compilations_total``) and logged in one line that names it, so a slow turn says why.

Triton's hook is process-wide (``triton.knobs.runtime.jit_post_compile_hook``), so the watch is one
per process, like the library state it observes; cuDNN has no hook, so the attention path reports
each shape it has not run before (``note_plan``), and torch's plan cache sees the same keys.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("sluice.worker")


@dataclass
class CompileWatch:
    armed: bool = False
    compiles: int = 0
    compiles_after_warmup: int = 0
    plans_after_warmup: int = 0
    plan_keys: set = field(default_factory=set)

    def on_compile(self, name: str, detail: str = "") -> None:
        """A Triton kernel was compiled (called from Triton's hook, or by a test)."""
        self.compiles += 1
        if self.armed:
            self.compiles_after_warmup += 1
            log.warning("compiled after warm-up: Triton kernel %s%s", name, f" ({detail})" if detail else "")

    def note_plan(self, kind: str, key: tuple) -> None:
        """A ``kind`` plan (e.g. cuDNN attention) is about to run with shape ``key``."""
        if (kind, key) in self.plan_keys:
            return
        self.plan_keys.add((kind, key))
        if self.armed:
            self.plans_after_warmup += 1
            log.warning("planned after warm-up: %s plan for %s", kind, key)

    def stats(self) -> dict[str, int]:
        return {"compiles_total": self.compiles, "compiles_after_warmup": self.compiles_after_warmup,
                "plans_total": len(self.plan_keys), "plans_after_warmup": self.plans_after_warmup}


WATCH = CompileWatch()


def install() -> CompileWatch:
    """Hook Triton's compiler (once; any hook set before is still called) and return the watch."""
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without knobs: nothing compiles that the watch could see
        return WATCH
    before = knobs.runtime.jit_post_compile_hook
    if getattr(before, "sluice_watch", False):
        return WATCH

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        # the whole specialisation (argument types, divisibility, constants): cut, it hid which differed
        WATCH.on_compile(getattr(fn, "name", repr(fn)), str(kwargs.get("repr", "")))
        return before(*args, **kwargs) if before is not None else None

    hook.sluice_watch = True
    knobs.runtime.jit_post_compile_hook = hook
    return WATCH


def arm() -> None:
    """Warm-up is done: from now on, count and log."""
    WATCH.armed = True
