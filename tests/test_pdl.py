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
# What a kernel may read before its wait (the names its early loads are assigned to): the one-row
# projection's weights (no kernel writes them), and the fp8 and 4-bit per-token downs' routing and weights (the
# launch before its gate_up wrote the last of them; a fill's gate_up writes w2 rows, and then EARLY is off), and
# the RoPE decode attention's index reads (row lengths, positions: a model's step writes them before its first layer),
# and the decode attention's merge's row length (the launch before it, the partial kernel, never writes it).
EARLY_LOADS = {"gemv_kernel": {"w_all"}, "_down_fp8_kernel": {"early"}, "_down_token_w4_kernel": {"early"},
               "decode_rope_partial_kernel": {"early"}, "decode_reduce_kernel": {"early"}}


def pdl_kernels() -> dict[str, tuple[ast.FunctionDef, dict[str, ast.FunctionDef]]]:
    """Each kernel that takes PDL, with the functions of its file (the helpers it may call)."""
    found = {}
    for path in [*ROOT.glob("worker/**/*.py"), *ROOT.glob("moe_offload/**/*.py")]:
        functions = {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        for node in functions.values():
            if any(a.arg == "PDL" for a in node.args.args):
                found[f"{path.relative_to(ROOT)}:{node.name}"] = node, functions
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


def access_kind(call: ast.Call, helpers: dict[str, ast.FunctionDef], seen: frozenset = frozenset()) -> str | None:
    """"load" or "write" when the call reads or writes memory (a helper of the same file: any of
    its calls does, "write" if one writes), else None."""
    name = ast.unparse(call.func)
    if name == "tl.load":
        return "load"
    if name == "tl.store" or name.startswith("tl.atomic_"):
        return "write"
    if name not in helpers or name in seen:
        return None
    kinds = {access_kind(n, helpers, seen | {name}) for n in ast.walk(helpers[name]) if isinstance(n, ast.Call)}
    return "write" if "write" in kinds else "load" if "load" in kinds else None


def wait_problem(fn: ast.FunctionDef, helpers: dict[str, ast.FunctionDef] | None = None) -> str | None:
    """Why ``fn`` may touch memory another kernel writes before its wait (None: it does not)."""
    helpers = helpers or {}
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    wait = next((i for i, s in enumerate(body) if is_wait_block(s)), None)
    if wait is None:
        return "takes PDL but never waits"
    if any(isinstance(n, ast.Return) for s in body[:wait] for n in ast.walk(s)):
        # a program that ends before its wait lets the next kernel start before the one before it has
        # finished: the next kernel's early reads (two launches back) would race
        return "returns before the wait"
    allowed = EARLY_LOADS.get(fn.name, set())
    assigned_to = {}  # each call inside an assignment's value: the names it is assigned to
    for n in (n for s in body[:wait] for n in ast.walk(s) if isinstance(n, ast.Assign)):
        names = {t.id for target in n.targets for t in ast.walk(target) if isinstance(t, ast.Name)}
        assigned_to.update({id(c): names for c in ast.walk(n.value) if isinstance(c, ast.Call)})
    for call in (n for s in body[:wait] for n in ast.walk(s) if isinstance(n, ast.Call)):
        kind = access_kind(call, helpers)
        if kind is not None and (kind != "load" or not assigned_to.get(id(call), set()) & allowed):
            return f"{ast.unparse(call)} before the wait"
    return None


def test_every_pdl_kernel_waits_before_it_touches_memory():
    kernels = pdl_kernels()
    # norm, projection, RoPE, attention x2, experts x4, sum over k, top-k, lookup, gather, sampler
    assert len(kernels) >= 14, sorted(kernels)
    problems = {name: wait_problem(fn, helpers) for name, (fn, helpers) in kernels.items()}
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
    ("def k(x, PDL):\n    if c:\n        return\n    pdl_wait(PDL)\n", "returns before the wait"),
], ids=["load-first", "no-wait", "weights-first", "store-first", "helper-wait", "return-first"])
def test_the_check_finds_early_accesses(source, problem):
    assert wait_problem(ast.parse(source).body[0]) == problem


HELPERS = """
def read(x):
    return tl.minimum(tl.load(x), 3)

def write(x):
    tl.store(x, 1)

def both(x):
    write(x)
    return read(x)
"""


@pytest.mark.parametrize("kernel, problem", [
    ("def k(x, PDL):\n    y = read(x)\n    pdl_wait(PDL)\n", "read(x) before the wait"),
    ("def gemv_kernel(x, PDL):\n    w_all = read(x)\n    pdl_wait(PDL)\n", None),
    ("def gemv_kernel(x, PDL):\n    w_all = both(x)\n    pdl_wait(PDL)\n", "both(x) before the wait"),
    ("def gemv_kernel(x, PDL):\n    q = read(x)\n    pdl_wait(PDL)\n", "read(x) before the wait"),
    ("def k(x, PDL):\n    pdl_wait(PDL)\n    write(x)\n", None),
], ids=["helper-load", "allowed-helper-load", "helper-write", "not-allowed-name", "after-wait"])
def test_the_check_follows_helpers_of_the_file(kernel, problem):
    """Loads and stores inside the file's helpers count as the kernel's own, transitively."""
    module = ast.parse(HELPERS + kernel)
    helpers = {n.name: n for n in module.body if isinstance(n, ast.FunctionDef)}
    assert wait_problem(module.body[-1], helpers) == problem


def test_pdl_is_off_on_the_cpu_and_by_switch(monkeypatch):
    assert pdl_args(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}
    if torch.cuda.is_available():
        x = torch.zeros(1, device="cuda")
        monkeypatch.setenv(PDL_ENV, "0")
        assert pdl_args(x) == {"PDL": False, "launch_pdl": False}
        monkeypatch.setenv(PDL_ENV, "1")
        on = torch.cuda.get_device_capability()[0] >= 9
        assert pdl_args(x) == {"PDL": on, "launch_pdl": on}
