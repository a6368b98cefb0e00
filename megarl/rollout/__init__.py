"""Rollout: the engine contract (base.py), engines (native/, hf.py, trtllm.py, a user's class via
custom.py), chosen by `actor_rollout_ref.rollout.name` in registry.py."""
# Importing a component config first (megarl.rollout.config) would enter the cycle
# megarl.config -> experiment -> megarl.rollout.config half-initialised; load the tree first.
import megarl.config  # noqa: F401
