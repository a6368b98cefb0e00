"""Rollout: the engine contract (base.py), engines (native/, hf.py, trtllm.py, a user's class via
custom.py), chosen by `actor_rollout_ref.rollout.name` in registry.py."""
