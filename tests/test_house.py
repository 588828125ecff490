"""The house (issue 32): no import loops between the project's files, and no function over 40
lines outside its kernels, read from the source's syntax trees. A Triton kernel (a function under
``triton.jit``) is exempt, and so are its lines inside a function that builds it."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("frontend", "scheduler", "worker", "moe_offload", "scripts")
MAX_LINES = 40


def modules() -> dict[str, ast.Module]:
    """Every source file of ``PACKAGES`` by its dotted name (a package by its own name)."""
    trees = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            trees[name] = ast.parse(path.read_text(), str(path))
    return trees


def imported(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The project's files that ``name`` imports at module level (``import a.b``, ``from a import b``
    where ``a.b`` is a file, and relative imports)."""
    package = name.split(".") if tree_is_package(name, known) else name.split(".")[:-1]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def tree_is_package(name: str, known: set[str]) -> bool:
    return any(other.startswith(name + ".") for other in known)


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of files that import one another, each as sorted names: a file is in a loop when
    it reaches itself, and its loop is every file it reaches that reaches it back."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for step in graph.get(todo.pop(), ()):
                if step not in seen:
                    seen.add(step)
                    todo.append(step)
        return seen

    reachable = {name: reach(name) for name in graph}
    groups = {frozenset(m for m in reachable[n] if n in reachable[m]) for n in graph if n in reachable[n]}
    return sorted(sorted(group) for group in groups)


def is_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def own_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The function's lines less those of the kernels defined inside it."""
    inner = sum(n.end_lineno - n.lineno + 1 for n in ast.walk(fn)
                if n is not fn and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_kernel(n))
    return fn.end_lineno - fn.lineno + 1 - inner


def test_no_import_loops_between_files():
    trees = modules()
    known = set(trees)
    graph = {name: imported(name, tree, known) for name, tree in trees.items()}
    assert loops(graph) == []


def test_no_function_over_40_lines_outside_kernels():
    long = [f"{name}:{fn.lineno} {fn.name} ({own_lines(fn)} lines)" for name, tree in modules().items()
            for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not is_kernel(fn) and own_lines(fn) > MAX_LINES]
    assert long == []


def test_the_checks_see_a_loop_and_a_long_function():
    """The checks can fail: a two-file loop and a 41-line function are found."""
    assert loops({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    fn = ast.parse("def f():\n" + "    x = 1\n" * 40).body[0]
    kernel = ast.parse("@triton.jit\ndef k():\n" + "    x = 1\n" * 50).body[0]
    builder = ast.parse("def b():\n    @triton.jit\n    def k():\n" + "        x = 1\n" * 50 + "    return k\n").body[0]
    assert own_lines(fn) == 41 and is_kernel(kernel) and own_lines(builder) == 3
    trees = {"p.a": ast.parse("from p import b\n"), "p.b": ast.parse("from . import a\n"), "p": ast.parse("")}
    graph = {name: imported(name, tree, set(trees)) for name, tree in trees.items()}
    assert graph["p.a"] == graph["p.b"] - {"p.a"} | {"p.b"} == {"p", "p.b"} and loops(graph) == [["p.a", "p.b"]]
