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
    (["actor_rollout_ref.rollout.n_gpus_per_node=2"], "actor_rollout_ref.rollout.n_gpus_per_node",
     "actor_rollout_ref.rollout.disaggregated_ranks"),
    (["actor_rollout_ref.model.torch_dtype=bfloat16"], "actor_rollout_ref.model.torch_dtype",
     "actor_rollout_ref.actor.dtype"),
    (["critic.model.torch_dtype=bfloat16"], "critic.model.torch_dtype", "actor_rollout_ref.rollout.dtype"),
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
