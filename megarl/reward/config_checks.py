"""Checks on the reward sections that need the rest of the experiment (run once when the config is
built: megarl/experiment.py RULES)."""
from __future__ import annotations

import json
import os

from megarl.config import ConfigError

# reward_model.model: verl's keys that build the reward model as the actor's build the actor
# (megarl/workers/reward_model.py; external_lib is imported with the actor's, megarl/launcher/preflight.py).
RM_MODEL_KEYS = ("path", "tokenizer_path", "override_config", "use_remove_padding", "external_lib")
# verl's other reward_model.model keys, at the values that ask for what megarl does, and why no other can
RM_MODEL_VERL = {
    "trust_remote_code": ((None, False), "megarl reads the reward model's weights itself and runs no code from it"),
    "use_shm": ((None, False), "a shared-memory copy of the weights for verl's FSDP loader; megarl has no such loader"),
    "use_fused_kernels": ((None, False), "verl's fused FSDP kernels; megarl's reward model runs on megatron-core"),
}
# verl's FSDP engine settings of the reward model at their defaults (v0.7.0's ppo_trainer.yaml)
FSDP_DEFAULTS = {"_target_": "verl.workers.config.FSDPEngineConfig", "wrap_policy": {"min_num_params": 0},
                 "param_offload": False, "reshard_after_forward": True, "fsdp_size": -1, "forward_prefetch": False}


def _shown(value) -> str:
    return json.dumps(value) if value is None or isinstance(value, bool) else repr(value)


def _same_path(a: str, b: str | None) -> bool:
    return b is not None and os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def check_reward_model_keys(cfg) -> None:
    """Every key under reward_model.model acts or asks for what megarl does; any other value is one line."""
    acting = ", ".join(RM_MODEL_KEYS)
    for key, value in (cfg.reward_model.model or {}).items():
        where = f"reward_model.model.{key}"
        if key in RM_MODEL_KEYS:
            continue
        if key == "input_tokenizer":
            if value is None or _same_path(str(value), cfg.model.path):
                continue
            raise ConfigError(f"={_shown(value)}: megarl's reward model reads the actor's token ids (its vocabulary "
                              "must be the actor's), so verl's input_tokenizer can only be the actor's model path "
                              "(verl's default) or null; remove the key", where)
        if key in RM_MODEL_VERL:
            accepted, why = RM_MODEL_VERL[key]
            if any(value is a for a in accepted):
                continue
            raise ConfigError(f"={_shown(value)}: {why}; remove the key", where)
        if key == "fsdp_config":
            if value is None or isinstance(value, dict) and all(k in FSDP_DEFAULTS and FSDP_DEFAULTS[k] == v
                                                                for k, v in value.items()):
                continue
            raise ConfigError("an FSDP engine setting; megarl's reward model runs on megatron-core with the "
                              "actor's layout; remove the key", where)
        raise ConfigError(f"unknown key; megarl builds the reward model from {acting} (verl's input_tokenizer, "
                          "trust_remote_code, use_shm, use_fused_kernels and fsdp_config are accepted at verl's "
                          "defaults)", where)
