"""docs/architecture.md stays true to the code: every file it names exists, every method its
one-step sketch calls is defined where it says, the package order it states holds for every
import in megarl/ (module level and function level), and its module map names every module.

    python -m pytest -q tests/test_docs_architecture.py
"""
from __future__ import annotations

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = open(os.path.join(ROOT, "docs", "architecture.md")).read()
# receivers of the one-step sketch -> the file that defines the role they stand for
RECEIVERS = {"actor": "megarl/workers/actor.py", "ref": "megarl/workers/reference.py",
             "critic": "megarl/workers/critic.py",
             "checkpointing": "megarl/trainer/checkpoints/checkpointing.py", "weight_sync": "megarl/checkpoint_engine",
             "train_loader": "megarl/data/loader.py", "reward": "megarl/reward/manager.py",
             "metrics": "megarl/trainer/metrics/logger.py"}


PATH = r"megarl/(?:[\w/.]|\{[^}]*\})*"     # a path that may hold {a,b} alternatives


def expand(path: str) -> list[str]:
    """megarl/config/{errors,typed}.py -> [megarl/config/errors.py, megarl/config/typed.py]."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [p for part in m.group(1).split(",") for p in expand(path[:m.start()] + part + path[m.end():])]


def named_paths() -> set[str]:
    found = re.findall(r"(?<![\w/.])((?:megarl|tests|launch|benchmarks|checkpoints_tools)/[\w/{},.*-]*[\w/}*])", DOC)
    return {p for raw in found for p in expand(raw)}


def test_every_named_file_exists():
    missing = []
    for p in sorted(named_paths()):
        if "*" in p:
            if not glob.glob(os.path.join(ROOT, p)):
                missing.append(p)
        elif not os.path.exists(os.path.join(ROOT, p)):
            missing.append(p)
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def defines(path: str, name: str) -> bool:
    files = [path] if path.endswith(".py") else [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, path))
                                                 for f in fs if f.endswith(".py")]
    for f in files:
        tree = ast.parse(open(os.path.join(ROOT, f)).read())
        if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in ast.walk(tree)):
            return True
    return False


def test_the_one_step_sketch_calls_what_exists():
    block = DOC.split("## One step", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    wrong = []
    for line in block.splitlines():
        package = re.search(r"\s(megarl/[\w/]+)", line)
        for recv, method in re.findall(r"\b([a-z_]+)\.([a-z_]+)\(", line):
            where = RECEIVERS.get(recv) or (package.group(1).rstrip("/") if package else "megarl")
            if not defines(where, method):
                wrong.append(f"{recv}.{method} (looked in {where})")
    assert not wrong, f"docs/architecture.md's one-step sketch calls what does not exist: {wrong}"


def stated_order() -> list[list[str]]:
    """The package-order block: one list of module prefixes per line, in the order stated."""
    block = DOC.split("## Packages and their order", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    order = []
    for line in block.splitlines():
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]    # the names, before the description
        if head.startswith("megarl/"):
            order.append([p for raw in re.findall(PATH, head) for p in expand(raw)])
    return order


def rank_of(module_path: str, order: list[list[str]]) -> int | None:
    """The rank of the most specific entry that covers a file (a file, or a folder ending in /)."""
    best, best_len = None, -1
    for rank, entries in enumerate(order):
        for e in entries:
            covers = module_path == e if e.endswith(".py") else module_path.startswith(e.rstrip("/") + "/")
            if covers and len(e) > best_len:
                best, best_len = rank, len(e)
    return best


def megarl_imports(path: str) -> set[str]:
    """megarl modules a file imports at run time, as file paths (module and function level)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    for n in ast.walk(tree):        # annotation-only imports (if TYPE_CHECKING:) are no dependency at run time
        if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING":
            n.body = []
    pkg = os.path.dirname(path).replace("/", ".")
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - n.level + 1] + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in n.names}
    out = set()
    for name in names:
        if not name.startswith("megarl"):
            continue
        p = name.replace(".", "/")
        if os.path.isfile(os.path.join(ROOT, p + ".py")):
            out.add(p + ".py")
        elif os.path.isfile(os.path.join(ROOT, p, "__init__.py")):
            out.add(p + "/__init__.py")
    return out


def test_every_module_has_a_place_and_imports_only_from_before_it():
    order = stated_order()
    files = sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "megarl"))
                   for f in fs if f.endswith(".py"))
    unplaced = [f for f in files if rank_of(f, order) is None and not f.endswith("megarl/__init__.py")]
    assert not unplaced, f"docs/architecture.md's package order does not place: {unplaced}"
    broken = []
    for f in files:
        mine = rank_of(f, order)
        for dep in megarl_imports(f):
            theirs = rank_of(dep, order)
            if mine is not None and theirs is not None and theirs > mine:
                broken.append(f"{f} imports {dep}")
    assert not broken, "imports against docs/architecture.md's package order: " + "; ".join(broken)


def module_map() -> dict[str, str]:
    """The module map's bullets: top-level package ("" for megarl/ itself) -> the bullet's text."""
    assert "\n## Module map\n" in DOC, "docs/architecture.md has no '## Module map' section"
    block = DOC.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    bullets = {}
    for item in re.split(r"\n- ", "\n" + block)[1:]:
        head = re.match(r"\*\*([\w/]+)\*\*", item)
        if head:
            name = head.group(1).rstrip("/")
            bullets["" if name == "megarl" else name] = item
    return bullets


def test_the_module_map_names_every_module_and_package():
    """Each file under megarl/ is named (`name.py`) in its top-level package's bullet, each subpackage
    (`name/`) too, and each name there is a file of that package: a new module is described where a
    reader looks for it, and a removed one leaves no stale name."""
    bullets = module_map()
    missing, stale = [], []
    for d, dirs, files in os.walk(os.path.join(ROOT, "megarl")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        rel = os.path.relpath(d, os.path.join(ROOT, "megarl"))
        parts = [] if rel == "." else rel.split(os.sep)
        top = parts[0] if parts else ""
        text = bullets.get(top)
        if text is None:
            missing.append(f"megarl/{top}/ (no bullet)")
            continue
        for sub in parts[1:]:
            if f"`{sub}/`" not in text:
                missing.append(f"megarl/{rel}/")
        for f in files:
            if f.endswith(".py") and (f != "__init__.py" or not parts) and f"`{f}`" not in text:
                missing.append(f"megarl/{rel}/{f}".replace("/./", "/"))
    for top, text in bullets.items():
        have = {f for _, _, fs in os.walk(os.path.join(ROOT, "megarl", top)) for f in fs}
        stale += [f"{top}/{name}" for name in re.findall(r"`(\w+\.py)`", text) if name not in have]
    assert not missing, f"docs/architecture.md's module map does not name (add each to its package's bullet): {missing}"
    assert not stale, f"docs/architecture.md's module map names files that do not exist: {stale}"
