"""SGLang: recognised (a verl engine) and refused, with the reason."""
from megarl.engines import EngineInfo

ENGINE = EngineInfo(name="sglang", summary="SGLang", refused="megarl's engines run inside the training processes; "
                    "SGLang's server is not wired to its weight sync")
