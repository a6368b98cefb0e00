"""The config toolkit: typed sections, YAML with bases, dotted overrides, one-line errors.

    from megarl.experiment import load_config, ExperimentConfig    # the composed experiment tree

Every component's own section (`megarl/<component>/config.py`) builds on this package, which imports
no other part of megarl; megarl/experiment.py, the composition root, sits above those sections.
"""
from megarl.config.errors import ConfigError

__all__ = ["ConfigError"]
