"""megarl's defaults against verl 0.9.1's generated trainer tree (installed with verl): every difference is
an example value verl's runs set, a value with verl's meaning (SAME), or megarl's own (OWN, named once at
start); and every entry still differs.

    pip install --no-deps verl==0.9.1
    python -m pytest -q tests/test_config_defaults.py
"""
import importlib.machinery
import os

import pytest
import yaml

from megarl.config.own_defaults import EXAMPLES, OWN, SAME, own_defaults_note
from megarl.config.refused import REFUSED
from megarl.config.typed import to_dict
from megarl.experiment import ExperimentConfig, load_config

SPEC = importlib.machinery.PathFinder.find_spec("verl")
if SPEC is None:
    pytest.skip("verl 0.9.1's generated tree is the oracle: pip install --no-deps verl==0.9.1", allow_module_level=True)
TREE = os.path.join(os.path.dirname(SPEC.origin), "trainer", "config", "_generated_ppo_megatron_trainer.yaml")


def _leaves(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out.update(_leaves(value, path) if isinstance(value, dict) and value else {path: value})
    return out


def _differences() -> dict:
    verl = _leaves(yaml.safe_load(open(TREE)))
    ours = _leaves(to_dict(ExperimentConfig()))
    return {k: (v, verl[k]) for k, v in ours.items() if k in verl and not (isinstance(verl[k], str) and "${" in verl[k])
            and v != verl[k] and not (v in (None, {}, []) and verl[k] in (None, {}, []))}


def test_every_default_that_differs_from_verls_is_accounted_for():
    diff = _differences()
    listed = set(EXAMPLES) | set(SAME) | set(OWN)
    assert not set(diff) - listed, f"defaults that differ from verl's without a word: {sorted(set(diff) - listed)}"
    assert not listed - set(diff), f"listed but no longer different: {sorted(listed - set(diff))}"
    assert not (set(EXAMPLES) & set(SAME)) and not (set(SAME) & set(OWN)) and not (set(EXAMPLES) & set(OWN))
    for key, (verl, _) in OWN.items():
        assert diff[key][1] == verl, (key, diff[key])


def test_a_run_names_the_own_defaults_it_uses_once():
    defaults, grpo = ExperimentConfig(), ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]
    note = own_defaults_note(load_config(None, grpo), defaults)
    assert note.startswith("megarl: defaults that differ from verl 0.9.1's") and "\n" not in note
    assert "trainer.total_epochs=1 (verl: 30)" in note and "data.filter_overlong_prompts=True" in note
    assert "critic." not in note and "filter_groups" not in note      # parts this run does not start
    on = own_defaults_note(load_config(None, ["critic.enable=true", "algorithm.filter_groups.enable=true"]), defaults)
    assert "critic.ppo_max_token_len_per_gpu=16384 (verl: 32768)" in on and "max_num_gen_batches=10" in on
    note = own_defaults_note(load_config(None, [*grpo, "trainer.total_epochs=30"]), defaults)
    assert "trainer.total_epochs" not in note        # set by the user: not megarl's default at work
    at_verl = {k: v for k, (v, _) in OWN.items() if v is not None and k not in REFUSED}   # refused: not settable
    note = own_defaults_note(load_config(None, ["critic.enable=true", "algorithm.filter_groups.enable=true", *(
        f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in at_verl.items())]), defaults)
    assert note is not None and not [k for k in at_verl if f"{k}=" in note], note
