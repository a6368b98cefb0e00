"""verl's fully-async and one-step-off-policy recipe keys (verl 0.9.1's
verl/experimental/fully_async_policy/config/fully_async_ppo_megatron_trainer.yaml), and HF's torch_dtype under
model: each is megarl's key where the meaning is the same, else one line naming megarl's key."""
import pytest

from megarl.config import ConfigError
from megarl.experiment import load_config

REFUSED = [  # (overrides, key named, words of the line)
    (["async_training.staleness_threshold=0.1"], "async_training.staleness_threshold", "async_training.max_staleness"),
    (["async_training.trigger_parameter_sync_step=4"], "async_training.trigger_parameter_sync_step",
     "raise async_training.max_staleness"),
    (["async_training.require_batches=2"], "async_training.require_batches", "data.train_batch_size"),
    (["async_training.use_dynamic_resource_scheduling=true"], "async_training.use_dynamic_resource_scheduling",
     "dynamic resource scheduling"),
    (["rollout.total_rollout_steps=100"], "rollout.total_rollout_steps", "trainer.total_training_steps"),
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=4", "trainer.n_gpus_per_node=4"], "rollout.nnodes",
     "actor_rollout_ref.rollout.placement=disaggregated actor_rollout_ref.rollout.disaggregated_ranks=4, with "
     "trainer.nnodes x trainer.n_gpus_per_node counting both sides (4 + 4)"),
    (["rollout.n_gpus_per_node=2"], "rollout.n_gpus_per_node", "disaggregated_ranks=2"),
    # verl's main_generation: megarl's evaluation-only run, named in the line
    (["data.n_samples=4"], "data.n_samples", "run trainer.val_only=true with data.val_files=<file>"),
    (["data.output_path=/tmp/out.parquet"], "data.output_path", "trainer.validation_data_dir=<dir>"),
    (["data.path=/tmp/test.parquet"], "data.path", "actor_rollout_ref.rollout.val_kwargs.n"),
    (["actor_rollout_ref.rollout.n_gpus_per_node=2"], "actor_rollout_ref.rollout.n_gpus_per_node",
     "actor_rollout_ref.rollout.disaggregated_ranks"),
    (["actor_rollout_ref.model.torch_dtype=bfloat16"], "actor_rollout_ref.model.torch_dtype",
     "actor_rollout_ref.actor.dtype"),
    (["critic.model.torch_dtype=bfloat16"], "critic.model.torch_dtype", "actor_rollout_ref.rollout.dtype"),
    (["async_training.compute_prox_log_prob=true"], "async_training.compute_prox_log_prob",
     "actor_rollout_ref.actor.policy_loss.loss_mode=decoupled_ppo"),
    (["async_training.checkpoint_engine.enable=false"], "async_training.checkpoint_engine.enable",
     "actor_rollout_ref.rollout.checkpoint_engine.bucket_size_mb"),
    (["rollout.n=16"], "rollout.n", "set that and remove rollout.n"),
    (["rollout.test_freq=2", "trainer.test_freq=5"], "rollout.test_freq", "read as trainer.test_freq, set one"),
    (["async_training.use_rollout_log_probs=false", "actor_rollout_ref.actor.use_rollout_log_probs=true"],
     "actor_rollout_ref.actor.use_rollout_log_probs", "set one of them"),
    (["async_training.partial_rollout=true"], "async_training.partial_rollout",
     "set actor_rollout_ref.rollout.placement=disaggregated or remove it"),
]


@pytest.mark.parametrize("overrides, key, words", REFUSED, ids=[c[1] for c in REFUSED])
def test_recipe_keys_without_megarls_meaning_are_one_line(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key and words in str(err.value) and "\n" not in str(err.value)
    assert "unknown key" not in str(err.value)


def test_recipe_values_that_ask_for_what_megarl_does_pass():
    cfg = load_config(None, ["async_training.trigger_parameter_sync_step=1", "async_training.require_batches=1",
                             "async_training.partial_rollout=true", "async_training.use_trainer_do_validate=false",
                             "async_training.concurrent_samples_per_replica=16",
                             "actor_rollout_ref.rollout.placement=disaggregated",
                             "actor_rollout_ref.rollout.disaggregated_ranks=1", "trainer.n_gpus_per_node=3"])
    assert cfg.async_training.partial_rollout is True


def test_the_translation_runs():
    """The line's own translation of verl's rollout pool loads, with the rollout on ranks of its own."""
    cfg = load_config(None, ["actor_rollout_ref.rollout.placement=disaggregated",
                             "actor_rollout_ref.rollout.disaggregated_ranks=4", "trainer.n_gpus_per_node=8"])
    assert cfg.actor_rollout_ref.rollout.disaggregated_ranks == 4


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rollout_mode_is_accepted_at_both_values_as_docs_say(mode):
    load_config(None, [f"actor_rollout_ref.rollout.mode={mode}"])
    text = open("docs/async.md").read()
    assert "`actor_rollout_ref.rollout.mode` is accepted at both values" in text and "refused everywhere" not in text


def test_fully_async_recipe_keys_are_megarls_keys():
    """verl's fully_async_ppo_trainer.yaml leaves, its `${oc.select:...}` copies included, set megarl's keys."""
    cfg = load_config(None, [
        "async_training.use_rollout_log_probs=True", "async_training.compute_prox_log_prob=False",
        "async_training.checkpoint_engine.enable=True", "async_training.checkpoint_engine.device_buffer_size_M=4096",
        "async_training.checkpoint_engine.overlap_broadcast_and_consume=False", "rollout.n=4",
        "rollout.test_freq=3", "rollout.total_epochs=7",
        "actor_rollout_ref.checkpoint_engine=${oc.select:async_training.checkpoint_engine, null}",
        "actor_rollout_ref.actor.use_rollout_log_probs=${oc.select:async_training.use_rollout_log_probs, True}"])
    ce = cfg.actor_rollout_ref.rollout.checkpoint_engine
    assert cfg.algorithm.rollout_correction.bypass_mode is True
    assert (ce.bucket_size_mb, ce.overlap) == (4096, False)
    assert (cfg.trainer.test_freq, cfg.trainer.total_epochs) == (3, 7)
    alone = load_config(None, ["actor_rollout_ref.checkpoint_engine=${oc.select:async_training.checkpoint_engine, "
                               "null}", "async_training.use_rollout_log_probs=false"])
    assert alone.actor_rollout_ref.rollout.checkpoint_engine.overlap is True
    assert alone.algorithm.rollout_correction.bypass_mode is False
