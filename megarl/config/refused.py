"""verl keys megarl accepts only at their default, and keys that are other keys' aliases.

A verl command line carries over unchanged where megarl implements a key. Where it does not, the
key is still recognised (so a typo check does not call it unknown), but any value other than the
accepted ones stops the run with one line saying so and naming what to use in megarl instead.
Nothing is accepted and then ignored: tests/test_config_keys.py walks every leaf of the typed
config and requires it to be read by the code outside the config modules, refused here, or an
alias here whose target changes when it is set.

    REFUSED["data.dataloader_num_workers"] = ((0,), "why and what to use instead")

A key in ALREADY is accepted at every value: megarl always does what its strongest value asks.
A verl section in MOVED (verl's DAPO recipe spelling) is read as megarl's section of that name.
"""
from __future__ import annotations

from typing import Any


from megarl.config.errors import ConfigError

ROLES = ("actor_rollout_ref.actor", "critic")

# dotted key -> (accepted values, the rest of the one-line error)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "data.dataloader_num_workers": (      # 8: verl's default
        (0, 8), "megarl tokenizes the whole dataset once at start, so batches need no loader workers; remove the key"),
    "data.gen_batch_size": (
        (None,), "megarl's dynamic sampling (algorithm.filter_groups.enable) generates data.train_batch_size prompts "
                 "a round and draws more rounds, up to algorithm.filter_groups.max_num_gen_batches, until "
                 "train_batch_size prompts' groups vary; remove data.gen_batch_size"),
    "actor_rollout_ref.hybrid_engine": (
        (True,), "megarl's engine shares the training ranks unless actor_rollout_ref.rollout.placement="
                 "disaggregated gives it ranks of its own; set that instead"),
    **{f"{role}.strategy": (
        ("megatron",), "megarl trains with megatron-core only (TP x PP x DP, see the layout table in docs/launch.md); "
                       "remove the key or set megatron") for role in ROLES},
    "actor_rollout_ref.actor.ppo_micro_batch_size": (
        (None,), "verl's deprecated global micro batch is not used; set "
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": (
        (None,), "verl's deprecated global micro batch is not used; set "
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
    "actor_rollout_ref.actor.use_torch_compile": (
        (False,), "megarl's actor runs megatron-core's own kernels, not torch.compile; remove the key"),
    "actor_rollout_ref.actor.checkpoint": (
        ({},), "megarl saves and loads model, optimizer and trainer state together every trainer.save_freq steps; "
               "remove actor_rollout_ref.actor.checkpoint"),
    "actor_rollout_ref.rollout.over_sample_rate": (
        (0, 0.0), "megarl does not over-sample and cancel rollouts; to refill batches with informative groups use "
                  "algorithm.filter_groups.enable=true (DAPO dynamic sampling)"),
    "actor_rollout_ref.rollout.data_parallel_size": (
        (1,), "rollout data parallelism is the rollout ranks / actor_rollout_ref.rollout.tensor_model_parallel_size; "
              "remove the key"),
    "actor_rollout_ref.rollout.expert_parallel_size": (
        (1,), "the native engine splits every expert over the rollout TP ranks instead of placing experts "
              "on ranks of their own; remove the key and set actor_rollout_ref.rollout.tensor_model_parallel_size"),
    **{f"actor_rollout_ref.rollout.server.{leaf}": (
        (default,), "megarl's engines run inside the training processes, not behind an HTTP server; "
                    "remove actor_rollout_ref.rollout.server")
       for leaf, default in (("timeout", 60.0), ("max_attempts", 3), ("max_connections", 1000))},
    "algorithm.rollout_correction.loss_type": (
        ("ppo_clip",), "megarl's bypass mode keeps the PPO clip loss against pi_rollout (verl's ppo_clip); verl's "
                       "reinforce bypass loss is not implemented; remove the key"),
    "actor_rollout_ref.rollout.quantization": (
        (None,), "quantized rollout is not supported: every engine runs the trainer's own (bf16/fp32) weights, "
                 "synced each step; remove the key"),
    # CriticModelConfig inherits the actor's model keys; a bootstrap builds actor_rollout_ref.model.path only
    **{f"critic.model.{leaf}": (
        (default,), "a bootstrap builds actor_rollout_ref.model.path only; the critic starts from the actor's "
                    "checkpoint (critic.model.init_from=actor) or from critic.model.path: set "
                    f"actor_rollout_ref.model.{leaf} instead")
       for leaf, default in (("bootstrap", None), ("bootstrap_kwargs", {}))},
    **{f"actor_rollout_ref.ref.megatron.{leaf}": (
        (False,), "the reference is frozen: it has no gradients or optimizer state to offload; "
                  "actor_rollout_ref.ref.megatron.param_offload offloads its weights") for leaf in
       ("grad_offload", "optimizer_offload")},
    "trainer.max_critic_ckpt_to_keep": (
        (None,), "one step directory holds every role's checkpoint, so trainer.max_actor_ckpt_to_keep prunes them "
                 "all; set that instead"),
}

