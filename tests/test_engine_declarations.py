"""Rollout engines declare what they can do (megarl/engines/); every consumer reads the declaration.

    python -m pytest -q tests/test_engine_declarations.py

An engine declared here, in this one file, is built by the registry, held to its devices by
preflight, trusted for the bypass of the old-log-prob pass and for R3 routes exactly as far as it
declares, with no other file edited. A user's class declares the same abilities as attributes.
"""
from __future__ import annotations

import ast
import os
import textwrap

import pytest
import torch

from megarl import engines
from megarl.launcher import preflight
from megarl.config.errors import ConfigError
from megarl.experiment import load_config
from megarl.engines import EngineInfo
from megarl.rollout.base import BaseRollout
from megarl.rollout.build_args import BuildRequest
from megarl.rollout.config import RolloutConfig
from megarl.rollout.registry import build_rollout
from megarl.trainer.loop.bypass import resolve_bypass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")
R3 = ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
BYPASS = "algorithm.rollout_correction.bypass_mode"


class TinyEngine(BaseRollout):
    def __init__(self, request: BuildRequest):
        super().__init__(request.cfg, request.role)
        self.request = request


def build_tiny(request: BuildRequest) -> TinyEngine:
    return TinyEngine(request)


# GPU-only, records routes, exact at fp32, captures graphs; and a plain one that claims nothing.
TINY = EngineInfo(name="tiny", summary="a test engine", build=f"{__name__}:build_tiny", devices=("cuda",),
                  records_routes=True, exact_logprob_dtypes=("float32",), captures_cuda_graphs=True)
PLAIN = EngineInfo(name="plain", summary="a test engine", build=f"{__name__}:build_tiny")


@pytest.fixture
def declared():
    for info in (TINY, PLAIN):
        engines.register(info)
    yield
    for info in (TINY, PLAIN):
        engines.unregister(info.name)


def cfg(name: str, *over: str):
    return load_config(None, [f"actor_rollout_ref.rollout.name={name}", "trainer.device=cpu", *over])


def test_the_registry_builds_a_declared_engine(declared):
    engine = build_rollout(RolloutConfig(name="tiny", engine_kwargs={"tiny": {"x": 1}}), "no-model", role="ref")
    assert isinstance(engine, TinyEngine) and engine.request.info == TINY and engine.request.role == "ref"
    assert engine.request.user_kwargs == {"x": 1}
    with pytest.raises(ConfigError, match="unknown engine 'tinny'.*did you mean 'tiny'"):
        build_rollout(RolloutConfig(name="tinny"), "no-model")
    engines.register(TINY)                               # the same declaration again: harmless
    with pytest.raises(ValueError, match="'tiny' is already declared differently"):
        engines.register(PLAIN.__class__(**{**PLAIN.__dict__, "name": "tiny"}))
    # megarl's engines are declared by their files: another module cannot take one's name
    with pytest.raises(ValueError, match="'vllm' is megarl's built-in megarl.engines.vllm:ENGINE"):
        engines.register(PLAIN.__class__(**{**PLAIN.__dict__, "name": "vllm"}))


