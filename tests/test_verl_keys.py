"""Every key of verl's trainer configs is known to megarl: implemented, accepted at verl's default
(with the reason in megarl/config/verl_keys.py), or refused in one line naming what to use.

The oracles are verl's own composed key trees (_generated_ppo_trainer.yaml and
_generated_ppo_megatron_trainer.yaml, written by verl's Hydra from ppo_trainer.yaml /
ppo_megatron_trainer.yaml and the files their defaults lists include) of two releases:
- v0.7.0, stored under tests/assets/verl/config/ with every file they include;
- 0.9.1, read from the installed verl package (CI runs `pip install --no-deps verl==0.9.1`); its
  tests skip, saying so, where verl is not installed.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.experiment import ExperimentConfig
from megarl.config.refused import ALIASES, LEGACY_NULL, REFUSED, RENAMED, moved_from
from megarl.config.verl_keys import RULES, megarl_implements, rule_for, verl_defaults

HERE = os.path.join(os.path.dirname(__file__), "assets", "verl")
sys.path.insert(0, HERE)
from make_defaults import INSTALL, engine_only_values, installed_verl, table, verl_leaves  # noqa: E402

from tests.helpers.verl_scripts import SCRIPTS, classify, key_of, megarl_overrides  # noqa: E402
from tests.helpers.verl_scripts import table as verl_scripts_table  # noqa: E402

ROOTS = ("ppo_trainer.yaml", "ppo_megatron_trainer.yaml")
NO_VERL = f"verl 0.9.1 is not installed, and its key trees come from the installed package: {INSTALL}"
needs_verl = pytest.mark.skipif(installed_verl() is None, reason=NO_VERL)
RELEASES = ["0.7.0", pytest.param("0.9.1", marks=needs_verl)]


def _included(path: str, seen: set[str]) -> None:
    """Follow a Hydra defaults list: `group@mount: option` -> <group>/<option>.yaml, `name` -> same group."""
    seen.add(os.path.relpath(path, os.path.join(HERE, "config")))
    with open(path) as f:
        entries = (yaml.safe_load(f) or {}).get("defaults", [])
    here = os.path.dirname(path)
    for entry in entries:
        if entry == "_self_":
            continue
        group, option = (next(iter(entry.items())) if isinstance(entry, dict) else (entry, None))
        group = group.split("@")[0]
        target = os.path.join(here, group, f"{option}.yaml") if option else os.path.join(here, f"{group}.yaml")
        target = os.path.normpath(target)
        assert os.path.isfile(target), f"{path} includes {entry!r}, not stored at {target}"
        if os.path.relpath(target, os.path.join(HERE, "config")) not in seen:
            _included(target, seen)


def _yaml_value(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def test_every_included_file_is_stored():
    seen: set[str] = set()
    for root in ROOTS:
        _included(os.path.join(HERE, "config", root), seen)
    assert {"actor/megatron_actor.yaml", "actor/dp_actor.yaml", "rollout/rollout.yaml", "data/legacy_data.yaml",
            "engine/megatron.yaml", "optim/fsdp.yaml"} <= seen
    assert len(verl_leaves()) > 650        # 694 distinct leaves at v0.7.0


@needs_verl
def test_installed_trees_are_verl_091s():
    """The installed package's trees are 0.9.1's: larger than 0.7.0's, with the sections 0.9.1 added."""
    leaves = verl_leaves("0.9.1")
    assert len(leaves) > 1000         # 1089 distinct leaves at 0.9.1
    assert {"reward.reward_model.enable", "distillation.enabled", "trainer.use_v1",
            "actor_rollout_ref.actor.megatron.router_replay.mode"} <= set(leaves)
    assert "reward_manager.name" not in leaves          # moved to reward.reward_manager.name
    # its torchtitan and VeOmni engines' trees (model_engine=torchtitan / veomni) are walked too
    assert len(leaves) > 1300         # 1331 with them
    assert {"actor_rollout_ref.actor.torchtitan.attn_type", "critic.veomni.fsdp_size",
            "actor_rollout_ref.ref.optim.name"} <= set(leaves)


