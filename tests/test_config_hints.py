"""A "did you mean" names a key that acts: never one megarl refuses away from its default or drops at
verl's default (following such a hint would pass --check and change nothing, or stop at the next run).
Every refused and verl-only key is mistyped here, and the hint given for it checked."""
import pytest

from megarl.config import ConfigError
from megarl.config.refused import REFUSED
from megarl.config.verl_keys import hint_keys, verl_defaults
from megarl.experiment import ExperimentConfig, check_known_keys, load_config
from megarl.config.typed import all_keys

INERT = set(REFUSED) | set(verl_defaults())


def _nested(path: str) -> dict:
    out: dict = {}
    node = out
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = 1
    return out


def _typos(key: str) -> list[str]:
    """The key with one letter of its last name dropped, and with a letter doubled."""
    parent, _, leaf = key.rpartition(".")
    mid = len(leaf) // 2
    return [f"{parent}.{leaf[:mid] + leaf[mid + 1:]}" if parent else leaf[:mid] + leaf[mid + 1:],
            f"{parent}.{leaf[:mid] + leaf[mid] + leaf[mid:]}" if parent else leaf[:mid] + leaf[mid] + leaf[mid:]]


def _hint(path: str) -> str | None:
    try:
        check_known_keys(_nested(path))
    except ConfigError as err:
        text = str(err)
        return text.split("did you mean '", 1)[1].split("'", 1)[0] if "did you mean '" in text else None
    return None


def test_no_hint_names_a_refused_or_dropped_key():
    hints = {}
    for key in sorted(INERT):
        for typo in _typos(key):
            hint = _hint(typo)
            if hint is not None:
                hints[typo] = hint
    bad = {typo: hint for typo, hint in hints.items() if hint in INERT}
    assert hints and not bad, f"hints naming keys that do nothing: {bad}"
    assert set(hints.values()) <= hint_keys(all_keys(ExperimentConfig))


def test_hint_still_names_megarls_key():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.save_frq=3"])
    assert "did you mean 'trainer.save_freq'" in str(err.value)


def test_reward_kwargs_is_not_pointed_at_reward_manager_kwargs():
    """verl's +reward_model.reward_kwargs.* acts (tests/test_config_reward_kwargs.py); its near miss
    reward_manager_kwargs does nothing under the default manager and is never the hint for it."""
    load_config(None, ["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True", "data.max_response_length=64"])


def test_a_lora_reference_offload_hint_leads_somewhere_valid():
    """verl's ref.fsdp_config.param_offload under LoRA: the hint is the actor's offload (the reference is the
    actor's frozen base), which that config accepts; the reference's own megatron section is refused there."""
    lora = ["actor_rollout_ref.model.lora_rank=8"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*lora, "actor_rollout_ref.ref.fsdp_config.param_offload=True"])
    assert "set actor_rollout_ref.actor.megatron.param_offload instead" in str(err.value)
    load_config(None, [*lora, "actor_rollout_ref.actor.megatron.param_offload=True"])
    with pytest.raises(ConfigError):
        load_config(None, [*lora, "actor_rollout_ref.ref.megatron.param_offload=True"])
    for leaf in ("param_offload", "optimizer_offload"):   # without LoRA the reference's own weights offload
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"actor_rollout_ref.ref.fsdp_config.{leaf}=True"])
        assert "actor_rollout_ref.ref.megatron.param_offload" in str(err.value)
    load_config(None, ["actor_rollout_ref.ref.megatron.param_offload=True"])
    with pytest.raises(ConfigError):             # frozen: nothing else of it to offload
        load_config(None, ["actor_rollout_ref.ref.megatron.optimizer_offload=True"])
