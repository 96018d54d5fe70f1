"""The import arrows of ``src/kvshare`` run one way: no circles, and none of the arrows the
layout forbids (see docs/development.md, "Layout").

For the layout every import counts, wherever it is written (top level, inside a function,
under ``TYPE_CHECKING``): an arrow deferred to run time, or kept to type checking, is an
arrow all the same. A circle is one among the imports that run (``TYPE_CHECKING`` blocks
left out): the one that leaves a module half-initialised when another imports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Set
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

DP = "kvshare.deviceplugin"
#: The node agent's parts and the parts each may import (besides ``kvshare.api`` and the
#: standard library). The broker knows nothing of Kubernetes, the kubelet or the admin
#: side; the admin side reads the broker's views; the kubelet and cluster sides count
#: their calls in the node's metrics (``admin.metrics``); ``agent``/``node_cli`` wire all.
PARTS: dict[str, set[str]] = {
    f"{DP}.inventory": set(),
    f"{DP}.stop_signals": set(),
    f"{DP}.broker": {f"{DP}.inventory"},
    f"{DP}.admin": {f"{DP}.broker", f"{DP}.inventory"},
    f"{DP}.kubelet": {f"{DP}.inventory", f"{DP}.admin"},
    f"{DP}.cluster": {f"{DP}.broker", f"{DP}.admin", f"{DP}.inventory"},
}
#: Third-party packages of Kubernetes (and of the kubelet's gRPC API) the broker must not
#: reach, directly or through anything it imports.
KUBERNETES = {"kubernetes", "kubernetes_validate", "kopf", "grpc", "grpc_tools"}
#: The three programs: none imports another.
PROGRAMS = ("kvshare.runtime", "kvshare.deviceplugin", "kvshare.operator")
TWIN = "kvshare.twin"
#: What the GPU twin may import: the demo's simulated engine and node, the real pools, the
#: broker (its books and policy) and the shared vocabulary; nothing of the node agent's
#: kubelet, cluster or admin side, nor the operator.
TWIN_IMPORTS = (TWIN, "kvshare.demo", "kvshare.runtime", f"{DP}.broker", "kvshare.api")
#: Who may import the twin: the command line and the demo (which shows its capacity).
TWIN_USERS = (TWIN, "kvshare.cli", "kvshare.demo")


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def graph(src: Path = SRC) -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """Module -> the kvshare modules it imports; the same without ``TYPE_CHECKING``
    blocks (what runs); and module -> the top-level packages outside kvshare it imports."""
    files = {module_name(p, src): p for p in sorted((src / "kvshare").rglob("*.py"))}
    internal: dict[str, set[str]] = {}
    running: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = imports(path, package, files.keys())
        ours = {(_owner(m, files), runs) for m, runs in found if m.split(".")[0] == "kvshare"}
        internal[name] = {m for m, _ in ours} - {name}
        running[name] = {m for m, runs in ours if runs} - {name}
        external[name] = {m.split(".")[0] for m, _ in found if m.split(".")[0] != "kvshare"}
    return internal, running, external


def imports(path: Path, package: str, modules: Set[str]) -> set[tuple[str, bool]]:
    """The modules the file at ``path`` (in ``package``) imports, each with whether the
    import runs (False: under ``if TYPE_CHECKING:``)."""
    found: set[tuple[str, bool]] = set()

    def visit(node: ast.AST, runs: bool) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test):
            for statement in node.body:
                visit(statement, False)
            for statement in node.orelse:
                visit(statement, runs)
            return
        if isinstance(node, ast.Import):
            found.update((alias.name, runs) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from package import module`` is an arrow to the module.
            submodules = {f"{base}.{a.name}" for a in node.names} & modules
            found.update((m, runs) for m in submodules or {base})
        for child in ast.iter_child_nodes(node):
            visit(child, runs)

    visit(ast.parse(path.read_text(encoding="utf-8")), True)
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _owner(module: str, files: Mapping[str, Path]) -> str:
    """The module file that defines ``module`` (a name imported from it otherwise)."""
    while module not in files and "." in module:
        module = module.rpartition(".")[0]
    return module


def circles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def reach(start: str, edges: Mapping[str, Iterable[str]]) -> set[str]:
    """``start`` and every module it imports, directly or not."""
    seen = {start}
    pending = [start]
    while pending:
        for target in edges.get(pending.pop(), ()):
            if target not in seen:
                seen.add(target)
                pending.append(target)
    return seen


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def part_of(module: str) -> str | None:
    return next((part for part in PARTS if within(module, part)), None)


def forbidden_arrows(edges: Mapping[str, Iterable[str]]) -> list[str]:
    """The arrows between the node agent's parts, and between the programs, that the
    layout forbids, as ``importer -> imported``."""
    bad = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            source_part, target_part = part_of(source), part_of(target)
            if (
                source_part is not None
                and target_part not in (None, source_part)
                and target_part not in PARTS[source_part]
            ):
                bad.append(f"{source} -> {target}")
            for program in PROGRAMS:
                if within(source, program) and any(
                    within(target, other) for other in PROGRAMS if other != program
                ):
                    bad.append(f"{source} -> {target}")
            if within(source, "kvshare.api") and not within(target, "kvshare.api"):
                bad.append(f"{source} -> {target}")
            if within(source, TWIN) and not any(within(target, p) for p in TWIN_IMPORTS):
                bad.append(f"{source} -> {target}")
            if within(target, TWIN) and not any(within(source, p) for p in TWIN_USERS):
                bad.append(f"{source} -> {target}")
    return bad


def test_no_module_of_src_imports_itself_through_others() -> None:
    _, running, _ = graph()
    assert circles(running) == []


def test_the_node_agents_parts_the_programs_the_api_and_the_twin_import_only_inward() -> None:
    internal, _, _ = graph()
    assert forbidden_arrows(internal) == []


def test_the_broker_reaches_nothing_of_kubernetes() -> None:
    internal, _, external = graph()
    for module in sorted(m for m in internal if within(m, f"{DP}.broker")):
        reached = {
            f"{m} imports {package}"
            for m in reach(module, internal)
            for package in external[m] & KUBERNETES
        }
        assert not reached, module


@pytest.mark.parametrize("program", ["kvshare.deviceplugin", "kvshare.operator"])
def test_the_node_agent_and_the_operator_never_import_torch(program: str) -> None:
    internal, _, external = graph()
    for module in sorted(m for m in internal if within(m, program)):
        reached = {m for m in reach(module, internal) if "torch" in external[m]}
        assert not reached, f"{module} reaches torch through {sorted(reached)}"


def test_the_checks_see_an_arrow_the_layout_forbids_and_a_circle() -> None:
    # The broker's server importing the cluster side, as it once did for the pods'
    # policies, and a circle between two modules.
    edges = {
        f"{DP}.broker.server": {f"{DP}.cluster.pod_policies"},
        f"{DP}.cluster.pod_policies": {f"{DP}.broker.books"},
    }
    assert forbidden_arrows(edges) == [f"{DP}.broker.server -> {DP}.cluster.pod_policies"]
    # The twin reaching the node agent's kubelet side, and the runtime reaching the twin.
    assert forbidden_arrows(
        {f"{TWIN}.worlds": {f"{DP}.kubelet.plugin"}, "kvshare.runtime.pool": {f"{TWIN}.gpus"}}
    ) == [f"kvshare.runtime.pool -> {TWIN}.gpus", f"{TWIN}.worlds -> {DP}.kubelet.plugin"]
    edges[f"{DP}.broker.books"] = {f"{DP}.broker.server"}
    assert circles(edges) == [
        [f"{DP}.broker.books", f"{DP}.broker.server", f"{DP}.cluster.pod_policies"]
    ]
