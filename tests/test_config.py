"""Config loading, bases, overrides, interpolation and every one-line error (issue: foundation)."""
import subprocess
import sys
import textwrap

import pytest

from megarl.config import ConfigError
from megarl.experiment import ExperimentConfig, load_config
from megarl.config.loader import parse_override

SEED_OVERRIDES = ["actor_rollout_ref.rollout.name=trtllm", "actor_rollout_ref.rollout.n=5",
                  "data.chat_template=chatml", "algorithm.adv_estimator=grpo"]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_defaults_are_valid():
    cfg = load_config(None)
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.rollout.name == "native"
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable  # gae turns the critic on
    assert cfg.rollout.prompt_length == cfg.data.max_prompt_length


def test_seed_overrides_as_written():
    cfg = load_config(None, SEED_OVERRIDES)
    assert (cfg.rollout.name, cfg.rollout.n, cfg.data.chat_template) == ("trtllm", 5, "chatml")
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.critic.enable


def test_every_verl_rollout_field_is_known():
    # verl's RolloutConfig fields, plus the keys of verl's inference guide, at values megarl implements;
    # the values it does not implement are refused one by one (tests/test_config_keys.py).
    fields = dict(name="sglang", mode="sync", temperature=0.7, top_k=50, top_p=0.9, do_sample=True, n=4,
                  repetition_penalty=1.1, over_sample_rate=0.0, prompt_length=1024, response_length=2048,
                  dtype="bfloat16", gpu_memory_utilization=0.6, ignore_eos=False, enforce_eager=True,
                  free_cache_engine=True, data_parallel_size=1, expert_parallel_size=1,
                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1, max_num_batched_tokens=8192,
                  max_model_len=4096, max_num_seqs=256, log_prob_micro_batch_size=None,
                  log_prob_micro_batch_size_per_gpu=2, log_prob_use_dynamic_bsz=False,
                  log_prob_max_token_len_per_gpu=16384, enable_chunked_prefill=True, enable_prefix_caching=True,
                  enable_sleep_mode=True, load_format="dummy", quantization=None)
    overrides = [f"actor_rollout_ref.rollout.{k}={'null' if v is None else v}" for k, v in fields.items()]
    overrides += ["actor_rollout_ref.rollout.val_kwargs.temperature=0.2",
                  "actor_rollout_ref.rollout.multi_turn.enable=true",
                  "actor_rollout_ref.rollout.server.timeout=60",
                  "actor_rollout_ref.rollout.checkpoint_engine.bucket_size_mb=256",
                  "actor_rollout_ref.rollout.custom_cls_path=my_rollout.py",
                  "actor_rollout_ref.rollout.custom_cls_name=CustomRollout",
                  "actor_rollout_ref.rollout.tools=tools.yaml",
                  "actor_rollout_ref.rollout.interactions=[conversation]",
                  "actor_rollout_ref.rollout.max_response_length=2048"]
    cfg = load_config(None, overrides)
    ro = cfg.rollout
    assert ro.mode == "sync" and ro.top_k == 50 and ro.response_length == 2048
    assert ro.multi_turn.enable and ro.multi_turn.tool_config_path == "tools.yaml"
    assert ro.checkpoint_engine.bucket_size_mb == 256 and ro.val_kwargs.temperature == 0.2


