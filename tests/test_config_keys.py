"""Every key the typed config accepts acts: it is read by code outside the config modules, or it
is refused (megarl/config/refused.py) with a tested one-line error, or it is an alias whose
target changes when it is set, or megarl already does what its every value asks (ALREADY). A key
added later without a reader fails here.

The read check is mechanical: an attribute read `x.<leaf>` (or getattr(x, "<leaf>")) in megarl/
outside the config modules. It is by leaf name, so it cannot tell two keys with one leaf name
apart (e.g. `rollout.seed` and `trainer.seed`); such keys get behavioural tests of their own, and the
sections several roles share (model, megatron) are checked per role by recording every config read while
the real bootstrap step and worker builds run (test_shared_sections_are_read_for_every_role).
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import typing

import pytest

from megarl.config import ConfigError
from megarl.experiment import ExperimentConfig, load_config
from megarl.config.refused import ALIASES, ALREADY, REFUSED
from megarl.config.typed import all_keys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "megarl"
# Files that define or validate config; a read there does not make a key act.
CONFIG_MODULES = {"config.py", "typed.py", "loader.py", "experiment.py", "refused.py", "paths.py", "interpolate.py",
                  "errors.py", "preflight.py"}

# Keys read through a generic path the AST check cannot see, each with the reason.
GENERIC = {
    "actor_rollout_ref.model.external_lib": "imported by megarl.launcher.preflight.import_external_libs on every rank",
    "critic.model.external_lib": "imported by megarl.launcher.preflight.import_external_libs on every rank",
}


def _section(tp):
    for cand in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(cand):
            return cand
    return None


def leaves(cls=ExperimentConfig, prefix: str = "") -> list[str]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        sub = _section(hints[f.name])
        out.extend(leaves(sub, key) if sub else [key])
    return out


def attribute_reads() -> set[str]:
    names: set[str] = set()
    for path in ROOT.rglob("*.py"):
        if path.name in CONFIG_MODULES or path.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
    return names


def test_every_leaf_acts_or_is_refused():
    reads = attribute_reads()
    idle = [k for k in leaves()
            if k.split(".")[-1] not in reads and k not in REFUSED and k not in ALIASES and k not in GENERIC
            and k not in ALREADY]
    assert not idle, (f"accepted but never read outside the config modules: {idle}; read them where they act, "
                      "or refuse them in megarl/config/refused.py")


def test_lists_name_real_keys():
    keys = set(all_keys(ExperimentConfig))
    for key in (*REFUSED, *ALIASES, *ALIASES.values(), *GENERIC, *ALREADY):
        assert key in keys, key
    assert not set(ALREADY) & set(REFUSED), "a key is accepted at every value or refused at some, not both"


@pytest.mark.parametrize("key", sorted(ALREADY))
def test_already_done_key_is_accepted_at_every_value(key):
    for value in {"actor_rollout_ref.rollout.mode": ("sync", "async")}.get(key, ("true", "false")):
        load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_refused_key_accepts_its_default_and_refuses_the_rest(key):
    accepted, why = REFUSED[key]
    load_config(None, [f"{key}={_yaml(accepted[0])}"])
    other = {bool: not accepted[0], int: 7, float: 0.5, str: "fsdp", type(None): "x", dict: "{a: 1}"}[type(accepted[0])]
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={_yaml(other)}"])
    assert str(err.value).startswith(f"{key}: ") and str(err.value).endswith(f"is not supported: {why}")
    assert "\n" not in str(err.value)


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


ALIAS_VALUES = {"actor_rollout_ref.actor.grad_clip": 0.3, "critic.grad_clip": 0.7,
                "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": 64.0,
                "actor_rollout_ref.rollout.max_response_length": 12,
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 3,
                "actor_rollout_ref.rollout.tools": "/some/tools.yaml"}


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_alias_sets_its_target(alias):
    value = ALIAS_VALUES[alias]
    cfg = load_config(None, [f"{alias}={value}", "critic.enable=true"])
    node = cfg
    for part in ALIASES[alias].split("."):
        node = getattr(node, part)
    assert node == value


def test_rollout_seed_is_the_sampling_seed():
    from megarl.trainer.loop.fit import RLTrainer
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.cfg = load_config(None, ["actor_rollout_ref.rollout.seed=123", "trainer.seed=5"])
    assert trainer.sampling_seed == 123
    trainer.cfg = load_config(None, ["trainer.seed=5"])
    assert trainer.sampling_seed == 5


def test_every_declared_engine_builds_or_says_why_not():
    """Preflight and the registry read one list (megarl/engines/): each entry names a builder that
    exists, or is refused with its reason."""
    import importlib.util
    from megarl.engines import known
    for info in known():
        module, _, function = info.build.partition(":")
        assert bool(info.refused) != bool(info.build), info
        assert info.refused or (importlib.util.find_spec(module) and function), info


def test_verl_rollout_and_loader_keys_megarl_lacks_are_refused_not_ignored():
    """Keys a verl user sets on a first command line that megarl has no implementation for: each is
    refused in one line, never accepted while the run trains with plain settings."""
    for override, words in [("actor_rollout_ref.rollout.quantization=fp8", "quantized rollout is not supported"),
                            ("actor_rollout_ref.rollout.max_model_len=8", "is less than prompt"),
                            ("actor_rollout_ref.rollout.over_sample_rate=0.1", "filter_groups"),
                            ("actor_rollout_ref.actor.use_torch_compile=true", "torch.compile"),
                            ("data.dataloader_num_workers=4", "loader workers")]:
        with pytest.raises(ConfigError) as err:
            load_config("configs/quickstart.yaml", [override])
        assert words in str(err.value), override


RM_MODEL_CASES = [  # (override under reward_model.model, the words of its one line, or None: accepted)
    ("input_tokenizer=${actor_rollout_ref.model.path}", None),     # verl's default
    ("input_tokenizer=null", None),
    ("use_fused_kernels=false", None), ("trust_remote_code=null", None), ("fsdp_config.param_offload=false", None),
    ("input_tokenizer=/etc", "can only be the actor's model path"),
    ("use_fused_kernels=true", "=true: verl's fused FSDP kernels"),
    ("trust_remote_code=true", "runs no code from it"),
    ("fsdp_config.param_offload=true", "an FSDP engine setting"),
    ("foo=1", "reward_model.model.foo: unknown key; megarl builds the reward model from path"),
]


@pytest.mark.parametrize("override, words", RM_MODEL_CASES, ids=[c[0] for c in RM_MODEL_CASES])
def test_reward_model_model_keys_act_or_are_refused(override, words):
    """reward_model.model is verl's free-form model section: a key there is not ignored unseen."""
    if words is None:
        load_config("configs/quickstart.yaml", [f"reward_model.model.{override}"])
        return
    with pytest.raises(ConfigError) as err:
        load_config("configs/quickstart.yaml", [f"reward_model.model.{override}"])
    assert words in str(err.value) and "\n" not in str(err.value)


