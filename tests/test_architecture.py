"""The shape of megarl/ that review keeps asking for, checked from the source with ast (nothing is
imported, so this runs in a second):

  - no import circle between modules, counting imports inside functions too;
  - no circle between packages (a package imports another only if that one never imports it back);
  - function-level imports only for optional dependencies (or a named lazy boundary), each with a
    comment on its line giving the reason;
  - no private torch API (`torch...._name`, `from torch... import _name`);
  - no file in megarl/ over 400 lines;
  - no test module imported by another (shared test code lives in tests/helpers/).

    python -m pytest -q tests/test_architecture.py
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 400

# Loaded inside the function that needs them: extras (megarl[trtllm], [te], [logging]) and
# dependencies that only one feature uses and that cost seconds to load.
OPTIONAL = ("tensorrt_llm", "transformer_engine", "megatron.core.extensions.transformer_engine", "apex", "vllm",
            "wandb", "torch.utils.tensorboard", "ray", "matplotlib", "pyarrow", "zstandard", "lz4")
# The launcher's front door: `megarl-train` refuses a bad config in a second, before torch loads
# (tests/test_repo.py), so what loads torch is imported inside the function that needs it there.
LAUNCHER = ("megarl", "megarl.train", "megarl.launcher.preflight")
# Lazy on purpose as well: configs name the examples' packages (`megarl.examples.addition:bootstrap`).
LAZY_BOUNDARIES = {("megarl.examples.addition", "megarl.examples.addition.checkpoint"),
                   ("megarl.examples.tool_use", "megarl.examples.tool_use.model"),
                   # megatron-core imported with torch.compile deferred: the import is the function
                   ("megarl.models.megatron_import", "megatron.core")}
# Underscore names that are not private API in the sense meant here, each for its reason.
PRIVATE_ALLOWED = {
    # an ATen operator looked up by getattr with a public fallback (attend_matmul) where absent:
    # SDPA's own CPU kernel, called directly for its log-sum-exp (megarl/rollout/native/attention.py)
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
}


def modules() -> dict[str, str]:
    out = {}
    for base, _, files in os.walk(os.path.join(ROOT, "megarl")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


class Import:
    def __init__(self, module: str, target: str, names: list[str], line: int, in_function: bool, text: str):
        self.module, self.target, self.names, self.line, self.in_function, self.text = \
            module, target, names, line, in_function, text

    def where(self) -> str:
        return f"{os.path.relpath(MODULES[self.module], ROOT)}:{self.line}"


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    source = open(path).read()
    lines = source.splitlines()
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    out.append(Import(module, alias.name, [], child.lineno, in_function, lines[child.lineno - 1]))
            elif isinstance(child, ast.ImportFrom):
                target = child.module or ""
                if child.level:
                    base = package.split(".")[:len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([target] if target else []))
                out.append(Import(module, target, [a.name for a in child.names], child.lineno, in_function,
                                  lines[child.lineno - 1]))
            visit(child, inner)
    visit(ast.parse(source), False)
    return out


ALL_IMPORTS = [imp for m in MODULES for imp in imports_of(m)]


def resolve(name: str) -> str | None:
    """The megarl module that `import name` (or `from name import ...`) runs."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def module_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in ALL_IMPORTS:
        if imp.target.split(".")[0] != "megarl":
            continue
        # `from pkg import name` runs pkg.name when that is a module
        for target in [f"{imp.target}.{n}" for n in imp.names] or [imp.target]:
            dest = resolve(target)
            if dest and dest != imp.module:
                edges[imp.module].add(dest)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each a circle."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
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
                found.append(sorted(comp))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and os.path.isdir(os.path.join(ROOT, "megarl", parts[1])):
        return ".".join(parts[:2])
    return module


def test_no_import_circles_between_modules():
    found = cycles(module_edges())
    assert not found, "import circles (function-level imports included): " + "; ".join(" -> ".join(c) for c in found)


def test_no_circles_between_packages():
    edges: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], str] = {}
    for a, targets in module_edges().items():
        for b in targets:
            pa, pb = package_of(a), package_of(b)
            if pa != pb:
                edges[pa].add(pb)
                why.setdefault((pa, pb), f"{a} -> {b}")
    found = cycles(edges)
    detail = [f"{' <-> '.join(c)} ({'; '.join(why[(x, y)] for x in c for y in c if (x, y) in why)})" for c in found]
    assert not found, "packages that import each other: " + " | ".join(detail)