def test_async_mode_and_placement_rules():
    # verl's rollout.mode=async (its default) is its agent-loop server, whose step still waits for every
    # generation: megarl's step does too; overlap is placement=disaggregated.
    assert load_config(None, ["actor_rollout_ref.rollout.mode=async"]).rollout.mode == "async"
    with pytest.raises(ConfigError, match="partial_rollout.*placement=disaggregated"):
        load_config(None, ["async_training.partial_rollout=true"])
    with pytest.raises(ConfigError, match="filter_groups.*disaggregated"):
        load_config(None, ["actor_rollout_ref.rollout.placement=disaggregated", "trainer.n_gpus_per_node=2",
                           "actor_rollout_ref.rollout.disaggregated_ranks=1", "algorithm.filter_groups.enable=true"])
    with pytest.raises(ConfigError, match="stale_samples"):
        load_config(None, ["async_training.max_staleness=0", "async_training.stale_samples=drop"])
    with pytest.raises(ConfigError, match="update_at_chunk.*partial_rollout=true"):
        load_config(None, ["async_training.update_at_chunk=1"])
    with pytest.raises(ConfigError, match="tail_overlap.*partial_rollout=true"):
        load_config(None, ["async_training.tail_overlap=0.5"])
    with pytest.raises(ConfigError, match=r"tail_overlap.*\[0, 1\]"):
        load_config(None, ["async_training.partial_rollout=true", "async_training.tail_overlap=1.5"])
    with pytest.raises(ConfigError, match="handoff.*set async_training.tail_overlap > 0"):
        load_config(None, ["async_training.partial_rollout=true", "async_training.handoff=finished_groups"])
    with pytest.raises(ConfigError, match="handoff"):
        load_config(None, ["async_training.handoff=groups"])
    with pytest.raises(ConfigError, match="kv_after_update.*partial_rollout=true"):
        load_config(None, ["async_training.kv_after_update=keep"])
    stream = ["actor_rollout_ref.rollout.placement=disaggregated", "trainer.n_gpus_per_node=2",
              "actor_rollout_ref.rollout.disaggregated_ranks=1", "async_training.partial_rollout=true",
              "async_training.kv_after_update=keep"]
    assert load_config(None, stream).async_training.kv_after_update == "keep"
    keep_refused = r"^async_training.kv_after_update: =keep needs an engine.*rollout.name=native.*the hf engine"
    with pytest.raises(ConfigError, match=keep_refused):
        load_config(None, [*stream, "actor_rollout_ref.rollout.name=hf"])
    with pytest.raises(ConfigError, match="checkpoint_engine.backend.*distributed transport"):
        load_config(None, ["actor_rollout_ref.rollout.placement=disaggregated", "trainer.n_gpus_per_node=2",
                           "actor_rollout_ref.rollout.disaggregated_ranks=1",
                           "actor_rollout_ref.rollout.checkpoint_engine.backend=colocated"])
    with pytest.raises(ConfigError, match="keep_previous_weights.*distributed transport"):
        load_config(None, ["actor_rollout_ref.rollout.checkpoint_engine.keep_previous_weights=false"])
    cfg = load_config(None, ["actor_rollout_ref.rollout.placement=disaggregated", "trainer.n_gpus_per_node=3",
                             "actor_rollout_ref.rollout.disaggregated_ranks=1", "async_training.partial_rollout=true"])
    assert cfg.train_world_size == 2 and cfg.async_training.max_staleness == 1
    # a resumed chunk's prompt is prompt + response so far: the engine's prompt length holds both
    assert cfg.rollout.prompt_length == cfg.data.max_prompt_length + cfg.data.max_response_length
    with pytest.raises(ConfigError, match=r"rollout.prompt_length: .* cannot hold a resumed chunk's prompt"):
        load_config(None, ["actor_rollout_ref.rollout.placement=disaggregated", "trainer.n_gpus_per_node=3",
                           "actor_rollout_ref.rollout.disaggregated_ranks=1", "async_training.partial_rollout=true",
                           f"actor_rollout_ref.rollout.prompt_length={cfg.data.max_prompt_length}"])


def test_base_and_override_order(tmp_path):
    write(tmp_path, "base.yaml", """
        data: {train_batch_size: 8, max_prompt_length: 64}
        actor_rollout_ref:
          rollout: {n: 4, temperature: 0.9}
          actor: {ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 2}
        algorithm: {adv_estimator: grpo}
        """)
    child = write(tmp_path, "child.yaml", """
        base: base.yaml
        actor_rollout_ref:
          rollout: {temperature: 0.5}
        trainer: {experiment_name: exp1, default_local_dir: "runs/${trainer.experiment_name}"}
        """)
    cfg = load_config(child, ["actor_rollout_ref.rollout.temperature=0.3"])
    assert cfg.rollout.n == 4 and cfg.data.train_batch_size == 8   # from the base
    assert cfg.rollout.temperature == 0.3                             # override beats child beats base
    assert cfg.trainer.default_local_dir == "runs/exp1"               # interpolation
    assert cfg.rollout.prompt_length == 64                            # filled across sections