# verl keys whose every value megarl honours already: what megarl always does is what they ask for
# (their false asks for less, which megarl's batches carry unused). key -> what megarl does.
ALREADY: dict[str, str] = {
    "actor_rollout_ref.rollout.mode": "verl's PPO trainer, sync or async (its default: agent-loop servers), waits for "
                                      "every generation of a step before training on it; so does megarl (for "
                                      "overlap, actor_rollout_ref.rollout.placement=disaggregated)",
    "data.return_raw_chat": "megarl always keeps each row's chat messages (raw_prompt) with the batch: the "
                            "multi-turn loop, tools and custom rollouts read them",
}

# Keys whose value the config module moves into another key (verl spellings): alias -> target.
ALIASES: dict[str, str] = {
    "actor_rollout_ref.actor.grad_clip": "actor_rollout_ref.actor.optim.clip_grad",
    "critic.grad_clip": "critic.optim.clip_grad",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        "actor_rollout_ref.rollout.checkpoint_engine.bucket_size_mb",
    "actor_rollout_ref.rollout.max_response_length": "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu":
        "actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.tools": "actor_rollout_ref.rollout.multi_turn.tool_config_path",
}


# verl sections megarl reads under its own name: verl section -> megarl section
MOVED: dict[str, str] = {
    "reward_model.overlong_buffer": "algorithm.overlong_buffer",      # verl's DAPO recipe (dapo_trainer.yaml)
    # what verl's DAPO reward manager reads: 0.9.1 under reward.reward_kwargs
    # (verl/experimental/reward_loop/reward_manager/dapo.py), older releases under reward_model.reward_kwargs
    # (0.9.1 still moves that to reward.reward_kwargs: verl/experimental/reward_loop/reward_loop.py)
    "reward_model.reward_kwargs.overlong_buffer_cfg": "algorithm.overlong_buffer",
    "reward.reward_kwargs.overlong_buffer_cfg": "algorithm.overlong_buffer",
    # verl 0.9.1 moved the custom scorer under reward.; verl 0.7's spelling is megarl's
    "reward.custom_reward_function": "custom_reward_function",
}


# Single keys verl 0.9.1 moved, which megarl reads under verl 0.7's name: 0.9.1 key -> megarl key. A null
# there (0.9.1's default model_path) is "not set"; a key set both ways must agree.
RENAMED: dict[str, str] = {
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.num_workers": "reward_model.num_workers",
    "actor_rollout_ref.actor.megatron.router_replay.mode": "actor_rollout_ref.actor.router_replay.mode",
    "actor_rollout_ref.ref.megatron.router_replay.mode": "actor_rollout_ref.ref.router_replay.mode",
}


def rename_keys(raw: dict) -> dict:
    """`raw` with each RENAMED verl 0.9.1 key under megarl's name."""
    return _rename(raw, RENAMED)