def test_reward_model_model_keys_build_the_reward_model(tmp_path, monkeypatch):
    """The keys that act reach the reward model's engine (override_config, use_remove_padding: packing)."""
    from megarl.workers import reward_model

    for name in ("actor", "rm"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"vocab_size": 64}')
    built = []
    monkeypatch.setattr(reward_model, "MegatronEngine", built.append)
    cfg = load_config("configs/quickstart.yaml", [
        "actor_rollout_ref.model.bootstrap=null", f"actor_rollout_ref.model.path={tmp_path / 'actor'}",
        "reward_model.enable=true", f"reward_model.model.path={tmp_path / 'rm'}",
        "reward_model.model.use_remove_padding=false", "reward_model.model.override_config={rms_norm_eps: 0.001}"])
    reward_model.RewardModelWorker.from_config(cfg)
    (spec,) = built
    assert spec.model_path == str(tmp_path / "rm") and spec.head == "value"
    assert spec.packing is False and spec.override_config == {"rms_norm_eps": 0.001}


def test_every_verl_key_away_from_its_default_is_named_at_once():
    """verl's run_qwen2-7b_rm.sh sets five reward_model.rollout.* keys: one line names them all, so a
    user does not remove them one run at a time."""
    with pytest.raises(ConfigError) as err:
        load_config("configs/quickstart.yaml", ["reward_model.rollout.name=vllm",
                                                "reward_model.rollout.gpu_memory_utilization=0.8",
                                                "reward_model.rollout.response_length=1024"])
    text = str(err.value)
    assert text.startswith("reward_model.rollout.name: 'vllm' is not supported") and "\n" not in text
    assert text.endswith("(also away from verl's defaults: reward_model.rollout.gpu_memory_utilization, "
                         "reward_model.rollout.response_length)")


