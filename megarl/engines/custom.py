"""A user's BaseRollout subclass (custom_cls_path / custom_cls_name, megarl/rollout/custom.py).

Its abilities are the class's own attributes (EngineInfo.declared_by); the ones it leaves out keep
the conservative defaults: no routes, log-probs never taken for the trainer's, no CUDA graphs."""
from megarl.engines import EngineInfo

ENGINE = EngineInfo(name="custom", summary="a user's BaseRollout subclass", build="megarl.rollout.custom:build_custom",
                    user_class=True)