def _rename(raw: dict, table: dict[str, str]) -> dict:
    for src, dst in table.items():
        present, value = _get(raw, src)
        if not present:
            continue
        _remove(raw, src)
        if value is None:
            continue
        node = raw
        for part in dst.split(".")[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"is {node!r}, not a section; {src} is read as {dst}", dst.rsplit(".", 1)[0])
        leaf = dst.rsplit(".", 1)[1]
        if node.get(leaf) is not None and node[leaf] != value:
            raise ConfigError(f"{value!r} disagrees with {dst}={node[leaf]!r}; {src} is read as {dst}, "
                              "set one of them", src)
        node[leaf] = value
    return raw


# verl 0.9.1 keeps verl 0.7's reward keys (megarl's spelling) with null defaults meaning "not set here, read
# reward.*" (verl/trainer/config/legacy_reward_impl.yaml); megarl reads such a null as the key left out, so
# its own default applies, which is verl's reward.* default but for num_workers (megarl's pool of 2).
LEGACY_NULL = ("custom_reward_function.name", "reward_model.enable", "reward_model.reward_manager",
               "reward_model.num_workers")
NULL_IS_UNSET = {"custom_reward_function"}


def drop_legacy_nulls(raw: dict) -> dict:
    """`raw` without the LEGACY_NULL keys that are null."""
    for key in LEGACY_NULL:
        present, value = _get(raw, key)
        if present and value is None:
            del _parent(raw, key)[key.rsplit(".", 1)[1]]
    return raw


# The rest of verl's reward_kwargs: max_resp_len is the length DAPO's penalty counts from, megarl's response
# budget data.max_response_length (checked once the defaults are in, check_reward_kwargs); older verl passes any
# other key to the reward manager's constructor, which is megarl's reward_model.reward_manager_kwargs.
REWARD_KWARGS = ("reward_model.reward_kwargs", "reward.reward_kwargs")
MAX_RESP_LEN = "data.max_response_length"


def take_reward_kwargs(raw: dict) -> tuple[dict, list[tuple[str, Any]]]:
    """`raw` without verl's reward_kwargs sections (their overlong_buffer_cfg is MOVED already), each other
    leaf under reward_model.reward_manager_kwargs; and the (key, value) of each max_resp_len given."""
    lengths = []
    for src in REWARD_KWARGS:
        present, value = _get(raw, src)
        if not present:
            continue
        _remove(raw, src)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"got {value!r}; verl's reward_kwargs is a mapping (overlong_buffer_cfg, max_resp_len, "
                              "or the reward manager class's arguments)", src)
        if "max_resp_len" in value:
            lengths.append((f"{src}.max_resp_len", value.pop("max_resp_len")))
        if value:
            node = raw.setdefault("reward_model", {})
            kwargs = node.setdefault("reward_manager_kwargs", {}) if isinstance(node, dict) else None
            if not isinstance(kwargs, dict):
                raise ConfigError(f"is {kwargs!r}, not a mapping; {src} is read into it",
                                  "reward_model.reward_manager_kwargs")
            for leaf, v in value.items():
                if leaf in kwargs and kwargs[leaf] != v:
                    raise ConfigError(f"{v!r} disagrees with reward_model.reward_manager_kwargs.{leaf}="
                                      f"{kwargs[leaf]!r}; {src} is read as reward_model.reward_manager_kwargs, set one "
                                      "of them", f"{src}.{leaf}")
                kwargs[leaf] = v
    return raw, lengths


def check_reward_kwargs(merged: dict, lengths: list[tuple[str, Any]]) -> None:
    """verl's max_resp_len must be the response budget, the length megarl's overlong penalty counts from."""
    _, budget = _get(merged, MAX_RESP_LEN)
    for key, value in lengths:
        if value is not None and (isinstance(value, bool) or value != budget):
            raise ConfigError(f"{value!r} is not {MAX_RESP_LEN}={budget!r}: megarl's overlong penalty "
                              f"(algorithm.overlong_buffer) counts from the response budget {MAX_RESP_LEN}; set "
                              f"{key} to it or remove the key", key)