@needs_verl
def test_verl_091_engine_trees_values_are_refused_in_one_line():
    """strategy=torchtitan, optim.lr_scheduler_type=cosine and the other values only the torchtitan / VeOmni
    trees give a leaf of the FSDP and megatron trees ask for another engine: one line each, or megarl's
    own meaning (optim.optimizer=adamw)."""
    values = engine_only_values()
    assert {"actor_rollout_ref.actor.strategy", "critic.optim.lr_scheduler_type"} <= set(values)
    for key, defaults in values.items():
        for value in defaults:
            try:
                load_config(None, [f"{key}={_yaml_value(value)}"])
            except ConfigError as err:
                assert err.key == key, str(err)
                assert "\n" not in str(err) and "unknown key" not in str(err), str(err)
            else:
                assert megarl_implements(key, ExperimentConfig), f"{key}={value!r} accepted but not megarl's"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor_rollout_ref.actor.torchtitan.tensor_parallel_size=2"])
    assert "actor_rollout_ref.actor.megatron" in str(err.value) and "torchtitan" in str(err.value)


@needs_verl
def test_defaults_table_is_verls():
    """megarl/config/verl_defaults.yaml equals what verl's composed trees of both releases give (regenerate
    with `python tests/assets/verl/make_defaults.py`, verl 0.9.1 installed)."""
    stored = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "megarl", "config",
                                              "verl_defaults.yaml")))
    assert stored == table()


# megarl keys that refuse a verl default written alone, and why: the value needs other keys set with it
# (sizes against the default batch and ranks), or asks for what megarl does not do, in one line naming its way.
OWN_KEY_REFUSES_VERL_DEFAULT = {
    "actor_rollout_ref.actor.ppo_mini_batch_size": "256 exceeds megarl's default data.train_batch_size",
    "trainer.n_gpus_per_node": "8 ranks split megarl's default mini batch below one row a rank",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "2 exceeds megarl's default single rank",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "null asks use_dynamic_bsz=true (the line says so)",
    "actor_rollout_ref.actor.strategy": "fsdp: megarl trains with megatron-core only",
    "critic.strategy": "fsdp: megarl trains with megatron-core only",
    "actor_rollout_ref.actor.use_torch_compile": "true: megarl runs megatron-core's kernels, not torch.compile",
}


@pytest.mark.parametrize("release", RELEASES)
def test_every_verl_leaf_is_known(release):
    """Each leaf at each of verl's defaults: never 'unknown'; a verl-only key at its default is accepted,
    at another value refused with its reason."""
    unknown, refused_at_default, null_unread, unresolved = [], [], [], []
    for key, defaults in verl_leaves(release).items():
        ours = (megarl_implements(key, ExperimentConfig) or key in REFUSED or key in ALIASES or key in RENAMED
                or moved_from(key) is not None)
        assert ours or key in verl_defaults(), f"{key}: neither megarl's nor in verl_keys"
        if not ours:
            assert rule_for(key), f"{key}: no reason in verl_keys.RULES"
        for value in defaults:
            try:
                load_config(None, [f"{key}={_yaml_value(value)}"])
            except ConfigError as err:
                if "unknown key" in str(err):
                    unknown.append(str(err))
                elif not ours:
                    refused_at_default.append(str(err))
                elif isinstance(value, str) and "${" in value:
                    unresolved.append(str(err))        # verl's own reference, written alone, must resolve
                elif value is not None and key not in OWN_KEY_REFUSES_VERL_DEFAULT:
                    refused_at_default.append(str(err))  # a megarl key takes verl's default with verl's meaning
                elif value is None and ("got None" in str(err) or "\n" in str(err) or "set " not in str(err)):
                    null_unread.append(str(err))     # a null megarl implements: verl's meaning, or what to set
    assert not unknown, unknown[:5]
    assert not refused_at_default, refused_at_default[:5]
    assert not null_unread, null_unread[:5]
    assert not unresolved, unresolved[:5]


