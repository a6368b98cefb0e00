"""SGLang: recognised (a verl engine) and refused, with the reason."""
from megarl.engines import EngineInfo

ENGINE = EngineInfo(name="sglang", summary="SGLang", refused="SGLang 0.5.23 pins torch 2.14.1 (megarl's CPU build is "
                    "2.13.0) and its kernels are CUDA-only wheels (its CPU backend builds from source for AMX CPUs)")
