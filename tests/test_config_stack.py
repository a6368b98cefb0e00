"""override_transformer_config keys the installed stack cannot honour are one line at config build (so
`--check` fails too), and pass where the package that honours them is installed: both branches, with the
detection (megarl/config/stack.py `available`) replaced."""
import pytest

from megarl.config import ConfigError, stack
from megarl.experiment import load_config

ACTOR = "actor_rollout_ref.actor.megatron.override_transformer_config"
CASES = [  # (key=value, the module that honours it)
    ("apply_rope_fusion=True", "transformer_engine"),          # verl's Qwen3-MoE script
    ("moe_permute_fusion=True", "transformer_engine"),
    ("gradient_accumulation_fusion=True", "fused_weight_gradient_mlp_cuda"),
    ("moe_grouped_gemm=True", "grouped_gemm"),
    ("moe_token_dispatcher_type=flex", "deep_ep"),
    ("moe_enable_deepep=True", "deep_ep"),
]


@pytest.mark.parametrize("override, module", CASES, ids=[c[0] for c in CASES])
def test_a_fused_kernel_without_its_package_is_one_line(override, module, monkeypatch):
    monkeypatch.setattr(stack, "available", lambda m: m != module)
    key, value = override.split("=")
    with pytest.raises(ConfigError) as err:
        load_config("configs/quickstart.yaml", [f"{ACTOR}.{override}"])
    text = str(err.value)
    assert err.value.key == f"{ACTOR}.{key}" and "not installed here" in text and "\n" not in text
    assert text.endswith(f"install it or set {ACTOR}.{key}={stack.NEEDS[key][2]}")


@pytest.mark.parametrize("override, module", CASES, ids=[c[0] for c in CASES])
def test_a_fused_kernel_with_its_package_passes(override, module, monkeypatch):
    monkeypatch.setattr(stack, "available", lambda m: m == module)
    cfg = load_config("configs/quickstart.yaml", [f"{ACTOR}.{override}"])
    assert override.split("=")[0] in cfg.actor_rollout_ref.actor.megatron.override_transformer_config


def test_the_off_values_need_nothing(monkeypatch):
    monkeypatch.setattr(stack, "available", lambda m: False)
    load_config("configs/quickstart.yaml", [f"{ACTOR}.apply_rope_fusion=False",
                                            f"{ACTOR}.moe_token_dispatcher_type=alltoall", "critic.megatron."
                                            "override_transformer_config.moe_grouped_gemm=False"])


@pytest.mark.parametrize("override", ["fp8=e4m3", "fp8_param=True", "fp4=nvfp4"])
def test_fp8_on_the_local_layer_spec_is_refused_with_every_package(override, monkeypatch):
    """megarl's local layers ignore fp8: installing Transformer Engine would not make it act."""
    monkeypatch.setattr(stack, "available", lambda m: True)
    with pytest.raises(ConfigError) as err:
        load_config("configs/quickstart.yaml", [f"{ACTOR}.{override}"])
    assert "local layer spec" in str(err.value) and err.value.key == f"{ACTOR}.{override.split('=')[0]}"


def test_the_reference_and_critic_are_checked(monkeypatch):
    monkeypatch.setattr(stack, "available", lambda m: False)
    for role in ("actor_rollout_ref.ref", "critic"):
        with pytest.raises(ConfigError) as err:
            load_config(None, ["critic.enable=true",
                               f"{role}.megatron.override_transformer_config.apply_rope_fusion=1"])
        assert err.value.key == f"{role}.megatron.override_transformer_config.apply_rope_fusion"


def test_detection_reads_this_environment():
    assert stack.available("torch") and not stack.available("megarl_no_such_package")
