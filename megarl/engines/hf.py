"""transformers' generate, one whole model per rank (megarl/rollout/hf.py): the slow baseline."""
from megarl.engines import EngineInfo

ENGINE = EngineInfo(
    name="hf", summary="transformers' generate, one model per rank", build="megarl.rollout.hf:build_hf",
    requires="transformers",
    why_no_routes="transformers' generate returns no per-token routes (its output has no router logits or expert ids)",
    graphs_hint="for hf leave it unset",
    takes_hf_overrides=True,                  # model.override_config reaches its model (rollout/build_args.py)
)
