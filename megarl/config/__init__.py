"""Typed experiment configuration: YAML with bases, dotted overrides, one-line errors."""
from megarl.config.errors import ConfigError
from megarl.config.experiment import ActorRolloutRefConfig, ExperimentConfig, build_config, load_config

__all__ = ["ActorRolloutRefConfig", "ConfigError", "ExperimentConfig", "build_config", "load_config"]
