"""Typed experiment configuration: YAML with bases, dotted overrides, one-line errors."""
from megarl.config.errors import ConfigError

__all__ = ["ActorRolloutRefConfig", "ConfigError", "ExperimentConfig", "build_config", "load_config"]


def __getattr__(name: str):
    # Loaded on first use: the component configs import megarl.config.typed, and the experiment
    # tree imports them, so an eager import here would be circular for whoever comes first.
    if name in ("ActorRolloutRefConfig", "ExperimentConfig", "build_config", "load_config"):
        from megarl.config import experiment
        return getattr(experiment, name)
    raise AttributeError(f"module 'megarl.config' has no attribute {name!r}")