def moved_from(key: str) -> str | None:
    """megarl's key for a leaf under a MOVED verl section, else None."""
    for src, dst in MOVED.items():
        if key.startswith(src + "."):
            return dst + key[len(src):]
    return None


def move_sections(raw: dict) -> dict:
    """`raw` with each MOVED verl section under megarl's name; a leaf set both ways must agree."""
    for src, dst in MOVED.items():
        present, value = _get(raw, src)
        if not present:
            continue
        parent = _parent(raw, src)
        del parent[src.rsplit(".", 1)[1]]
        _prune(raw, src.rsplit(".", 1)[0])      # `reward:` left empty is no section of megarl's
        if not isinstance(value, dict):
            raise ConfigError(f"got {value!r}; this verl section is a mapping, read as {dst}", src)
        node = raw
        for part in dst.split("."):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{dst} is {node!r}, not a section; remove it or {src}", dst)
        # under verl 0.9.1's reward keys a null means "not set here" (LEGACY_NULL), so it yields to a value
        unset = (None,) if dst in NULL_IS_UNSET else ()
        for leaf, v in value.items():
            if leaf in node and v in unset:
                continue
            if leaf in node and node[leaf] not in unset and node[leaf] != v:
                raise ConfigError(f"{v!r} disagrees with {dst}.{leaf}={node[leaf]!r}; {src} is read as {dst}, "
                                  "set one of them", f"{src}.{leaf}")
            node[leaf] = v
    return raw


def accepts(accepted: tuple[Any, ...], value: Any) -> bool:
    """`value` is one of `accepted`; `== ok` alone would let 1 pass for True (and 0 for False), so a
    bool must match a bool."""
    return any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in accepted)


def _remove(raw: dict, dotted: str) -> None:
    """Delete the present leaf `dotted` and each ancestor section it leaves empty."""
    del _parent(raw, dotted)[dotted.rsplit(".", 1)[1]]
    _prune(raw, dotted.rsplit(".", 1)[0])


def _prune(raw: dict, dotted: str) -> None:
    """Remove the section at `dotted` and each ancestor of it, while each is left empty."""
    parts = dotted.split(".")
    for depth in range(len(parts), 0, -1):
        path = ".".join(parts[:depth])
        present, node = _get(raw, path)
        if not present or node != {}:
            return
        del _parent(raw, path)[parts[depth - 1]]


def _parent(node: dict, dotted: str) -> dict:
    for part in dotted.split(".")[:-1]:
        node = node[part]
    return node


def _get(node: Any, dotted: str) -> tuple[bool, Any]:
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


# Critic model keys that only the actor's model acts on: accepted unset or at the actor's own value (verl
# 0.7's defaults interpolate the actor's), refused otherwise. key -> (actor keys it may equal, why)
FOLLOWS_ACTOR: dict[str, tuple[tuple[str, ...], str]] = {
    "critic.model.tokenizer_path": (
        ("actor_rollout_ref.model.tokenizer_path", "actor_rollout_ref.model.path"),
        "the critic scores the actor's token ids, so it reads no tokenizer of its own; remove the key"),
    "critic.model.trust_remote_code": (
        ("actor_rollout_ref.model.trust_remote_code",),
        "megarl reads the critic's config.json and weights itself and runs no code from its checkpoint "
        "(actor_rollout_ref.model.trust_remote_code governs the tokenizer); remove the key"),
}


def check_refused(merged: dict) -> None:
    """Stop at the first refused value in the merged config (defaults included), as one line."""
    for key, (actor_keys, why) in FOLLOWS_ACTOR.items():
        present, value = _get(merged, key)
        if present and value not in (None, False) and all(_get(merged, k)[1] != value for k in actor_keys):
            raise ConfigError(f"{value!r} is not the actor's ({', '.join(actor_keys)}): {why}", key)
    for key, (accepted, why) in REFUSED.items():
        present, value = _get(merged, key)
        if present and not accepts(accepted, value):
            raise ConfigError(f"{value!r} is not supported: {why}", key)
