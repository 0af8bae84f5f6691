"""Imports inside avatar_cli run one way: the module graph, built from the source with `ast`, has no cycle.

Every import counts, the ones inside functions too (an import placed in a function to dodge a cycle is still a
cycle), as do imports under `if TYPE_CHECKING:`. Relative imports are resolved; `from pkg import name` is an edge to
pkg.name when that is a submodule, else to pkg. A package's `__init__` is a module of its own, and importing pkg.sub
also imports pkg (Python runs pkg/__init__ first), unless the importer is inside pkg (then pkg is already loading).
"""

import ast
from pathlib import Path

PACKAGE = "avatar_cli"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, anywhere in its file."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a non-module attribute: its module
                target = target.rpartition(".")[0]
            while target.startswith(PACKAGE) and target != name and not is_inside(name, target):
                out.add(target)
                target = target.rpartition(".")[0]  # its packages' __init__ run first
    return out


def is_inside(name: str, package: str) -> bool:
    return name.startswith(package + ".")


def import_graph() -> dict[str, set[str]]:
    known = module_names()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, plus one cycle path."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def visit(v: str) -> None:  # recursive: the graph is a few hundred modules deep at most
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(comps)


def cycle_path(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One import cycle through the component's first module, for the message: a -> b -> ... -> a."""
    members, start = set(comp), comp[0]
    paths, queue = {start: [start]}, [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return comp


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles in avatar_cli:\n" + "\n".join(
        f"  {' -> '.join(cycle_path(graph, c))}  (component: {', '.join(c)})" for c in found)


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """The builder itself: an import inside a function, a relative import and `from pkg import submodule`."""
    known = {"avatar_cli.a": tmp_path / "a.py", "avatar_cli.b": tmp_path / "b.py",
             "avatar_cli.p": tmp_path / "p" / "__init__.py", "avatar_cli.p.c": tmp_path / "p" / "c.py"}
    (tmp_path / "p").mkdir()
    known["avatar_cli.a"].write_text("def f():\n    from avatar_cli.b import thing\n")
    known["avatar_cli.b"].write_text("from .p import c\n")
    known["avatar_cli.p"].write_text("")
    known["avatar_cli.p.c"].write_text("from .. import a\nfrom . import nothing_here\n")
    graph = {n: imports_of(n, p, known) for n, p in known.items()}
    assert graph == {"avatar_cli.a": {"avatar_cli.b"}, "avatar_cli.b": {"avatar_cli.p.c", "avatar_cli.p"},
                     "avatar_cli.p": set(), "avatar_cli.p.c": {"avatar_cli.a"}}
    assert cycles(graph) == [["avatar_cli.a", "avatar_cli.b", "avatar_cli.p.c"]]
    assert cycle_path(graph, cycles(graph)[0]) == ["avatar_cli.a", "avatar_cli.b", "avatar_cli.p.c", "avatar_cli.a"]
