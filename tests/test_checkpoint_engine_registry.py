"""Weight-sync transports come from a registry (megarl/transports/__init__.py): a transport
registered here, in this file alone, is a backend the config accepts, whose checks the config
runs, and which the trainer's builder builds. No torch, no ranks: the toy moves nothing."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from megarl.checkpoint_engine import build_checkpoint_engine
from megarl.checkpoint_engine.transport import BuildParts
from megarl.transports import Transport, register, transport, transport_names
from megarl.config import ConfigError
from megarl.experiment import load_config
from tests.helpers.python_child import prints

CE = "actor_rollout_ref.rollout.checkpoint_engine"


@dataclass
class ToySync:
    parts: BuildParts
    anchors: list[str] = field(default_factory=list)
    syncs: int = 0

    def sync(self) -> dict[str, float]:
        self.syncs += 1
        return {"weight_sync/seconds": 0.0}

    def request_anchor(self, why: str) -> None:
        self.anchors.append(why)


def check_toy(cfg) -> None:
    if not cfg.rollout.checkpoint_engine.overlap:
        raise ConfigError("the toy transport always overlaps; remove overlap=false", f"{CE}.overlap")


register(Transport(name="toy", placements=("colocated",), delta=False, checks=(check_toy,), build=ToySync))


def test_the_config_accepts_a_registered_transport_and_runs_its_checks():
    assert "toy" in transport_names()
    cfg = load_config(None, [f"{CE}.backend=toy"])
    assert cfg.rollout.checkpoint_engine.backend == "toy"
    with pytest.raises(ConfigError, match="overlap: the toy transport always overlaps"):
        load_config(None, [f"{CE}.backend=toy", f"{CE}.overlap=false"])
    with pytest.raises(ConfigError, match="delta: =on needs a transport that sends deltas.*toy sends whole"):
        load_config(None, [f"{CE}.backend=toy", f"{CE}.delta=on"])
    with pytest.raises(ConfigError, match="backend: is toy, which serves placement=colocated only"):
        load_config(None, [f"{CE}.backend=toy", "actor_rollout_ref.rollout.placement=disaggregated",
                           "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.disaggregated_ranks=1"])


def test_an_unknown_backend_names_every_registered_one_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{CE}.backend=carrier_pigeon"])
    message = str(err.value)
    assert "\n" not in message and "unknown transport 'carrier_pigeon'" in message
    for name in ("colocated", "disk", "distributed", "toy"):
        assert name in message


def test_the_trainer_side_builder_builds_it():
    cfg = load_config(None, [f"{CE}.backend=toy"])
    actor, engine = object(), object()
    sync = build_checkpoint_engine(cfg, actor, engine)
    assert isinstance(sync, ToySync)
    assert (sync.parts.side, sync.parts.actor, sync.parts.engine, sync.parts.cfg) == ("colocated", actor, engine, cfg)
    assert sync.sync() == {"weight_sync/seconds": 0.0} and sync.syncs == 1
    sync.request_anchor("resumed")
    assert sync.anchors == ["resumed"]


def test_registration_refuses_what_the_registry_could_not_serve():
    with pytest.raises(ValueError, match="placements"):
        Transport(name="nowhere", placements=("moon",), delta=False, build=ToySync)
    transport("colocated")      # the built-in is loaded (and registered) on first use
    with pytest.raises(ValueError, match="already picks 'colocated'"):
        register(Transport(name="rival", placements=("colocated",), delta=False, auto_for=("colocated",),
                           build=ToySync))
    with pytest.raises(ValueError, match="alias"):
        register(Transport(name="auto", placements=("colocated",), delta=False, build=ToySync))
    # a built-in name is its module's alone, even before that module loads: a user's transport that
    # took "distributed" would otherwise be replaced (or replace megarl's) depending on import order
    with pytest.raises(ValueError, match="'distributed' is megarl's built-in megarl.transports"):
        register(Transport(name="distributed", placements=("disaggregated",), delta=False, build=ToySync))
    with pytest.raises(ValueError, match="'toy' is already registered"):
        register(Transport(name="toy", placements=("colocated",), delta=True, build=ToySync))


def test_the_config_reads_the_registry_without_torch():
    code = ("import sys; from megarl.rollout.config import CheckpointEngineConfig;"
            "import megarl.checkpoint_engine;"
            "CheckpointEngineConfig(backend='disk'); CheckpointEngineConfig(backend='distributed');"
            "print('torch' in sys.modules)")
    assert prints(code) == "False"
