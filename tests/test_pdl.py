"""Programmatic dependent launch (``triton_support.pdl_args``): a kernel launched with it may run
beside the kernel before it, so every kernel that takes the ``PDL`` constexpr must wait for that
kernel (``gdc_wait``) before its first access that another kernel could write. Read from the
source: a launch that passes ``**pdl_args(x)`` to a kernel without the parameter fails in Triton,
so the kernels with the parameter are all the kernels that can launch early."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from moe_offload.kernels.triton_support import PDL_ENV, pdl_args

ROOT = Path(__file__).resolve().parents[1]
# What a kernel may read before its wait: the one-row projection's weights (no kernel writes them).
EARLY_LOADS = {"gemv_kernel": {"w_all"}}


def pdl_kernels() -> dict[str, ast.FunctionDef]:
    found = {}
    for path in [*ROOT.glob("worker/**/*.py"), *ROOT.glob("moe_offload/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                found[f"{path.relative_to(ROOT)}:{node.name}"] = node
    return found


def is_wait_block(stmt: ast.stmt) -> bool:
    """``if PDL: tl.extra.cuda.gdc_wait(); tl.extra.cuda.gdc_launch_dependents()``, or the call
    ``pdl_wait(PDL)`` (``kernels.decode_tiles``, itself such a block)."""
    if isinstance(stmt, ast.Expr) and ast.unparse(stmt) == "pdl_wait(PDL)":
        return True
    if not (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Name) and stmt.test.id == "PDL"):
        return False
    calls = [ast.unparse(s) for s in stmt.body]
    return calls == ["tl.extra.cuda.gdc_wait()", "tl.extra.cuda.gdc_launch_dependents()"]


def wait_problem(fn: ast.FunctionDef) -> str | None:
    """Why ``fn`` may touch memory another kernel writes before its wait (None: it does not)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    wait = next((i for i, s in enumerate(body) if is_wait_block(s)), None)
    if wait is None:
        return "takes PDL but never waits"
    early = [n for s in body[:wait] for n in ast.walk(s)
             if isinstance(n, ast.Call) and ast.unparse(n.func).startswith(("tl.load", "tl.store", "tl.atomic"))]
    allowed = EARLY_LOADS.get(fn.name, set())
    assigned_to = {id(n.value): {t.id for t in n.targets if isinstance(t, ast.Name)}
                   for s in body[:wait] for n in ast.walk(s) if isinstance(n, ast.Assign)}
    for call in early:
        if ast.unparse(call.func) != "tl.load" or not assigned_to.get(id(call), set()) & allowed:
            return f"{ast.unparse(call)} before the wait"
    return None


def test_every_pdl_kernel_waits_before_it_touches_memory():
    kernels = pdl_kernels()
    # norm, projection, RoPE, attention x2, experts x4, sum over k, top-k, lookup, gather, sampler
    assert len(kernels) >= 14, sorted(kernels)
    problems = {name: wait_problem(fn) for name, fn in kernels.items()}
    assert not any(problems.values()), problems


@pytest.mark.parametrize("source, problem", [
    ("def k(x, PDL):\n    y = tl.load(x)\n    if PDL:\n        tl.extra.cuda.gdc_wait()\n"
     "        tl.extra.cuda.gdc_launch_dependents()\n", "tl.load(x) before the wait"),
    ("def k(x, PDL):\n    tl.store(x, 1)\n", "takes PDL but never waits"),
    ("def gemv_kernel(x, PDL):\n    if c:\n        w_all = tl.load(x)\n    if PDL:\n"
     "        tl.extra.cuda.gdc_wait()\n        tl.extra.cuda.gdc_launch_dependents()\n", None),
    ("def gemv_kernel(x, PDL):\n    w_all = tl.load(x)\n    tl.store(x, w_all)\n    if PDL:\n"
     "        tl.extra.cuda.gdc_wait()\n        tl.extra.cuda.gdc_launch_dependents()\n",
     "tl.store(x, w_all) before the wait"),
    ("def k(x, PDL):\n    pdl_wait(PDL)\n    tl.store(x, 1)\n", None),
], ids=["load-first", "no-wait", "weights-first", "store-first", "helper-wait"])
def test_the_check_finds_early_accesses(source, problem):
    assert wait_problem(ast.parse(source).body[0]) == problem


def test_pdl_is_off_on_the_cpu_and_by_switch(monkeypatch):
    assert pdl_args(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}
    if torch.cuda.is_available():
        x = torch.zeros(1, device="cuda")
        monkeypatch.setenv(PDL_ENV, "0")
        assert pdl_args(x) == {"PDL": False, "launch_pdl": False}
        monkeypatch.setenv(PDL_ENV, "1")
        on = torch.cuda.get_device_capability()[0] >= 9
        assert pdl_args(x) == {"PDL": on, "launch_pdl": on}