def test_oc_select_as_verls_configs_write_it(tmp_path):
    """verl's generated configs use OmegaConf's `${oc.select:key,default}`: the key's value where it
    is set (megarl's defaults count, null included), else the default as YAML types it, else null."""
    path = write(tmp_path, "verl_style.yaml", """
        data:
          max_prompt_length: ${oc.select:data.not_a_key,48}
          max_response_length: "${oc.select:data.max_prompt_length, 16}"
        trainer:
          experiment_name: run-${oc.select:trainer.not_a_key,abc}
          project_name: ${oc.select:trainer.experiment_name}
          resume_from_path: ${oc.select:trainer.not_a_key}
        actor_rollout_ref:
          actor: {ppo_epochs: "${oc.select:actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu,7}"}
        """)
    cfg = load_config(path)
    assert cfg.data.max_prompt_length == 48 and cfg.data.max_response_length == 48
    assert cfg.trainer.experiment_name == cfg.trainer.project_name == "run-abc"
    assert cfg.trainer.resume_from_path is None
    assert cfg.actor.ppo_epochs == cfg.actor.ppo_micro_batch_size_per_gpu == 4   # megarl's default counts


def test_base_cycle_is_named(tmp_path):
    write(tmp_path, "a.yaml", "base: b.yaml\n")
    b = write(tmp_path, "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(b)


def test_float_fields_take_yaml_exponent_strings():
    # PyYAML reads `1e-4` as a string (YAML 1.1); a float field must still take it.
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-4", "critic.optim.lr=3E-5"])
    assert cfg.actor.optim.lr == 1e-4 and cfg.critic.optim.lr == 3e-5
    with pytest.raises(ConfigError, match="expected float"):
        load_config(None, ["actor_rollout_ref.actor.optim.lr=fast"])


def test_override_values_are_typed():
    assert parse_override("a.b=5") == (["a", "b"], 5)
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override("a.b=[1,2]") == (["a", "b"], [1, 2])
    assert parse_override("a.b=tools.yaml") == (["a", "b"], "tools.yaml")
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_override("nonsense")


@pytest.mark.parametrize("overrides, key, words", [
    (["actor_rollout_ref.rollout.tmperature=0.3"],
     "actor_rollout_ref.rollout.tmperature", "did you mean 'actor_rollout_ref.rollout.temperature'"),
    (["rollout.n=5"], "rollout.n", "samples actor_rollout_ref.rollout.n responses a prompt, as megarl does; set that"),
    (["trainr.save_freq=3"], "trainr", "did you mean 'trainer'"),
    (["actor_rollout_ref.rollout.n=five"], "actor_rollout_ref.rollout.n", "got 'five' (str), expected int"),
    (["trainer.save_freq=1.5"], "trainer.save_freq", "expected int"),
    (["actor_rollout_ref.rollout.do_sample=yes please"], "actor_rollout_ref.rollout.do_sample", "expected bool"),
    (["trainer.resume_mode=auot"], "trainer.resume_mode", "did you mean 'auto'"),
    (["actor_rollout_ref.rollout.top_p=1.5"], "actor_rollout_ref.rollout.top_p", "(0, 1]"),
    (["actor_rollout_ref.rollout.temperature=-1"], "actor_rollout_ref.rollout.temperature", ">= 0"),
    (["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n", "n >= 2"),
    (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "does not divide the 3 training ranks"),
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3"],
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "PP 3"),
    (["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
     "actor_rollout_ref.actor.ppo_mini_batch_size",
     "(verl would make the last one smaller); set ppo_mini_batch_size to a divisor of 6, e.g. 3"),
    (["trainer.n_gpus_per_node=2", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
      "actor_rollout_ref.rollout.n=3", "algorithm.adv_estimator=grpo",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "micro_batch_size_per_gpu x DP = 2 x 2"),
    (["algorithm.adv_estimator=gae", "critic.enable=false"], "critic.enable", "needs a critic"),
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
     "actor_rollout_ref.rollout.tensor_model_parallel_size", "does not divide"),
    (["actor_rollout_ref.rollout.name=custom"], "actor_rollout_ref.rollout.custom_cls_path", "custom_cls_name"),
    (["data.max_prompt_length=${trainer.nope}"], "data.max_prompt_length", "not set"),
    (["actor_rollout_ref.actor.optim.optimizer=Adam"], "actor_rollout_ref.actor.optim.optimizer", "use adamw"),
    (["critic.optim.optimizer=sgd"], "critic.optim.optimizer", "expected 'adamw'"),
])
def test_errors_name_key_and_fix(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    err = info.value
    assert err.key == key, str(err)
    assert words in str(err)
    assert "\n" not in str(err)


def test_token_budgets_ignore_the_row_micro_batch_the_user_never_set():
    """Under use_dynamic_bsz micro-batches are cut by tokens (as verl does and megarl's update checks),
    so a small mini batch is not refused for the default ppo_micro_batch_size_per_gpu; by rows it is."""
    small = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
             "actor_rollout_ref.rollout.n=2",
             "algorithm.adv_estimator=grpo"]
    cfg = load_config(None, [*small, "actor_rollout_ref.actor.use_dynamic_bsz=true"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu == ExperimentConfig().actor.ppo_micro_batch_size_per_gpu > 2
    with pytest.raises(ConfigError, match="not divisible by ppo_micro_batch_size_per_gpu"):
        load_config(None, small)


def test_verls_optimizer_spellings():
    """verl's megatron config says `adam` (megatron's: decoupled decay), its FSDP one `AdamW` (torch's
    class): both are megarl's decoupled AdamW update; torch's coupled `Adam` is refused above."""
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.optimizer=AdamW", "critic.optim.optimizer=adam"])
    assert cfg.actor.optim.optimizer == "adamw" and cfg.critic.optim.optimizer == "adam"


def test_model_rules():
    cfg = load_config(None, ["trainer.n_gpus_per_node=4",
                             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"])
    hf = {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4}
    with pytest.raises(ConfigError, match="2 KV groups"):
        cfg.check_model(hf)
    cfg = load_config(None, ["trainer.n_gpus_per_node=3",
                             "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3"])
    with pytest.raises(ConfigError, match="PP 3 must divide the model's 4 layers"):
        cfg.check_model(hf)


def test_yaml_errors(tmp_path):
    bad = write(tmp_path, "bad.yaml", "data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    top = write(tmp_path, "list.yaml", "- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top)


def test_cli_one_line_error_and_print_config(tmp_path):
    def run(*a):
        return subprocess.run([sys.executable, "-m", "megarl.train", *a], capture_output=True, text=True)
    bad = run("actor_rollout_ref.rollout.tmperature=0.3")
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr
    assert "did you mean 'actor_rollout_ref.rollout.temperature'" in bad.stderr
    ok = run("--print-config", *SEED_OVERRIDES)
    assert ok.returncode == 0, ok.stderr
    import yaml
    printed = yaml.safe_load(ok.stdout)
    assert printed["actor_rollout_ref"]["rollout"]["n"] == 5
    # The printed config loads back to the same tree.
    path = tmp_path / "resolved.yaml"
    path.write_text(ok.stdout)
    assert load_config(str(path)).to_dict() == load_config(None, SEED_OVERRIDES).to_dict()


def test_shipped_configs_validate():
    import glob
    paths = sorted(glob.glob("configs/*.yaml"))
    assert paths, "configs/ should hold experiment files"
    for path in paths:
        load_config(path)


def test_enforce_eager_acts_for_native_and_is_refused_where_no_engine_captures_graphs():
    assert load_config(None, []).rollout.enforce_eager is None          # native: graphs on CUDA
    assert load_config(None, ["actor_rollout_ref.rollout.enforce_eager=true"]).rollout.enforce_eager is True
    for name in ("hf", "trtllm"):
        with pytest.raises(ConfigError, match="enforce_eager: false asks for CUDA graphs"):
            load_config(None, [f"actor_rollout_ref.rollout.name={name}",
                               "actor_rollout_ref.rollout.enforce_eager=false"])


def test_built_config_is_frozen_and_roles_own_their_layout():
    """Once built and validated the tree refuses changes; derived values go in a resolved copy."""
    import dataclasses

    from megarl.config.typed import FrozenConfigError
    cfg = load_config(None, ["critic.enable=true", "trainer.total_epochs=2"])
    for set_it in (lambda: setattr(cfg.actor.optim, "total_training_steps", 9),
                   lambda: setattr(cfg.trainer, "seed", 3),
                   lambda: setattr(cfg.actor_rollout_ref, "rollout", None),
                   lambda: setattr(cfg, "critic", None),
                   lambda: cfg.actor.optim.betas.__setitem__(0, 0.5),     # lists and mappings inside it too
                   lambda: cfg.trainer.logger.append("wandb"),
                   lambda: cfg.data.train_files.extend(["more.jsonl"]),
                   lambda: cfg.actor_rollout_ref.rollout.engine_kwargs.update(native={})):
        with pytest.raises(FrozenConfigError, match="frozen"):
            set_it()
    import copy
    import pickle
    for again in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):   # copies stay frozen and equal
        assert again.to_dict() == cfg.to_dict() and again.actor.optim.betas == [0.9, 0.999]
        with pytest.raises(FrozenConfigError):
            again.actor.optim.betas.append(1.0)
    # The critic and the reference take the actor's layout as a copy, not the actor's own object.
    actor, critic, ref = cfg.actor.megatron, cfg.critic.megatron, cfg.actor_rollout_ref.ref.megatron
    assert critic is not actor and ref is not actor and critic == actor == ref
    run = cfg.resolved(17)
    assert run.actor.optim.total_training_steps == 17 and run.critic.optim.total_training_steps == 17
    assert cfg.actor.optim.total_training_steps == -1           # the built tree is unchanged
    with pytest.raises(FrozenConfigError):
        run.trainer.seed = 3
    # An explicit step count stays; replace() builds a new (unfrozen) section.
    assert load_config(None, ["actor_rollout_ref.actor.optim.total_training_steps=5"]).resolved(17) \
        .actor.optim.total_training_steps == 5
    assert dataclasses.replace(cfg.trainer, seed=3).seed == 3


@pytest.mark.parametrize("override, key, fix", [
    ("actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=2",
     "actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size=2"),
    ("actor_rollout_ref.ref.megatron.tensor_model_parallel_size=two",
     "actor_rollout_ref.ref.megatron.tensor_model_parallel_size", "expected int"),
    ("critic.megatron.context_parallel_size=0", "critic.megatron.context_parallel_size", ">= 1"),
    ("critic.megatron.tensor_model_parallel_sise=2", "critic.megatron.tensor_model_parallel_sise",
     "critic.megatron.tensor_model_parallel_size"),
])
def test_optional_megatron_sections_name_the_leaf_key(override, key, fix):
    """ref.megatron and critic.megatron may be null; a bad value inside still names its own key."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert message.startswith(key + ":") and fix in message and "\n" not in message, message


LAUGHS = "custom_reward_function:\n  reward_kwargs:\n    a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + \
    "".join(f"    {b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcdefg", "bcdefgh"))


@pytest.mark.parametrize("text, words", [
    (LAUGHS, "aliases expand to over 200000 values"),                        # 10**8 values in ~500 bytes
    ("data: " + "[" * 3000 + "]" * 3000 + "\n", "nests too deeply"),
    ("data: &x [1, *x]\n", "an alias refers to itself"),
    ("custom_reward_function:\n  reward_kwargs:\n" + "".join(
        f"    {x}: '{('${custom_reward_function.reward_kwargs.' + y + '}') * 10}'\n" for x, y in
        zip("abcdefghi", "bcdefghij")) + "    j: lol\n", "references expand to over 1000000 characters"),
])
def test_yaml_bombs_are_refused_in_one_line(tmp_path, text, words):
    path = write(tmp_path, "bomb.yaml", text)
    # a subprocess, so that a regression shows as a timeout here rather than a machine out of memory
    got = subprocess.run([sys.executable, "-m", "megarl.train", "--config", path, "--print-config"],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 2 and words in got.stderr and got.stderr.strip().count("\n") == 0, got.stderr[-2000:]


@pytest.mark.parametrize("yaml_text, key, words", [
    ("hydra:\n  run:\n    dir: /tmp/out\n", "hydra", "trainer.default_local_dir"),
    ("defaults:\n  - ppo_trainer\n  - _self_\n", "defaults", "base: other.yaml"),
])
def test_verls_hydra_sections_name_what_megarl_takes_instead(tmp_path, yaml_text, key, words):
    path = write(tmp_path, "verl.yaml", yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == key and words in str(err.value) and "\n" not in str(err.value)


def test_hydras_deletion_override_says_what_megarl_does_instead():
    with pytest.raises(ConfigError, match="Hydra's deletion of a key; every megarl key has a default"):
        load_config(None, ["~trainer.logger"])
