"""<role>.model.override_config: HF config overrides, in verl's megatron spelling too
(`+actor_rollout_ref.model.override_config.model_config.<key>=...`, whose `model_config` entry stands
for the whole mapping, as verl 0.9.1's HFModelConfig reads it).

- the merge itself (nested mappings into the attribute's mapping, plain dicts out of a frozen config);
- `megarl-train --check` refuses a key the model's HF config class does not define in one line
  naming the attribute meant or, for a megatron TransformerConfig field, the section it goes in;
- a real megatron actor built from the frozen config takes the value, and its checkpoint saves.
"""
import os

import pytest

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.models.hf_config import hf_overrides, with_overrides
from tests.distributed import run_ranks

NESTED = "+actor_rollout_ref.model.override_config.model_config"


def test_overrides_merge_as_verl_applies_them():
    hf = {"model_type": "qwen2", "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert hf_overrides({"model_config": {"rope_theta": 5e5}}) == {"rope_theta": 5e5}
    assert hf_overrides({"rope_theta": 5e5}) == {"rope_theta": 5e5}
    out = with_overrides(hf, {"model_config": {"rope_theta": 5e5, "rope_scaling": {"factor": 4.0}}})
    assert out == {"model_type": "qwen2", "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert hf["rope_scaling"]["factor"] == 2.0             # the checkpoint's config is left as it was
    cfg = load_config(None, [f"{NESTED}.rope_scaling.factor=4.0"])
    merged = with_overrides(hf, cfg.model.override_config)  # the config's mappings are frozen
    assert type(merged["rope_scaling"]) is dict and "model_config" not in merged
    merged["rope_scaling"]["factor"] = 8.0                  # a plain copy: later code may change it


def _check(model_dir, *extra):
    from megarl.launcher.cli import load_checked
    return load_checked("configs/quickstart.yaml", [f"actor_rollout_ref.model.path={model_dir}", *extra])


def test_check_refuses_override_keys_the_hf_config_does_not_define(addition_model_dir):
    cfg = _check(addition_model_dir, f"{NESTED}.max_position_embeddings=64", f"{NESTED}.rms_norm_eps=1.0e-5")
    assert cfg.model.override_config["model_config"]["rms_norm_eps"] == 1e-5
    with pytest.raises(ConfigError) as err:
        _check(addition_model_dir, f"{NESTED}.rms_norm_epsilon=0.00001")
    assert str(err.value).splitlines()[0] == (
        "actor_rollout_ref.model.override_config.model_config.rms_norm_epsilon: the model's HF config (qwen2) has "
        "no attribute 'rms_norm_epsilon'; did you mean 'rms_norm_eps'? override only attributes its config "
        "class defines (a megatron TransformerConfig field goes in actor_rollout_ref.actor.megatron."
        "override_transformer_config.rms_norm_epsilon)")
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.model.override_config.layernorm_epsilon: .*no "
                                          r"attribute 'layernorm_epsilon'.*\(a megatron TransformerConfig field goes "
                                          r"in actor_rollout_ref.actor.megatron.override_transformer_config."
                                          r"layernorm_epsilon\)$"):
        _check(addition_model_dir, "+actor_rollout_ref.model.override_config.layernorm_epsilon=0.00001")
    # the layout checks read the overridden config: positions below the prompt + response are refused
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        _check(addition_model_dir, f"{NESTED}.max_position_embeddings=8")


def build_and_save(rank, world, path, ckpt_dir):
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.checkpoint import read_meta
    cfg = load_config(None, [f"actor_rollout_ref.model.path={path}", f"{NESTED}.rms_norm_eps=0.001",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.train_batch_size=2",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.device=cpu"])
    state.init_distributed()
    actor = ActorWorker(cfg.model, cfg.actor)
    eng = actor.engine
    out = {"spec": eng.spec.rms_norm_eps, "megatron": eng.models[0].config.layernorm_epsilon,
           "stray": "model_config" in eng.spec.hf_config}
    eng.save_checkpoint(ckpt_dir)
    out["saved"] = read_meta(ckpt_dir)["hf_config"]["rms_norm_eps"]
    state.destroy_model_parallel()
    return out


@pytest.mark.timeout(300)
def test_the_override_reaches_the_megatron_model_and_its_checkpoint_saves(addition_model_dir, tmp_path):
    [r] = run_ranks(1, build_and_save, (addition_model_dir, str(tmp_path / "ckpt")))
    assert r == {"spec": 1e-3, "megatron": 1e-3, "stray": False, "saved": 1e-3}
    assert os.path.isfile(tmp_path / "ckpt" / "metadata.json")