def test_the_stream_loop_holds_the_steps():
    """The disaggregated loop runs the steps both loops share by holding them, not by extending the
    synchronous loop: what the colocated loop changes (its rollout, its sync) cannot leak into it."""
    tree = ast.parse(open(MODULES["megarl.trainer.stream.fit"]).read())
    loop = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AsyncRLTrainer")
    assert not loop.bases, f"AsyncRLTrainer extends {[ast.unparse(b) for b in loop.bases]}; hold a Steps instead"
    assert "megarl.trainer.loop.steps" in module_edges()["megarl.trainer.stream.fit"]
    assert "megarl.trainer.loop.fit" not in module_edges()["megarl.trainer.stream.fit"]


def test_function_level_imports_are_optional_dependencies_with_a_reason():
    bad = []
    for imp in ALL_IMPORTS:
        if not imp.in_function:
            continue
        optional = any(imp.target == o or imp.target.startswith(o + ".") for o in OPTIONAL)
        boundary = imp.module in LAUNCHER or (imp.module, resolve(imp.target) or imp.target) in LAZY_BOUNDARIES
        if not (optional or boundary):
            bad.append(f"{imp.where()} imports {imp.target} inside a function (move it to the top of the module)")
        elif "#" not in imp.text:
            bad.append(f"{imp.where()} imports {imp.target} inside a function without a comment giving the reason")
    assert not bad, "\n".join(bad)


def _torch_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the torch module path it stands for (`dist` -> torch.distributed)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    names[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def test_no_private_torch_api():
    bad = []
    for module, path in MODULES.items():
        tree = ast.parse(open(path).read())
        names = _torch_names(tree)
        rel = os.path.relpath(path, ROOT)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mod = node.module if isinstance(node, ast.ImportFrom) else None
                full = [f"{mod}.{a.name}" for a in node.names] if mod else [a.name for a in node.names]
                for name in full:
                    if name.split(".")[0] == "torch" and _private(name.split(".")):
                        bad.append(f"{rel}:{node.lineno} imports {name}")
            elif isinstance(node, ast.Attribute):
                parts = _dotted(node)
                if parts and parts[0] in names:
                    full = names[parts[0]].split(".") + parts[1:]
                    if _private(full) and ".".join(full) not in PRIVATE_ALLOWED:
                        bad.append(f"{rel}:{node.lineno} uses {'.'.join(full)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and str(node.args[1].value).startswith("_") and (_dotted(node.args[0]) or [""])[0] in names:
                parts = _dotted(node.args[0])
                full = ".".join(names[parts[0]].split(".") + parts[1:] + [node.args[1].value])
                if full not in PRIVATE_ALLOWED:
                    bad.append(f"{rel}:{node.lineno} reads {full} through getattr")
    assert not sorted(set(bad)), "private torch API: " + "; ".join(sorted(set(bad)))


def test_no_file_over_400_lines():
    long = {os.path.relpath(p, ROOT): n for p in MODULES.values()
            if (n := len(open(p).read().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by concern): {long}"


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers/; a test module is never a library."""
    bad = []
    for base, _, files in os.walk(os.path.join(ROOT, "tests")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                             [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                    for name in names:
                        if any(part.startswith("test_") for part in name.split(".")):
                            bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} imports {name}")
    assert not bad, "test modules imported as libraries (move what they share to tests/helpers/): " + "; ".join(bad)


def test_the_checks_see_what_they_must():
    """The checkers on known cases, so a passing run means something."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("import torch.distributed as dist\nfrom torch.distributed import distributed_c10d as c\n"
                     "x = dist.distributed_c10d._get_default_group()\ny = c._update_default_pg\nz = dist.get_rank()")
    names = _torch_names(tree)
    used = [".".join(names[p[0]].split(".") + p[1:]) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and (p := _dotted(n)) and p[0] in names and _private(names[p[0]].split(".") + p[1:])]
    assert "torch.distributed.distributed_c10d._get_default_group" in used
    assert "torch.distributed.distributed_c10d._update_default_pg" in used
    assert not any(u.endswith("get_rank") for u in used)
    fn_level = [i for i in ALL_IMPORTS if i.in_function]
    assert any(i.target == "ray" for i in fn_level) and module_edges()["megarl.trainer.loop.fit"]
