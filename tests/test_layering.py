"""The shape of the code, checked from its source: packages depend one way (protocol on
nothing of ours, engine on neither rtvoice nor protocol), modules form no import circle
(imports inside functions count: they only hide one), and nothing in the engine patches
another module's attributes or keeps a `global` switch — which kernels run is decided by
the `Ops` an engine is built with."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "rtvoice", "protocol", "clients", "bench_latency")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path) -> set[str]:
    """Project modules imported anywhere in the file (but under `if TYPE_CHECKING`)."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        graph[mod] = {m for m in _imports(path) if m in files and m != mod}
    return graph


def test_packages_depend_one_way():
    for mod, deps in _graph().items():
        top = {d.split(".")[0] for d in deps}
        if mod.startswith("protocol"):
            assert top <= {"protocol"}, (mod, deps)
        if mod.startswith("engine"):
            assert not top & {"rtvoice", "protocol", "clients"}, (mod, deps)


def test_test_and_bench_tools_stay_off_the_runtime_path():
    """What only tests, benches and the fixture check use is imported by nothing else:
    the runtime (the service, the engine) never loads it."""
    graph = _graph()
    tools = {"engine.codec.reference_checks": {"engine.verify_reference"},
             "rtvoice.testing": set()}
    for tool, allowed in tools.items():
        users = {m for m, deps in graph.items() if tool in deps}
        assert users <= allowed, (tool, users - allowed)
    for mod, deps in graph.items():
        if mod.split(".")[0] in ("engine", "rtvoice", "protocol"):
            assert not any(d.startswith("bench_latency") for d in deps), mod


def test_no_import_circles():
    graph = _graph()
    # Tarjan's strongly connected components: any with more than one module is a circle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            # a package's __init__ re-exporting its own submodules is not a circle
            if v.startswith(w + "."):
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    assert not circles, f"import circles: {circles}"


def _root(node: ast.AST) -> str | None:
    """The name an attribute/subscript chain starts from (`a` of `a.b[c].d`)."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


# torch keeps some settings process-wide; these are the engine's only writes into them, and
# none picks a kernel for one engine behind another's back:
ALLOWED = {
    # dynamo's per-function recompile limit: raised (never lowered) so that the fused ops'
    # few shape specialisations fit
    ("engine/fusion.py", "_allow_recompiles"),
    # cuDNN's autotuner, on around a big codec pass's first run only (under a lock),
    # restored after it
    ("engine/codec/streaming.py", "_cudnn_plans"),
    # the reference checks (a command, and its test helper) run with TF32 off, as the
    # reference did
    ("engine/verify_reference.py", "main"),
    ("engine/codec/reference_checks.py", "deterministic"),
    # CC / CXX around the csrc extension's build only (torch's build reads its compilers
    # from the environment), restored after it
    ("engine/kernels/toolchain.py", "_set_environ"),
}


def test_no_module_switches_in_the_engine():
    """No `global` statements, no module-level mutable state written from a function, and no
    write into what another module holds (`module.NAME = ...`, `module.STATE[k] = ...`,
    `setattr(module.X, ...)`): the old process-wide kernel switches did exactly that."""
    for path in (ROOT / "engine").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
        top_level = {t.id for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign)
                     for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                     if isinstance(t, ast.Name)}
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            if (str(path.relative_to(ROOT)), fn.name) in ALLOWED:
                continue
            for node in ast.walk(fn):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                assert not isinstance(node, ast.Global), f"{where}: global"
                targets: list[ast.AST] = []
                if isinstance(node, ast.Assign):
                    targets = list(node.targets)
                elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                        and node.func.id == "setattr" and node.args:
                    targets = [ast.Attribute(value=node.args[0], attr="?")]
                for t in targets:
                    if isinstance(t, ast.Attribute | ast.Subscript):
                        root = _root(t)
                        assert root not in imported and root not in top_level, \
                            f"{where}: writes into {root!r}, state outside this object"
