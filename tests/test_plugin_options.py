"""A plug-in's options live beside it (megarl/config/registry.py): a policy loss, a transport or a
converter registers a Section of its own keys; the config types and checks them by the chosen name,
refuses a key nobody reads in one line, and hands the typed object to the code that reads it."""
from __future__ import annotations

import dataclasses
import sys
import textwrap

import pytest
import torch
import yaml

from megarl.algos.loss_fn import make_actor_loss_fn
from megarl.algos.losses import register_policy_loss
from megarl.algos.registry import POLICY_LOSSES
from megarl.transports import TRANSPORTS, Transport, register, unregister
from megarl.config import ConfigError
from megarl.config.registry import Registry
from megarl.config.typed import Section, require
from megarl.experiment import load_config
from megarl.protocol import DataProto

PL = "actor_rollout_ref.actor.policy_loss"
CE = "actor_rollout_ref.rollout.checkpoint_engine"


@dataclasses.dataclass
class ScaleOptions(Section):
    scale: float = 1.0

    def __post_init__(self):
        require(self.scale > 0, "scale", "must be > 0")


def scaled_pg(old_log_prob, log_prob, advantages, mask, params, agg, is_weights=None):
    return agg(-params.options.scale * advantages * log_prob, mask), {}


@pytest.fixture
def scaled_loss():
    """Registered for the test alone: other modules count the registered losses."""
    register_policy_loss("scaled_pg_test", options=ScaleOptions)(scaled_pg)
    yield
    POLICY_LOSSES.unregister("scaled_pg_test")


def test_a_registry_refuses_options_that_are_not_a_section():
    kinds = Registry("toy", "toy.name")

    @dataclasses.dataclass
    class Plain:
        x: int = 0

    with pytest.raises(ValueError, match="options must be a @dataclass deriving from megarl.config.typed.Section"):
        kinds.add("a", object(), "tests", options=Plain)
    kinds.add("b", object(), "tests", options=ScaleOptions)
    assert kinds.build_options("b", {"scale": "2"}, "toy.b") == ScaleOptions(2.0)
    with pytest.raises(ConfigError, match=r"^toy.b.scal: unknown key; did you mean 'scale'\? toy 'b' reads scale$"):
        kinds.build_options("b", {"scal": 2}, "toy.b")
    kinds.unregister("b")
    assert kinds.options_of("b") is None


def test_a_loss_reads_its_own_key_written_beside_loss_mode(scaled_loss):
    def value(scale: float) -> float:
        cfg = load_config(None, ["data.max_response_length=4", f"{PL}.loss_mode=scaled_pg_test", f"{PL}.scale={scale}"])
        assert cfg.actor.policy_loss.options == ScaleOptions(scale)
        batch = DataProto.from_dict({"old_log_probs": -torch.ones(2, 4), "advantages": torch.ones(2, 4),
                                     "response_mask": torch.ones(2, 4)})
        return make_actor_loss_fn(cfg)({"log_probs": -torch.ones(2, 4)}, batch)[0].item()

    assert value(1.0) == pytest.approx(1.0) and value(3.0) == pytest.approx(3.0)
    with pytest.raises(ConfigError, match=f"^{PL}.scale: must be > 0$"):
        load_config(None, [f"{PL}.loss_mode=scaled_pg_test", f"{PL}.scale=0"])


def test_the_run_record_holds_the_options_beside_loss_mode_and_loads_again(tmp_path):
    cfg = load_config(None, [f"{PL}.loss_mode=clip_cov", f"{PL}.clip_cov_ratio=0.3"])
    written = cfg.to_dict()["actor_rollout_ref"]["actor"]["policy_loss"]
    assert written == {"loss_mode": "clip_cov", "clip_cov_ratio": 0.3, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    again = load_config(str(tmp_path / "config.yaml"))
    assert again.actor.policy_loss.options == cfg.actor.policy_loss.options


def test_another_losss_key_passes_at_verls_default_only():
    """verl writes clip_cov_ratio, kl_cov_ratio ... into every config: at their defaults they are
    accepted under any loss; another value would go unread, so it is one line."""
    assert load_config(None, [f"{PL}.clip_cov_ratio=0.0002", f"{PL}.ppo_kl_coef=0.1"]).actor.policy_loss.options is None
    with pytest.raises(ConfigError, match=f"^{PL}.clip_cov_ratio: is read by loss_mode=clip_cov only; set that loss"):
        load_config(None, [f"{PL}.clip_cov_ratio=0.3"])
    with pytest.raises(ConfigError, match=f"^{PL}.weigth: unknown key; policy loss 'vanilla' reads no keys of its own"):
        load_config(None, [f"{PL}.weigth=1"])
    assert POLICY_LOSSES.options_of("vanilla") is None


@dataclasses.dataclass
class LagOptions(Section):
    lag: int = 1


@pytest.fixture
def lag_transport():
    register(Transport(name="lag_test", placements=("colocated",), delta=False, options=LagOptions,
                       build=lambda parts: parts))
    yield
    unregister("lag_test")


def test_a_transports_options_go_under_engine_kwargs_by_name(lag_transport):
    cfg = load_config(None, [f"{CE}.backend=lag_test", f"{CE}.engine_kwargs.lag_test.lag=3"])
    assert cfg.rollout.checkpoint_engine.options("lag_test") == LagOptions(3)
    assert load_config(None, [f"{CE}.backend=lag_test"]).rollout.checkpoint_engine.options("lag_test") == LagOptions()
    with pytest.raises(ConfigError, match=f"^{CE}.engine_kwargs.lag_test.lag: got 'x' \\(str\\), expected int$"):
        load_config(None, [f"{CE}.backend=lag_test", f"{CE}.engine_kwargs.lag_test.lag=x"])
    with pytest.raises(ConfigError, match=f"^{CE}.engine_kwargs: engine_kwargs.lag_test is read by the lag_test "
                                          "transport, and weights move over colocated"):
        load_config(None, [f"{CE}.engine_kwargs.lag_test.lag=3"])
    with pytest.raises(ConfigError, match=f"^{CE}.engine_kwargs.lag_tst: unknown transport 'lag_tst'"):
        load_config(None, [f"{CE}.backend=lag_test", f"{CE}.engine_kwargs.lag_tst.lag=3"])
    written = yaml.safe_load(cfg.to_yaml())["actor_rollout_ref"]["rollout"]["checkpoint_engine"]["engine_kwargs"]
    assert written == {"lag_test": {"lag": 3}}


def test_a_transport_of_model_external_lib_is_known_to_the_config(tmp_path, monkeypatch):
    """The backend's name is checked once model.external_lib ran, so a config file can name a
    transport of the user's package (megarl-train imports nothing else before the config)."""
    (tmp_path / "my_transport_test.py").write_text(textwrap.dedent("""
        from megarl.transports import Transport, register
        register(Transport(name="mine_test", placements=("colocated",), delta=False, build=lambda parts: None))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cfg = load_config(None, [f"{CE}.backend=mine_test", "actor_rollout_ref.model.external_lib=my_transport_test"])
        assert cfg.rollout.checkpoint_engine.backend == "mine_test"
    finally:
        if "mine_test" in TRANSPORTS:
            unregister("mine_test")
        sys.modules.pop("my_transport_test", None)
