"""megarl uses torch's public API only: no `_name` reached through torch (e.g. torch.distributed's
`_update_default_pg`, which swapped the default process group under disaggregated placement).
Process groups are objects passed to whoever needs them (megarl/parallel/bridge.py)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "megarl"


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def private_torch_uses(source: str) -> list[str]:
    tree = ast.parse(source)
    torch_names = {"torch"}                 # names bound to torch or one of its modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_names.add((a.asname or a.name).split(".")[0])
                    if _private(a.name):
                        found.append(f"line {node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if _private(node.module):
                found.append(f"line {node.lineno}: from {node.module}")
            for a in node.names:
                torch_names.add(a.asname or a.name)
                if _private(a.name):
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in torch_names:
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_the_checker_finds_what_it_looks_for():
    bad = ("from torch.distributed.distributed_c10d import _update_default_pg\n"
           "import torch.distributed as dist\nx = dist.distributed_c10d._get_default_group()\n"
           "import torch._dynamo\n")
    assert len(private_torch_uses(bad)) == 3
    assert private_torch_uses("import torch.distributed as dist\ndist.new_group([0])\nt.__class__\n") == []


def test_megarl_uses_no_private_torch_api():
    found = {str(p.relative_to(ROOT.parent)): hits for p in sorted(ROOT.rglob("*.py"))
             if (hits := private_torch_uses(p.read_text()))}
    assert found == {}, found
