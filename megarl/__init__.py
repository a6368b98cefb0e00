"""megarl: RL post-training of LLMs on megatron-core. `from megarl import DataProto` as in verl.

Names load lazily, so `megarl-train` can refuse a bad config before torch is imported.
"""

__all__ = ["DataProto"]


def __getattr__(name: str):
    if name == "DataProto":
        from megarl.protocol import DataProto  # lazy: megarl-train refuses a bad config before torch loads
        return DataProto
    raise AttributeError(f"module 'megarl' has no attribute {name!r}")
