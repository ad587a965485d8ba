"""The import rule (docs/architecture.md, "Code map"): ``cli -> concept <- plugins``; the family packages
import the core, never the reverse, nor each other; the core imports no plugin. Each module also imports
on its own, as the first module of a fresh interpreter (an import circle fails there)."""
import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"concept": "concept", "cli": "concept_cli", "plugins": "concept_plugins"}  # folder -> installed name
FAMILIES = ("streaming", "planner")
APPLICATIONS = ("recipes",)


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            found[".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))] = path
    return found


def imported(module: str, path: Path) -> set[str]:
    """The project modules ``module`` imports (top level and inside functions), as absolute names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            names |= {f"{target}.{alias.name}" for alias in node.names}  # `from . import x`: maybe a module
    return {n for n in names if n.split(".")[0] in PACKAGES.values()}


def part(module: str) -> str:
    """core | a family | recipes | cli | plugins."""
    top, _, rest = module.partition(".")
    if top == "concept_cli":
        return "cli"
    if top == "concept_plugins":
        return "plugins"
    sub = rest.split(".")[0]
    return sub if sub in FAMILIES + APPLICATIONS else "core"


ALLOWED = {  # who may import whom
    "core": {"core"},
    **{family: {"core", family} for family in FAMILIES},
    "recipes": {"core", "recipes", *FAMILIES},
    "plugins": {"core", "plugins", *FAMILIES},
    "cli": {"core", "cli", *FAMILIES, "recipes"},
}


def test_imports_run_one_way():
    found = modules()
    wrong = []
    for module, path in found.items():
        for target in imported(module, path):
            if target not in found and target.rpartition(".")[0] not in found:
                continue  # a name, not a module
            to = part(target if target in found else target.rpartition(".")[0])
            if to not in ALLOWED[part(module)]:
                wrong.append(f"{module} ({part(module)}) imports {target} ({to})")
    assert not wrong, "\n".join(wrong)


def test_the_rule_can_fail():  # negative control: a core module importing a family is caught
    assert "streaming" not in ALLOWED["core"] and part("concept.streaming.model") == "streaming"
    assert part("concept.training") == "core" and part("concept_plugins.attention.flex") == "plugins"


SCRIPT = """
import importlib, json, sys
failed = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m.split(".")[0] in ("concept", "concept_cli", "concept_plugins")]:
        del sys.modules[loaded]  # every project module afresh (torch and the rest stay loaded: faster)
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed))
"""


def test_every_module_imports_first():
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(list(modules()))], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


def lazy_imports_without_a_reason(source: str) -> list[int]:
    """Lines of the imports of the project's own modules made inside a function (``import`` in a ``def``)
    without a ``# lazy: REASON`` comment on the line above the block of imports they belong to."""
    lines = source.split("\n")
    missing = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
        spans = {n.lineno: n.end_lineno for n in body}
        for n in body:
            own = n.level > 0 if isinstance(n, ast.ImportFrom) else False
            names = [n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]
            if not own and not any(name.split(".")[0] in PACKAGES.values() for name in names):
                continue  # a third-party import (e.g. matplotlib, peft): not this rule's business
            first = n.lineno
            while any(end == first - 1 for end in spans.values()):  # the block of imports above it
                first = next(start for start, end in spans.items() if end == first - 1)
            if not lines[first - 2].strip().startswith("# lazy:"):
                missing.append(n.lineno)
    return sorted(set(missing))


def test_a_function_imports_the_projects_modules_only_with_a_reason():
    """The core and the families import each other at the top of a module; an import inside a function is
    kept only where it avoids a heavy import (torch, for a module that must load without it: every CLI
    command, so that --help stays instant) and says so. Core, plugins and CLI alike."""
    found = {f"{path.relative_to(REPO)}:{line}" for module, path in modules().items()
             for line in lazy_imports_without_a_reason(path.read_text())}
    assert not found, sorted(found)


def test_the_lazy_import_rule_can_fail():  # negative control: a reasonless local import is caught, a reasoned one not
    bare = "def f():\n    from .model import x\n    from . import y\n    return x\n"
    reasoned = "def f():\n    # lazy: torch\n    from .model import x\n    from . import y\n    import json\n    return x\n"
    assert lazy_imports_without_a_reason(bare) == [2, 3] and lazy_imports_without_a_reason(reasoned) == []
