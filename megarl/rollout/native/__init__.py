"""The built-in rollout engine (`actor_rollout_ref.rollout.name=native`, the default)."""
from megarl.rollout.native.engine import NativeEngine
from megarl.rollout.native.tp import TPComm

__all__ = ["NativeEngine", "TPComm"]
