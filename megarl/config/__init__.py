"""Typed experiment configuration: YAML with bases, dotted overrides, one-line errors.

The experiment-level names load lazily: component configs (`megarl/<component>/config.py`)
import `megarl.config.typed`, and the experiment module imports them, so an eager import here
would make `import megarl.workers.config` circular.
"""
from megarl.config.errors import ConfigError

_LAZY = ("ActorRolloutRefConfig", "ExperimentConfig", "build_config", "load_config")
__all__ = ["ConfigError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        from megarl.config import experiment
        return getattr(experiment, name)
    raise AttributeError(f"module 'megarl.config' has no attribute {name!r}")
