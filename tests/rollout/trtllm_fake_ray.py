"""The part of Ray that TensorRT-LLM's Ray executor touches in the leader's process, for the
conformance fake (trtllm_fake.py). FAKE: ray is not installed here.

What the executor does (tensorrt_llm/executor/ray/executor.py at 061a914e, RayExecutor.__init__
and shutdown): with TLLM_RAY_FORCE_LOCAL_CLUSTER=1 it calls ray.init(address="local",
namespace="trtllm", ignore_reinit_error=True, ...) and sets has_start_local_cluser=True whether
or not that call started anything; otherwise ray.init(address="auto") and, without a cluster, a new
local one. Ray allows one connection per process: with ignore_reinit_error a second ray.init
returns without doing anything, so the executor then runs on whatever Ray the process already
had. Its workers get env_vars = os.environ minus RAY_RAYLET_PID / RAY_NODE_IP_ADDRESS, plus
TLLM_DISABLE_MPI=1 and MASTER_ADDR. shutdown() ends with ray.shutdown() when
has_start_local_cluser and ray.is_initialized().
"""
from __future__ import annotations

import types

NODE_LOCAL_VARS = {"RAY_RAYLET_PID", "RAY_NODE_IP_ADDRESS"}


class _Context:
    def __init__(self, namespace):
        self.namespace = namespace


def make_ray() -> types.ModuleType:
    ray = types.ModuleType("ray")
    ray.state = {"initialized": False, "namespace": None, "inits": [], "shutdowns": 0}

    def init(address=None, namespace=None, ignore_reinit_error=False, **kwargs):
        if ray.state["initialized"]:
            if not ignore_reinit_error:
                raise RuntimeError("Maybe you called ray.init twice by accident? This error can be suppressed "
                                   "by passing in 'ignore_reinit_error=True'")
            return None
        if address == "auto":
            raise ConnectionError("Could not find any running Ray instance.")
        ray.state.update(initialized=True, namespace=namespace)
        ray.state["inits"].append({"address": address, "namespace": namespace, **kwargs})
        return None

    def shutdown():
        ray.state.update(initialized=False, namespace=None)
        ray.state["shutdowns"] += 1

    ray.init = init
    ray.shutdown = shutdown
    ray.is_initialized = lambda: ray.state["initialized"]
    ray.get_runtime_context = lambda: _Context(ray.state["namespace"])
    return ray
