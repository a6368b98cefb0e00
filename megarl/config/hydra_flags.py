"""verl's Hydra flags and sections, each answered with one line on megarl's way (megarl takes one YAML
file with `base:` and key=value overrides)."""
from __future__ import annotations

from megarl.config.errors import ConfigError

HYDRA_FLAGS = ("--config-name", "--config-path", "--config-dir", "-cn", "-cp", "-cd")


def refuse_hydra_flags(argv: list[str]) -> None:
    """verl's Hydra flags get one line on megarl's --config instead of argparse's bare usage error."""
    for arg in argv:
        if arg.split("=", 1)[0] in HYDRA_FLAGS:
            raise ConfigError(f"{arg.split('=', 1)[0]} is Hydra's (verl's) flag; megarl takes one YAML file, "
                              "--config path/to/file.yaml (it may name a base:), then key=value overrides, e.g. "
                              "--config configs/ppo_gsm8k_qwen2.5_7b.yaml data.train_batch_size=64")


# Hydra's own top-level sections in verl's YAML files, and what a megarl config says instead
HYDRA_SECTIONS = {
    "hydra": "is Hydra's section of verl's YAML, which megarl does not run; remove it (hydra.run.dir's "
             "directory is trainer.default_local_dir here)",
    "defaults": "is Hydra's composition list of verl's YAML; megarl composes with one `base: other.yaml` "
                "(merged under this file); replace the list with base: or remove it",
}


def refuse_hydra_sections(raw: dict) -> None:
    """verl's `hydra:` and `defaults:` sections get one line each instead of 'unknown key'."""
    for key, why in HYDRA_SECTIONS.items():
        if key in raw:
            raise ConfigError(why, key)
