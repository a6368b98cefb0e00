"""The registry of model families: one file per family in this package holds a ModelFamily
(megarl/models/families/base.py says what one holds), found by its file name; spec.py, convert.py,
build.py, flops.py and the built-in engine read the registered family instead of branching on family names,
and call its code hooks (FamilyHooks, megarl/models/families/hooks.py) where data cannot say it.

    family = for_config(json.load(open("ckpt/config.json")))    # ValueError naming the supported ones
    family = get("qwen2")
    names()                                                    # every registered family
"""
from __future__ import annotations

from megarl.models.families.base import ModelFamily
from megarl.models.families.hooks import FamilyHooks
from megarl.models.families.registry import (architectures, for_config, for_model_type, get, names, register,
                                             unregister)

__all__ = ["FamilyHooks", "ModelFamily", "architectures", "for_config", "for_model_type", "get", "names", "register",
           "unregister"]
