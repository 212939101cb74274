"""The package's import graph: every module of dsv3 can be read, and imported, without a cycle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dsv3_imports() -> dict[str, set[str]]:
    """Each dsv3 module → the dsv3 modules it imports, anywhere in it (a function's lazy import included)."""
    modules = {}
    for path in (ROOT / "dsv3").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            if cycle := visit(imported):
                return cycle
        path.pop()
        done.add(module)
        return None

    return next((c for m in sorted(graph) if (c := visit(m))), None)


def test_no_dsv3_module_imports_itself_through_others():
    graph = dsv3_imports()
    assert {"dsv3.model", "dsv3.moe", "dsv3.lowp.quant", "dsv3.lowp.fp8_kernels"} <= set(graph)
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_model_and_the_optimizer_import_nothing_of_low_precision():
    graph = dsv3_imports()
    for module in ("dsv3.model", "dsv3.moe", "dsv3.token_copies", "dsv3.loss", "dsv3.optim"):
        assert not {m for m in graph[module] if m.startswith("dsv3.lowp")}, module


def test_pyproject_lists_what_the_requirements_files_list():
    """pyproject.toml's dependencies (and its dev extra) are requirements.txt's (and requirements-dev.txt's own)."""
    import tomllib

    def specs(path: str) -> set[str]:
        lines = (line.split("#")[0].strip() for line in (ROOT / path).read_text().splitlines())
        return {line.replace(" ", "") for line in lines if line and not line.startswith("-r")}

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["dependencies"]) == specs("requirements.txt")
    assert set(project["optional-dependencies"]["dev"]) == specs("requirements-dev.txt")
