"""Regenerate a TensorRT-LLM API snapshot (tests/assets/trtllm/trtllm-<version>.json) from its source.

    python tests/assets/trtllm/extract_snapshot.py /path/to/TensorRT-LLM            # a checkout
    python tests/assets/trtllm/extract_snapshot.py /path/to/TensorRT-LLM.git v1.2.0  # a git dir + tag

Reads the source with `ast` (nothing is imported, so no CUDA is needed): SamplingParams' init
fields, the LLM args model's fields (TorchLlmArgs and the bases defined beside it), KvCacheConfig /
SleepConfig / RayPlacementConfig fields, ExecutorMemoryType values, CompletionOutput / Logprob
fields. A class that llm_args.py imports instead of defining (ExecutorMemoryType lives in
tensorrt_llm/_torch/virtual_memory.py) is followed through its `from ... import` line. Every
field records the file and commit it was read from ("fields"). SamplingParams' validation rules
("sampling_rules") and what TorchSampler does with the seed ("seed_semantics": "ignored" before
PR #17172, "per_request" after) are behaviour, not declarations: they are copied by hand into
the snapshot and keep their own provenance there. Writes the JSON next to this file and prints
its path; the conformance fake (tests/rollout/trtllm_fake.py) accepts exactly what it lists.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

FILES = {"sampling": "tensorrt_llm/sampling_params.py", "args": "tensorrt_llm/llmapi/llm_args.py",
         "result": "tensorrt_llm/executor/result.py", "version": "tensorrt_llm/version.py"}
REPO = "NVIDIA/TensorRT-LLM"
# Where a class may live when llm_args.py has no definition and no import naming it.
FALLBACK = {"ExecutorMemoryType": "tensorrt_llm/_torch/virtual_memory.py"}


def reader(root: str, tag: str | None):
    if tag is None:
        return lambda rel: open(os.path.join(root, rel), encoding="utf-8").read()
    return lambda rel: subprocess.run(["git", f"--git-dir={root}", "show", f"{tag}:{rel}"], check=True,
                                      capture_output=True, text=True).stdout


def classes(source: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}


def module_path(importer: str, node: ast.ImportFrom) -> str:
    """The file an `from X import Y` in `importer` (a repository path) refers to."""
    if node.level:
        base = importer.split("/")[:-node.level]
        parts = base + (node.module.split(".") if node.module else [])
    else:
        parts = node.module.split(".")
    return "/".join(parts) + ".py"


def find_class(name: str, path: str, read, depth: int = 3) -> tuple[ast.ClassDef | None, str]:
    """The class `name` as `path` sees it: defined there, or followed through its imports."""
    try:
        tree = ast.parse(read(path))
    except Exception:                      # a file that is not there at this commit
        return None, path
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node, path
    if depth:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
                found, where = find_class(name, module_path(path, node), read, depth - 1)
                if found is not None:
                    return found, where
    if name in FALLBACK and path != FALLBACK[name]:
        return find_class(name, FALLBACK[name], read, 0)
    return None, path


def _no_init(value: ast.expr | None) -> bool:
    """`field(..., init=False)` / `PrivateAttr(...)`: not a constructor argument."""
    if not isinstance(value, ast.Call):
        return False
    name = getattr(value.func, "id", getattr(value.func, "attr", ""))
    if name == "PrivateAttr":
        return True
    return any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
               for k in value.keywords)


def own_fields(cls: ast.ClassDef) -> list[str]:
    out = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not _no_init(node.value):
            ann = ast.unparse(node.annotation)
            if not ann.startswith("ClassVar"):
                out.append(node.target.id)
    return out


def model_fields(name: str, table: dict[str, ast.ClassDef]) -> list[str]:
    """A class's fields with those of its bases defined in the same file (base first, like pydantic)."""
    cls = table[name]
    out: list[str] = []
    for base in cls.bases:
        base_name = getattr(base, "id", None)
        if base_name in table:
            out += [f for f in model_fields(base_name, table) if f not in out]
    out += [f for f in own_fields(cls) if f not in out]
    # pydantic: names starting with "_" are private attributes, not fields
    return out


def enum_values(cls: ast.ClassDef) -> list[str]:
    return [n.value.value for n in cls.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str)]


def snapshot(read, commit: str | None) -> dict:
    version = ast.literal_eval(next(n.value for n in ast.parse(read(FILES["version"])).body
                                    if isinstance(n, ast.Assign) and n.targets[0].id == "__version__"))
    sampling = classes(read(FILES["sampling"]))
    args = classes(read(FILES["args"]))
    result = classes(read(FILES["result"]))
    sp = own_fields(sampling["SamplingParams"])
    llm_model = "TorchLlmArgs" if "TorchLlmArgs" in args else "LlmArgs"

    def pyd(name):
        return [f for f in model_fields(name, args) if not f.startswith("_")] if name in args else None

    modes = None
    if "logprobs_mode" in sp:
        for table in (sampling, args):
            if "LogprobMode" in table:
                modes = enum_values(table["LogprobMode"])
    mem, mem_path = find_class("ExecutorMemoryType", FILES["args"], read)

    def src(path):
        return {"repo": REPO, "path": path, "commit": commit}

    snap = {
        "schema": 2, "version": version, "commit": commit,
        "stand_in": None if commit else "read from a checkout without git metadata",
        "sampling_params_fields": sp,
        "llm_args_fields": pyd(llm_model),
        "kv_cache_config_fields": pyd("KvCacheConfig"),
        "sleep_config_fields": pyd("SleepConfig"),
        "ray_placement_config_fields": pyd("RayPlacementConfig"),
        "executor_memory_types": enum_values(mem) if mem is not None else None,
        "completion_output_fields": own_fields(result["CompletionOutput"]),
        "logprob_fields": own_fields(result["Logprob"]),
        "logprobs_modes": modes,
        "logprobs_format": "sampled_plus_topk_dict" if "logprobs_mode" in sp else "topk_dict",
    }
    where = {"sampling_params_fields": FILES["sampling"], "logprobs_modes": FILES["sampling"],
             "completion_output_fields": FILES["result"], "logprob_fields": FILES["result"],
             "executor_memory_types": mem_path}
    snap["fields"] = {key: src(where.get(key, FILES["args"])) for key in snap
                      if key.endswith(("_fields", "_types", "_modes"))}
    return snap


def main(argv: list[str]) -> str:
    root, tag = argv[0], (argv[1] if len(argv) > 1 else None)
    read = reader(root, tag)
    try:
        git = ["git", f"--git-dir={root}"] if tag else ["git", "-C", root]
        commit = subprocess.run(git + ["rev-parse", tag or "HEAD"], check=True, capture_output=True,
                                text=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        commit = None
    snap = snapshot(read, commit)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"trtllm-{snap['version']}.json")
    if os.path.exists(out):                # keep what is kept by hand (sampling_rules, restore_modes, ...)
        with open(out) as f:
            old = json.load(f)
        snap = {**old, **snap, "fields": {**old.get("fields", {}), **snap["fields"]}}
    with open(out, "w") as f:
        json.dump(snap, f, indent=1, sort_keys=True)
    print(out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
