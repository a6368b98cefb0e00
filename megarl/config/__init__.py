"""Typed experiment configuration: YAML with bases, dotted overrides, one-line errors.

    from megarl.config.experiment import load_config, ExperimentConfig

The experiment tree lives in megarl.config.experiment, not here: component configs
(`megarl/<component>/config.py`) import `megarl.config.typed`, which runs this file first, and the
experiment module imports those components, so importing it here would be a circle.
"""
from megarl.config.errors import ConfigError

__all__ = ["ConfigError"]
