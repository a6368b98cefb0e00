"""What a config may make megarl run: an engine's kwargs cannot turn on the model directory's code
behind megarl's own actor_rollout_ref.model.trust_remote_code (docs/security.md: What user code runs).

    python -m pytest -q tests/faults/test_user_code_trust.py
"""
from __future__ import annotations

import pytest

from megarl.config import ConfigError
from megarl.experiment import load_config

MODEL_KEY = "actor_rollout_ref.model.trust_remote_code"


@pytest.mark.parametrize("engine", ["vllm", "trtllm", "custom"])
def test_engine_kwargs_trust_remote_code_behind_megarls_false_key_is_refused(engine):
    key = f"actor_rollout_ref.rollout.engine_kwargs.{engine}.trust_remote_code"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=true"])
    line = str(err.value)
    assert "\n" not in line and key in line and MODEL_KEY in line and "is false" in line


def test_engine_kwargs_trust_remote_code_agreeing_with_megarls_key_is_accepted():
    vllm_key = "actor_rollout_ref.rollout.engine_kwargs.vllm.trust_remote_code"
    cfg = load_config(None, [f"{MODEL_KEY}=true", f"{vllm_key}=true"])
    assert cfg.model.trust_remote_code is True
    cfg = load_config(None, [f"{vllm_key}=false"])
    assert cfg.rollout.engine_kwargs["vllm"]["trust_remote_code"] is False