def test_verl_reference_defaults_mean_what_verl_means():
    """verl writes some defaults as references: `${.key}` (a key of the same section),
    `${oc.select:key,{}}` (a default in braces), and a reference to a verl key megarl drops at its
    default. Written alone, each reads what verl reads."""
    critic = "critic.forward_max_token_len_per_gpu=${.ppo_max_token_len_per_gpu}"
    cfg = load_config(None, [critic, "critic.ppo_max_token_len_per_gpu=3000"])
    assert cfg.critic.forward_max_token_len_per_gpu == 3000
    # the critic's budget left at its default follows the actor's, and the forward budget follows it
    cfg = load_config(None, [critic, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=5000"])
    assert cfg.critic.forward_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu == 5000
    ref = ("actor_rollout_ref.ref.megatron.override_transformer_config="
           "${oc.select:actor_rollout_ref.actor.megatron.override_transformer_config,{}}")
    actor_override = "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full"
    assert load_config(None, [ref]).actor_rollout_ref.ref.megatron.override_transformer_config == {}
    assert load_config(None, [ref, actor_override]).actor_rollout_ref.ref.megatron.override_transformer_config == {
        "recompute_granularity": "full"}
    fused = "reward_model.model.use_fused_kernels=${actor_rollout_ref.model.use_fused_kernels}"
    assert load_config(None, [fused]).reward_model.model == {"use_fused_kernels": False}
    # a reference inside a longer string, braces in its default, and one up a section
    cfg = load_config(None, ["trainer.experiment_name=run-${oc.select:trainer.not_a_key,{a}}-x",
                             "trainer.project_name=${..trainer.experiment_name}"])
    assert (cfg.trainer.experiment_name, cfg.trainer.project_name) == ("run-{'a': None}-x",) * 2
    with pytest.raises(ConfigError) as err:
        load_config(None, ["critic.forward_max_token_len_per_gpu=${.no_such_budget}"])
    assert "${critic.no_such_budget}, which is not set" in str(err.value)


def test_a_reference_megatron_key_leaves_the_others_at_the_actors():
    """verl defaults each of the reference's megatron keys to the actor's value; setting one (verl's
    scripts set ref.megatron.param_offload) keeps the actor's layout and overrides for the rest."""
    cfg = load_config(None, ["trainer.n_gpus_per_node=2",
                             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                             "actor_rollout_ref.actor.megatron.seed=7",
                             "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
                             "actor_rollout_ref.ref.megatron.param_offload=true"])
    ref = cfg.actor_rollout_ref.ref.megatron
    assert (ref.tensor_model_parallel_size, ref.seed, ref.param_offload) == (2, 7, True)
    assert ref.override_transformer_config == {"recompute_granularity": "full"}
    assert not cfg.actor.megatron.param_offload


def test_verl_null_defaults_mean_what_verl_means():
    """data.seed=null: verl shuffles with torch.Generator()'s built-in seed, one fixed order every run;
    ppo_micro_batch_size_per_gpu=null: micro-batches cut by tokens only (verl asks use_dynamic_bsz)."""
    import torch
    from megarl.data.loader import ResumableSampler
    assert torch.Generator().initial_seed() == torch.Generator().initial_seed()     # verl's null: fixed
    seeded = load_config(None, ["data.seed=null"])
    assert seeded.data.seed == load_config(None).data.seed
    orders = [ResumableSampler(32, 8, True, load_config(None, ["data.seed=null"]).data.seed).order(0)
              for _ in range(2)]
    assert list(orders[0]) == list(orders[1]) != list(range(32))
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    cfg = load_config(None, [f"{micro}=null", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "algorithm.adv_estimator=gae"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu is None and cfg.critic.use_dynamic_bsz
    for extra, key, words in (
            ([], micro, "actor_rollout_ref.actor.use_dynamic_bsz=true"),
            (["actor_rollout_ref.actor.use_dynamic_bsz=true",
              "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false"],
             "actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz=true"),
            (["actor_rollout_ref.actor.use_dynamic_bsz=true", "algorithm.adv_estimator=gae",
              "critic.use_dynamic_bsz=false"], "critic.ppo_micro_batch_size_per_gpu", "critic.use_dynamic_bsz=true"),
            (["reward_model.enable=true", "reward_model.micro_batch_size_per_gpu=null", f"{micro}=4"],
             "reward_model.micro_batch_size_per_gpu", "e.g. 4")):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{micro}=null", *extra])
        assert err.value.key == key and words in str(err.value) and "\n" not in str(err.value)
    # with its own row count a row-cut pass runs beside token-budget ones
    cfg = load_config(None, [f"{micro}=null", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
                             "actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu=8"])
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == 8


@pytest.mark.parametrize("override,expect", [
    ("trainer.critic_warmup=3", "critic warm-up steps are not implemented"),
    ("actor_rollout_ref.actor.fsdp_config.param_offload=true", "actor_rollout_ref.actor.megatron"),
    ("actor_rollout_ref.actor.megatron.use_dist_checkpointing=true", "dist_checkpointing_path"),
    ("actor_rollout_ref.actor.optim.warmup_style=cosine", "lr_decay_style"),
    ("trainer.default_hdfs_dir=hdfs://x", "trainer.default_local_dir"),
    ("ray_kwargs.ray_init.num_cpus=8", "torchrun or srun"),
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model]", "trainer.save_freq"),
])
def test_non_default_verl_values_are_refused_with_the_alternative(override, expect):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expect in str(err.value) and "\n" not in str(err.value)


def test_verl_defaults_carry_over():
    cfg = load_config(None, ["trainer.critic_warmup=0", "trainer.val_only=false", "trainer.default_hdfs_dir=null",
                             "trainer.del_local_ckpt_after_load=false",
                             "actor_rollout_ref.actor.optim.warmup_style=null",
                             "actor_rollout_ref.actor.megatron.use_mbridge=true", "ray_kwargs.ray_init.num_cpus=null",
                             "actor_rollout_ref.actor.fsdp_config.param_offload=false",
                             "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]"])
    assert cfg.trainer.save_freq == load_config(None).trainer.save_freq


@pytest.mark.parametrize("override,hint", [
    ("trainer.save_frq=3", "; did you mean 'trainer.save_freq'?"),
    # near verl's max_critic_ckpt_to_keep (refused away from null), the hint is megarl's key that acts
    ("trainer.max_critc_ckpt_to_keep=1", "; did you mean 'trainer.max_actor_ckpt_to_keep'?"),
    # near keys megarl drops at verl's default only: no hint (tests/test_config_hints.py)
    ("trainer.critc_warmup=0", ": unknown key"),
    ("actor_rollout_ref.actor.fsdp_confg.param_offload=false", ": unknown key"),
])
def test_suggestions_come_from_the_same_section(override, hint):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).endswith(hint)


def test_unrelated_key_gets_no_far_suggestion():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.zzz_nothing_alike=1"])
    assert str(err.value) == "trainer.zzz_nothing_alike: unknown key"


def test_rules_all_used():
    patterns = {p for p, _ in RULES}
    import fnmatch
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(k, p) for k in verl_defaults())]
    assert not unused, unused


