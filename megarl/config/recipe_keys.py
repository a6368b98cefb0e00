"""verl's fully-async and one-step-off-policy recipe keys (and main_generation's): megarl's key where
the meaning is the same, accepted at verl's value where megarl already does what it asks, one line
naming megarl's way otherwise.

    raw = refuse_recipe_keys(raw)     # before the unknown-key check (megarl/experiment.py build_config)
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.errors import ConfigError
from megarl.config.refused import _get, _remove, _rename, accepts

# verl's fully-async and one-step-off-policy recipes (verl/experimental/fully_async_policy/config/
# fully_async_ppo_megatron_trainer.yaml, 0.9.1): keys whose meaning megarl's async_training does not share.
# key -> (accepted values, the rest of the one-line error)
_DYNAMIC = "verl's dynamic resource scheduling (rollout replicas on trainer GPUs) is not implemented; remove the key"
RECIPE_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "async_training.staleness_threshold": (
        (), "verl's fraction of extra samples the rollouter may queue per weight sync; megarl bounds staleness in "
            "policy versions: set async_training.max_staleness (how many versions a sample may lag the weights "
            "trained on; 1 is one-step-off-policy) instead"),
    "async_training.trigger_parameter_sync_step": (
        (1,), "megarl sends the weights to the rollout ranks after every trainer step; to let generation run "
              "further ahead raise async_training.max_staleness and remove the key"),
    "async_training.require_batches": (
        (1,), "megarl's trainer takes one data.train_batch_size batch a step (ppo_mini_batch_size splits it); "
              "remove the key"),
    "async_training.use_trainer_do_validate": (
        (False,), "megarl's rollout ranks validate between steps (trainer.test_freq); remove the key"),
    "async_training.use_dynamic_resource_scheduling": ((False,), _DYNAMIC),
    "async_training.dynamic_schedule_policy": (("default",), _DYNAMIC),
    "async_training.dynamic_schedule_deactivate_ratio": ((0.3,), _DYNAMIC),
    "async_training.dynamic_schedule_enable_rebalance": ((True,), _DYNAMIC),
    "async_training.concurrent_samples_per_replica": (
        (16,), "megarl's engines take a whole batch per call, not a number of concurrent requests; remove the key"),
    "rollout.total_rollout_steps": ((), "set trainer.total_training_steps (trainer steps) instead"),
    # verl's trainer pass over the current weights for rollout IS (AReaL's decoupled PPO when both are on)
    "async_training.compute_prox_log_prob": (
        (False,), "megarl's trainer recomputes the old log-probs unless algorithm.rollout_correction.bypass_mode "
                  "is on; for the proximal policy with a behaviour weight set actor_rollout_ref.actor.policy_loss."
                  "loss_mode=decoupled_ppo (docs/async.md) and remove the key"),
    "async_training.checkpoint_engine.enable": (
        (True,), "megarl's weight sync always moves buckets of actor_rollout_ref.rollout.checkpoint_engine."
                 "bucket_size_mb; choose its transport with checkpoint_engine.backend and remove the key"),
    # verl 0.9.1's fully-async trainer reads actor_rollout_ref.rollout.n; its rollout.n (4) is read by nothing
    "rollout.n": ((4,), "verl's fully-async trainer samples actor_rollout_ref.rollout.n responses a prompt, as "
                        "megarl does; set that and remove rollout.n"),
    # verl's main_generation (a dataset in, n samples a prompt out): megarl's evaluation-only run does it
    **{f"data.{leaf}": (
        (), "megarl has no generation-only entry point: run trainer.val_only=true with data.val_files=<file>, "
            "actor_rollout_ref.rollout.val_kwargs.n (and do_sample, temperature) and trainer.validation_data_dir="
            "<dir> (a line per sample in <dir>/<step>.jsonl; docs/verl.md), and remove the key")
       for leaf in ("path", "n_samples", "output_path")},
    # HF's from_pretrained argument, which verl users write under model: (verl's trees have no such key)
    **{f"{role}.model.torch_dtype": (
        (), "megarl's roles compute in actor_rollout_ref.actor.dtype (auto: bf16 on GPU, fp32 on CPU; the critic "
            "and reference follow it) and its engine in actor_rollout_ref.rollout.dtype; set those instead")
       for role in ("actor_rollout_ref", "critic")},
}
# The fully-async recipe's keys megarl has under its own name (verl's docs/advance/fully_async.md): the rollout's
# log-probs as the old ones, the sync's bucket and its overlap, and validation/epochs counted in weight versions,
# which are megarl's trainer steps. A key set both ways must agree.
RECIPE_RENAMED: dict[str, str] = {
    "async_training.use_rollout_log_probs": "algorithm.rollout_correction.bypass_mode",
    "async_training.checkpoint_engine.device_buffer_size_M":
        "actor_rollout_ref.rollout.checkpoint_engine.bucket_size_mb",
    "async_training.checkpoint_engine.overlap_broadcast_and_consume":
        "actor_rollout_ref.rollout.checkpoint_engine.overlap",
    "rollout.test_freq": "trainer.test_freq",
    "rollout.total_epochs": "trainer.total_epochs",
}
# The recipe's copies of its own keys (`${oc.select:<key>, default}` in fully_async_ppo_trainer.yaml): copy -> key
RECIPE_COPIES = {"actor_rollout_ref.checkpoint_engine": "async_training.checkpoint_engine",
                 "actor_rollout_ref.actor.use_rollout_log_probs": "async_training.use_rollout_log_probs"}
# verl's rollout pool beside the trainer's: megarl's disaggregated placement, with the trainer's ranks counting both
POOL = ("rollout.nnodes", "rollout.n_gpus_per_node")


def refuse_recipe_keys(raw: dict) -> dict:
    """One line for the first verl async-recipe key whose meaning megarl's keys do not share; the rest of `raw`."""
    _take_copies(raw)
    _rename(raw, RECIPE_RENAMED)
    for key, (accepted, why) in RECIPE_KEYS.items():
        present, value = _get(raw, key)
        if present and not accepts(accepted, value):
            raise ConfigError(f"{value!r} is not supported: {why}", key)
        if present:
            _remove(raw, key)
    pool = [_get(raw, k) for k in POOL]
    if any(present for present, _ in pool):
        nodes, gpus = (v if present and isinstance(v, int) else 1 for present, v in pool)
        _, t_nodes = _get(raw, "trainer.nnodes")
        _, t_gpus = _get(raw, "trainer.n_gpus_per_node")
        trainer = (t_nodes if isinstance(t_nodes, int) else 1) * (t_gpus if isinstance(t_gpus, int) else 1)
        n = nodes * gpus
        raise ConfigError(f"verl's rollout pool of {n} GPUs ({' x '.join(POOL)}) beside the trainer's is megarl's "
                          f"actor_rollout_ref.rollout.placement=disaggregated actor_rollout_ref.rollout."
                          f"disaggregated_ranks={n}, with trainer.nnodes x trainer.n_gpus_per_node counting both sides "
                          f"({trainer} + {n}); set those and remove rollout.*",
                          next(k for k, (present, _) in zip(POOL, pool) if present))
    return raw


def _take_copies(raw: dict) -> None:
    """Each RECIPE_COPIES key, its interpolation resolved, read as the key it copies (a null copies nothing)."""
    for copy, key in RECIPE_COPIES.items():
        present, value = _get(raw, copy)
        if not present:
            continue
        if isinstance(value, str) and "${" in value:
            value = _resolved(raw, copy)
        _remove(raw, copy)
        if value is None:
            continue
        has, own = _get(raw, key)
        if has and own != value:
            raise ConfigError(f"{value!r} disagrees with {key}={own!r}; verl's recipe copies {key} here, set one "
                              "of them", copy)
        node = raw
        for part in key.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[key.rsplit(".", 1)[1]] = value


def _resolved(raw: dict, key: str) -> Any:
    """`key`'s interpolation resolved against `raw` (OmegaConf's own oc.select), as plain values."""
    try:
        node = OmegaConf.select(OmegaConf.create(raw), key)
        return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot be resolved ({err}); set a value or remove it", key) from None
