"""vLLM: recognised (verl's default) and refused, with the reason."""
from megarl.engines import EngineInfo

ENGINE = EngineInfo(name="vllm", summary="vLLM", refused="megarl's engines run inside the training processes; "
                    "vLLM's server is not wired to its weight sync")