def test_preflight_holds_it_to_its_devices(declared, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, refused in (("tiny", True), ("plain", False)):
        c = cfg(name)
        info = preflight.check_engine(c)
        assert info.name == name
        if refused:
            with pytest.raises(ConfigError, match="rollout.name: tiny runs on NVIDIA GPUs only.*rollout.name=native"):
                preflight.check_device(c, info)
        else:
            preflight.check_device(c, info)


def test_bypass_trusts_exactly_the_declared_dtypes(declared):
    on = resolve_bypass(cfg("tiny"), CPU)
    assert on.on and on.reason.startswith("on: tiny engine at fp32"), on.reason
    assert not resolve_bypass(cfg("tiny"), torch.device("cuda")).on           # auto on CUDA: bf16, not declared
    off = resolve_bypass(cfg("plain"), CPU)
    assert not off.on and "plain engine at this precision" in off.reason
    cfg("tiny", f"{BYPASS}=true")
    with pytest.raises(ConfigError, match=f"{BYPASS}: is true, but the plain engine"):
        cfg("plain", f"{BYPASS}=true")


def test_routes_and_graphs_are_asked_only_of_engines_that_declare_them(declared):
    assert cfg("tiny", *R3, "actor_rollout_ref.rollout.enforce_eager=false").rollout.enable_rollout_routing_replay
    with pytest.raises(ConfigError, match="does not record the routed experts; for R3 use rollout.name=native or "
                                          "rollout.name=tiny"):
        cfg("plain", *R3)
    with pytest.raises(ConfigError, match="enforce_eager: false asks for CUDA graphs, which the plain engine does "
                                          "not capture \\(engines that do: native, tiny, vllm\\)"):
        cfg("plain", "actor_rollout_ref.rollout.enforce_eager=false")


def _user_class(tmp_path, body: str) -> list[str]:
    path = tmp_path / "user_engine.py"
    path.write_text(textwrap.dedent("""
        from megarl.rollout.base import BaseRollout
        class Engine(BaseRollout):
            def generate(self, prompts, sampling, prompt_limit=None):
                return []
        """) + textwrap.dedent(body))
    return ["actor_rollout_ref.rollout.name=custom", f"actor_rollout_ref.rollout.custom_cls_path={path}",
            "actor_rollout_ref.rollout.custom_cls_name=Engine", "trainer.device=cpu"]


def test_a_users_class_declares_abilities_as_attributes(tmp_path):
    keys = _user_class(tmp_path, """
        Engine.records_routes = True
        Engine.exact_logprob_dtypes = ["float32"]
        Engine.captures_cuda_graphs = True
        """)
    c = load_config(None, keys + R3 + ["actor_rollout_ref.rollout.enforce_eager=false", f"{BYPASS}=true"])
    info = preflight.check_engine(c)
    assert info.records_routes and info.captures_cuda_graphs and info.logprobs_exact_at("float32")
    assert resolve_bypass(load_config(None, keys), CPU).on


def test_a_users_class_that_declares_nothing_gets_the_conservative_defaults(tmp_path):
    keys = _user_class(tmp_path, "")
    # nothing is refused before the class loads; preflight reads it and refuses in one line
    for over, words in ((R3, "rollout.enable_rollout_routing_replay: Engine does not declare records_routes = True"),
                        (["actor_rollout_ref.rollout.enforce_eager=false"], "rollout.enforce_eager: false asks"),
                        ([f"{BYPASS}=true"], f"{BYPASS}: is true, but the custom engine")):
        c = load_config(None, keys + over)
        with pytest.raises(ConfigError, match=words):
            preflight.check_engine(c)
    with pytest.raises(ConfigError, match="does not declare records_routes"):
        build_rollout(load_config(None, keys + R3).rollout, "no-model")
    assert not resolve_bypass(load_config(None, keys), CPU).on


# The modules that once decided abilities by comparing engine names.
CONSUMERS = ("megarl/rollout/registry.py", "megarl/launcher/preflight.py", "megarl/models/routing_replay.py",
             "megarl/algos/config.py", "megarl/trainer/loop/bypass.py", "megarl/rollout/config.py",
             "megarl/rollout/config_checks.py", "megarl/workers/config_checks.py")


def test_no_consumer_compares_engine_names():
    names = {i.name for i in engines.known()}

    def engine_names(node: ast.AST) -> list[str]:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]

    found = []
    for rel in CONSUMERS:
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, rel)).read())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
            elif isinstance(node, ast.Assign):      # a module-level list of engine names
                sides = [node.value]
            elif isinstance(node, ast.Dict):
                sides = list(node.keys)
            else:
                continue
            found += [f"{rel}:{node.lineno} {n!r}" for side in sides if side is not None for n in engine_names(side)]
    assert not found, "decided by engine name instead of the declarations in megarl/engines/: " + ", ".join(found)