@pytest.mark.parametrize("flag", ["--config-name=ppo_megatron_trainer", "--config-path=verl/trainer/config"])
def test_hydra_flags_get_one_line(flag, tmp_path):
    out = subprocess.run([sys.executable, "-m", "megarl.train", flag], capture_output=True, text=True,
                         cwd=tmp_path, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--config path/to/file.yaml" in out.stderr


def test_dapo_recipes_overlong_buffer_is_read_as_megarls():
    cfg = load_config(None, ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=64",
                             "reward_model.overlong_buffer.penalty_factor=0.5",
                             "reward_model.overlong_buffer.log=false",
                             "algorithm.overlong_buffer.len=64"])          # both spellings, agreeing
    assert (cfg.algorithm.overlong_buffer.enable, cfg.algorithm.overlong_buffer.len,
            cfg.algorithm.overlong_buffer.penalty_factor) == (True, 64, 0.5)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["reward_model.overlong_buffer.len=64", "algorithm.overlong_buffer.len=32"])
    assert err.value.key == "reward_model.overlong_buffer.len" and "algorithm.overlong_buffer.len=32" in str(err.value)


@pytest.mark.parametrize("override,key,words", [
    ("reward_model.reward_manager=dapo", "reward_model.reward_manager", "algorithm.overlong_buffer"),
    ("data.gen_batch_size=1536", "data.gen_batch_size", "algorithm.filter_groups.max_num_gen_batches"),
    ("hydra.run.dir=outputs/x", None, "trainer.default_local_dir="),
    ("+trainer.not_a_key=1", "trainer.not_a_key", "megarl reads Hydra's +trainer.not_a_key as trainer.not_a_key"),
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
     "actor_rollout_ref.actor.checkpoint.save_contents", "checkpoints_tools/megatron_to_hf.py"),
])
def test_verl_recipe_habits_get_one_line_naming_megarls_way(override, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == key and words in str(err.value) and "\n" not in str(err.value)
    assert "did you mean" not in str(err.value)      # data.gen_batch_size is not data.train_batch_size


def test_verl_recipe_keys_that_megarl_does_are_accepted():
    assert load_config(None, ["data.return_raw_chat=True"]).data.return_raw_chat is True
    assert load_config(None, ["+trainer.total_epochs=3"]).trainer.total_epochs == 3    # + read as the plain key
    docs = open("docs/verl.md").read()
    for named in ("reward_model.overlong_buffer", "data.gen_batch_size", "megatron_to_hf.py", "hydra.run.dir",
                  "trainer.rollout_data_dir", "val-core/"):
        assert named in docs, named


@pytest.mark.parametrize("override,alternative", [
    ("reward.reward_model.rollout.tensor_model_parallel_size=4", "reward_model.model.path"),
    ("critic.megatron.router_replay.mode=R3", "actor_rollout_ref.actor.router_replay.mode"),
    ("distillation.enabled=true", "distillation from a teacher model is not implemented"),
    ("trainer.use_v1=false", "async_training"),
    ("actor_rollout_ref.rollout.disaggregation.enabled=true", "actor_rollout_ref.rollout.placement=disaggregated"),
    ("critic.optim.muon_momentum=0.9", "critic.optim.optimizer is adam or adamw"),
    ("skip.rollout.enable=true", "every step generates"),
    ("actor_rollout_ref.rollout.multi_turn.function_tool_path=tools.py", "multi_turn.tool_config_path"),
])
def test_verl_091_keys_are_refused_naming_megarls_key(override, alternative):
    """Keys verl 0.9.1 added or moved: a value other than verl's default stops with one line naming
    megarl's way (verl's spelling at 0.9.1's default is accepted: test_every_verl_leaf_is_known)."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == override.split("=")[0]
    assert alternative in str(err.value) and "\n" not in str(err.value)


def test_verl_091_custom_reward_function_spelling_is_read_as_megarls(tmp_path):
    """verl 0.9.1 moved custom_reward_function under reward.; megarl reads it as its own section."""
    cfg = load_config(None, ["reward.custom_reward_function.path=my_reward", "reward.custom_reward_function.name=fn"])
    assert (cfg.custom_reward_function.path, cfg.custom_reward_function.name) == ("my_reward", "fn")
    # a relative file in a config file is taken from the file's folder, as under megarl's spelling
    (tmp_path / "cfg.yaml").write_text("reward:\n  custom_reward_function:\n    path: rules/score.py\n")
    assert load_config(str(tmp_path / "cfg.yaml")).custom_reward_function.path == str(tmp_path / "rules/score.py")
    with pytest.raises(ConfigError) as err:
        load_config(None, ["reward.custom_reward_function.name=fn", "custom_reward_function.name=other"])
    assert err.value.key == "reward.custom_reward_function.name" and "custom_reward_function.name='other'" in str(
        err.value)
    # verl 0.9.1's null under the old spelling means "not set": the new spelling's value stands
    cfg = load_config(None, ["custom_reward_function.name=null", "reward.custom_reward_function.name=fn"])
    assert cfg.custom_reward_function.name == "fn"


def test_verl_091_moved_keys_are_read_as_megarls(tmp_path):
    """verl 0.9.1's spelling of a key megarl has is read as megarl's key; both set must agree."""
    cfg = load_config(None, ["reward.num_workers=4", "reward.reward_manager.name=batch",
                             "reward.reward_model.enable=false",
                             "actor_rollout_ref.actor.megatron.router_replay.mode=R2"])
    assert (cfg.reward_model.num_workers, cfg.reward_model.reward_manager) == (4, "batch")
    assert cfg.actor.router_replay.mode == "R2"
    (tmp_path / "rm").mkdir()
    (tmp_path / "cfg.yaml").write_text("reward:\n  reward_model:\n    enable: false\n    model_path: rm\n")
    assert load_config(str(tmp_path / "cfg.yaml")).reward_model.model["path"] == str(tmp_path / "rm")
    # 0.9.1's null model_path is "not set"; verl 0.7's spelling beside it stands
    assert load_config(None, ["reward.reward_model.model_path=null", "reward_model.model.path=/m"]
                       ).reward_model.model["path"] == "/m"
    # verl 0.9.1's whole reward tree at its defaults, with verl 0.7's keys at their placeholder nulls
    cfg = load_config(None, ["reward.num_workers=8", "reward_model.num_workers=null",
                             "reward.reward_manager.name=naive", "reward_model.reward_manager=null"])
    assert (cfg.reward_model.num_workers, cfg.reward_model.reward_manager) == (8, "naive")
    with pytest.raises(ConfigError) as err:
        load_config(None, ["reward.num_workers=4", "reward_model.num_workers=2"])
    assert err.value.key == "reward.num_workers" and "reward_model.num_workers=2" in str(err.value)


@needs_verl
def test_verl_091_legacy_reward_nulls_read_as_unset():
    """verl 0.9.1 keeps verl 0.7's reward keys at null ("read reward.* instead"); each such key of the
    installed tree loads, and megarl's defaults apply where megarl implements it."""
    leaves = verl_leaves("0.9.1")
    legacy = sorted(k for k, d in leaves.items()
                    if k.split(".")[0] in ("custom_reward_function", "reward_model") and d == [None])
    assert set(LEGACY_NULL) <= set(legacy)
    cfg, base = load_config(None, [f"{k}=null" for k in legacy]), load_config(None)
    assert cfg.custom_reward_function.name == base.custom_reward_function.name == "compute_score"
    assert (cfg.reward_model.enable, cfg.reward_model.reward_manager) == (False, "naive")
    assert cfg.reward_model.num_workers == base.reward_model.num_workers


@needs_verl
def test_docs_name_what_verl_091_changed():
    """docs/verl.md's section on verl 0.9.1 names every top-level section 0.9.1 added or removed."""
    text = open("docs/verl.md").read()
    assert "## What verl 0.9.1 changed since 0.7.0" in text
    section = text.split("## What verl 0.9.1 changed since 0.7.0", 1)[1].split("\n## ", 1)[0]
    old = {k.split(".")[0] for k in verl_leaves("0.7.0")}
    new = {k.split(".")[0] for k in verl_leaves("0.9.1")}
    assert old ^ new, "0.9.1 has the same top-level sections as 0.7.0"
    missing = [name for name in sorted(old ^ new) if f"`{name}" not in section]
    assert not missing, missing


def test_verl_091_naive_checkpoint_engine_is_megarls_colocated_transport():
    """verl 0.9.1's default backend `naive` is its engine for a rollout on the training ranks."""
    key = "actor_rollout_ref.rollout.checkpoint_engine.backend"
    assert load_config(None, [f"{key}=naive"]).actor_rollout_ref.rollout.checkpoint_engine.backend == "colocated"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=naive", "actor_rollout_ref.rollout.placement=disaggregated",
                           "actor_rollout_ref.rollout.disaggregated_ranks=1", "trainer.n_gpus_per_node=2"])
    assert err.value.key == key and "backend=auto or distributed" in str(err.value)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_verl_scripts_overrides_are_each_known(name):
    """verl's example scripts (tests/helpers/verl_scripts*.py), with only docs/verl.md's changes
    (model, data, sizes, engine name), loaded through megarl's config in this process: no override
    is unknown or fails badly; each refusal is one line naming megarl's key or the fix, given
    beside the script's overrides megarl takes (some refusals hold only with them, e.g. an expert
    TP size against the script's TP size)."""
    overrides, changed = megarl_overrides(name)
    assert set(changed) <= {key_of(o) for o in overrides}
    classes = classify(overrides)
    assert set(classes) == set(overrides)
    bad = {o: c for o, c in classes.items() if c not in ("implemented", "accepted at verl's default", "refused")}
    assert not bad, bad
    kept = [o for o in overrides if classes[o] != "refused"]
    load_config(None, kept)
    for text in (o for o, c in classes.items() if c == "refused"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [*kept, text])
        key = key_of(text)              # a `+` dict leaf is refused by its dict's key
        assert (err.value.key == key or key.startswith(f"{err.value.key}.")) and "\n" not in str(err.value)
        assert any(w in str(err.value) for w in ("set ", "remove", "use ", "leave it")), str(err.value)


def test_docs_hold_the_verl_scripts_table():
    """docs/verl.md's table is what `python -m tests.helpers.verl_scripts` prints today."""
    assert verl_scripts_table() in open("docs/verl.md").read()