def test_shared_sections_are_read_for_every_role(tmp_path, monkeypatch):
    """ModelConfig and MegatronConfig serve the actor, the reference and the critic (OptimConfig goes whole to
    megatron's optimizer, which is not built here; the leaf-name test covers it). The real
    bootstrap step and worker builds run here (megatron's engine replaced: it reads only the spec) while every
    config read is recorded per section instance. A field read on one role's instance and not on another's
    acts for one role only: for the others it must be refused (REFUSED, FOLLOWS_ACTOR) or read."""
    import torch
    from megarl.config.refused import FOLLOWS_ACTOR
    from megarl.config.typed import Section
    from megarl.job import build as parts
    from megarl.workers import actor, critic, reference

    class Engine:                      # megatron's engine: the spec is all a worker gives it
        device = torch.device("cpu")

        def __init__(self, spec):
            self.spec = spec

    for module in (actor, critic, reference):
        monkeypatch.setattr(module, "MegatronEngine", Engine)
    boot = tmp_path / "boot.py"
    boot.write_text("import os\ndef make(path, cfg, **kw):\n    os.makedirs(path)\n"
                    "    open(os.path.join(path, 'config.json'), 'w').write('{}')\n")
    cfg = load_config("configs/quickstart.yaml", [
        "critic.enable=true", "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.model.path={tmp_path / 'model'}", f"actor_rollout_ref.model.bootstrap={boot}:make",
        "actor_rollout_ref.model.bootstrap_kwargs={a: 1}"])
    monkeypatch.setattr(type(cfg), "check_model", lambda self, hf: None)
    ranks = type("Ranks", (), {"global_rank": 0, "barrier_all": lambda self: None})()
    reads: set[tuple[int, str]] = set()
    plain = Section.__getattribute__

    def recording(self, name):
        reads.add((id(self), name))
        return plain(self, name)

    monkeypatch.setattr(Section, "__getattribute__", recording)
    try:
        parts.ensure_model(cfg, ranks)
        actor.ActorWorker.from_config(cfg), critic.CriticWorker.from_config(cfg)
        reference.ReferenceWorker.from_config(cfg)
    finally:
        monkeypatch.setattr(Section, "__getattribute__", plain)
    arr = cfg.actor_rollout_ref
    roles = {"model": {"actor_rollout_ref.model": arr.model, "critic.model": cfg.critic.model},
             "megatron": {"actor_rollout_ref.actor.megatron": arr.actor.megatron,
                          "actor_rollout_ref.ref.megatron": arr.ref.megatron, "critic.megatron": cfg.critic.megatron}}
    idle = []
    for kind, by_role in roles.items():
        assert all(v is not None for v in by_role.values()), kind
        read = {where: {n for i, n in reads if i == id(obj)} & {f.name for f in dataclasses.fields(obj)}
                for where, obj in by_role.items()}
        assert all(read.values()), f"no reads recorded on some {kind} section: {read}"
        for where, names in read.items():
            own = {f.name for f in dataclasses.fields(by_role[where])}
            for name in (set().union(*read.values()) & own) - names:
                key = f"{where}.{name}"
                if key not in (*REFUSED, *FOLLOWS_ACTOR):
                    idle.append(key)
    assert not idle, f"read for another role but not for this one (refuse them or read them): {sorted(idle)}"


@pytest.mark.parametrize("key, actor_key, unset", [
    ("critic.model.tokenizer_path", "actor_rollout_ref.model.path", "null"),
    ("critic.model.trust_remote_code", "actor_rollout_ref.model.trust_remote_code", "false")])
def test_critic_model_keys_the_actor_governs_take_only_the_actors_value(key, actor_key, unset):
    """verl 0.7 defaults them to the actor's; megarl's critic reads the actor's token ids and runs no code."""
    from megarl.config.refused import FOLLOWS_ACTOR
    value = "/some/model" if key.endswith("path") else "true"
    load_config(None, [f"{actor_key}={value}", f"{key}={value}"])
    load_config(None, [f"{key}={unset}"])
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={value}"] if value == "true" else [f"{actor_key}=/a", f"{key}={value}"])
    assert err.value.key == key and str(err.value).endswith(FOLLOWS_ACTOR[key][1]) and "\n" not in str(err.value)
