"""The algorithm and model-converter names a config gives are checked against their registries
(megarl/config/registry.py's one shape) when the config loads (so by `megarl-train --check`), without
importing torch for megarl's own names; a user's registration, imported before the config or named by
model.external_lib, is accepted."""
import subprocess
import sys
import textwrap

import pytest

from megarl.algos.registry import ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
from megarl.config import ConfigError
from megarl.config.registry import Registry
from megarl.experiment import load_config

REGISTRIES = (ADV_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS)


@pytest.mark.parametrize("override, line", [
    ("actor_rollout_ref.actor.policy_loss.loss_mode=cipso",
     "actor_rollout_ref.actor.policy_loss.loss_mode: unknown policy loss 'cipso'; did you mean 'cispo'? choose one "),
    ("algorithm.adv_estimator=grpoo", "algorithm.adv_estimator: unknown advantage estimator 'grpoo'; did you mean "
                                      "'grpo'? choose one of "),
    ("actor_rollout_ref.actor.kl_loss_type=lowvar_kl",
     "actor_rollout_ref.actor.kl_loss_type: unknown KL estimator 'lowvar_kl'; did you mean 'low_var_kl'? "),
    ("algorithm.kl_penalty=k9+", "algorithm.kl_penalty: unknown KL estimator 'k9'"),
    ("actor_rollout_ref.model.converters=[lorra]",
     "actor_rollout_ref.model.converters: unknown model converter 'lorra'; did you mean 'lora'? choose one of lora"),
    ("critic.model.converters={fp9_quant: {}}", "critic.model.converters: unknown model converter 'fp9_quant'; "),
])
def test_a_misspelled_name_is_one_line_at_load(override, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_every_name_loads_without_torch():
    """megarl's own names are known from their declarations: checking them imports no torch, and
    a typo is refused the same way."""
    code = textwrap.dedent("""
        import sys
        from megarl.algos.registry import ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
        from megarl.experiment import load_config
        for loss in POLICY_LOSSES.names():
            extra = ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"] if loss == "dro" else []
            load_config(None, [f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}", *extra])
        for est in ADV_ESTIMATORS.names():
            load_config(None, [f"algorithm.adv_estimator={est}", "actor_rollout_ref.rollout.n=2",
                               "critic.enable=true"])
        for kl in KL_ESTIMATORS.names():
            load_config(None, [f"algorithm.kl_penalty={kl}+", f"actor_rollout_ref.actor.kl_loss_type={kl}"])
        load_config(None, ["actor_rollout_ref.model.converters={lora: {rank: 4}}"])
        try:
            load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=gpso"])
        except Exception as err:
            print(type(err).__name__)
        print('torch' in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["ConfigError", "False"], out.stderr[-2000:]


def test_builtin_declarations_are_the_registered_functions():
    """Each declared "module:function" is what that module's decorator registers under the name."""
    for registry in REGISTRIES:
        for name in registry.names():
            fn = registry.get(name)
            assert registry.builtin(name) == f"{fn.__module__}:{fn.__name__}", (registry.kind, name)
    with pytest.raises(ValueError, match="'vanilla' is megarl's built-in megarl.algos.losses:ppo_dual_clip_loss"):
        POLICY_LOSSES.register("vanilla")(lambda *a, **k: None)
    # a user's module that takes a built-in name before megarl's module loads is refused as well
    fresh = Registry("policy loss", "loss_mode", {"cispo": "megarl.algos.pg_variants:cispo_loss"})
    with pytest.raises(ValueError, match="'cispo' is megarl's built-in megarl.algos.pg_variants:cispo_loss"):
        fresh.register("cispo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="cannot be unregistered"):
        POLICY_LOSSES.unregister("vanilla")


USER_MODULE = '''
from megarl.algos.advantages import get_adv_estimator, register_adv_estimator
from megarl.algos.kl import register_kl
from megarl.algos.losses import get_policy_loss, register_policy_loss


@register_adv_estimator("{p}_grpo")
def my_grpo(token_level_rewards, response_mask, uid=None, **kw):
    return get_adv_estimator("grpo")(token_level_rewards, response_mask, uid=uid, **kw)


@register_policy_loss("{p}_loss")
def my_loss(*args, **kw):
    return get_policy_loss("vanilla")(*args, **kw)


@register_kl("{p}_kl")
def my_kl(log_prob, ref_log_prob):
    return (log_prob - ref_log_prob) ** 4
'''


@pytest.mark.parametrize("how", ["external_lib", "imported_first"])
def test_a_users_registrations_are_accepted(how, tmp_path, monkeypatch):
    p = f"user_{how}"
    (tmp_path / f"{p}_algos.py").write_text(USER_MODULE.format(p=p))
    monkeypatch.syspath_prepend(str(tmp_path))
    names = [(ADV_ESTIMATORS, f"{p}_grpo"), (POLICY_LOSSES, f"{p}_loss"), (KL_ESTIMATORS, f"{p}_kl")]
    overrides = [f"algorithm.adv_estimator={p}_grpo", "actor_rollout_ref.rollout.n=2",
                 f"actor_rollout_ref.actor.policy_loss.loss_mode={p}_loss", f"algorithm.kl_penalty={p}_kl",
                 f"actor_rollout_ref.actor.kl_loss_type={p}_kl+"]
    try:
        with pytest.raises(ConfigError, match=f"unknown advantage estimator '{p}_grpo'"):
            load_config(None, overrides)                  # nobody registered it yet
        if how == "external_lib":
            overrides.append(f"actor_rollout_ref.model.external_lib={p}_algos")
        else:
            __import__(f"{p}_algos")
        cfg = load_config(None, overrides)
        assert cfg.algorithm.adv_estimator == f"{p}_grpo"
        assert all(name in registry for registry, name in names)
        assert POLICY_LOSSES.get(f"{p}_loss").__module__ == f"{p}_algos"
    finally:
        for registry, name in names:
            registry.unregister(name)
        sys.modules.pop(f"{p}_algos", None)


def test_an_external_lib_that_fails_to_import_is_one_line():
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.external_lib: cannot import 'no_such_mod_xyz'"):
        load_config(None, ["algorithm.adv_estimator=mine", "actor_rollout_ref.model.external_lib=no_such_mod_xyz"])
