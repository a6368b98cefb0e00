"""The part of Ray that megarl's node cluster (megarl/rollout/trtllm/node_ray.py) and TensorRT-LLM's
Ray executor touch, for the conformance fake (trtllm_fake.py). FAKE: a Ray cluster per engine test
costs seconds; tests/rollout/test_trtllm_node_ray.py and test_trtllm_real_ray.py run the real one.

Ray's rules it keeps (Ray 2.60: ray/_private/worker.py init / get_accelerator_ids_for_accelerator_resource,
ray/_private/services.py get_ray_address_from_environment):
  - one connection per process: a second ray.init raises, or with ignore_reinit_error returns
    without doing anything (so the caller keeps the process's cluster, namespace and all);
  - address="local" starts a cluster; "auto" and None take RAY_ADDRESS, else "auto" any running
    cluster (ConnectionError without one) and None a new one; an explicit address must be running;
  - a new cluster detects the GPUs its starter's CUDA_VISIBLE_DEVICES names (all without it), and
    its workers start from its starter's environment, a runtime_env's env_vars set on top;
  - ray.get_gpu_ids() maps the worker's GPU slots through the CUDA_VISIBLE_DEVICES its process
    started with (all of that list when a slot is past its end); Ray sets CUDA_VISIBLE_DEVICES in
    a worker unless RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1;
  - a placement group reserves its bundles' GPUs or never becomes ready; a task or actor in
    bundle i takes its GPUs from that bundle (ValueError past the group's end); named actors with
    get_if_exists return the running one.

What TensorRT-LLM's executor does with it (tensorrt_llm/executor/ray/executor.py at e14a6f64,
RayExecutor.__init__ / create_workers / shutdown) is in trtllm_fake_llm.py's `_start_ray`.
"""
from __future__ import annotations

import itertools
import os
import types

NODE_LOCAL_VARS = {"RAY_RAYLET_PID", "RAY_NODE_IP_ADDRESS"}
NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
_ports = itertools.count(6380)


class GetTimeoutError(TimeoutError):
    pass


class PlacementGroup:
    """Named as Ray's class (RayPlacementConfig checks the type)."""

    def __init__(self, cluster, bundles: list[dict]):
        self.id = types.SimpleNamespace(hex=lambda n=next(_ports): f"pg{n:08x}")
        self.bundle_specs = bundles
        free = [s for s in range(cluster.gpus) if s not in cluster.taken]
        need = sum(int(b.get("GPU", 0)) for b in bundles)
        self.slots: list[list[int]] | None = None
        if need <= len(free):
            self.slots = [[free.pop(0) for _ in range(int(b.get("GPU", 0)))] for b in bundles]
            cluster.taken.update(s for b in self.slots for s in b)
        self.used = [0.0] * len(bundles)

    def ready(self):
        return _Ref(error=None if self.slots is not None else GetTimeoutError("placement group not ready"))


class PlacementGroupSchedulingStrategy:
    def __init__(self, placement_group, placement_group_bundle_index=-1, **kw):
        self.placement_group, self.placement_group_bundle_index = placement_group, placement_group_bundle_index


class _Ref:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error


class _Cluster:
    def __init__(self, env: dict, num_gpus: int | None):
        visible = env.get("CUDA_VISIBLE_DEVICES")
        from tests.rollout.trtllm_fake_llm import FakeCluster
        detected = len(visible.split(",")) if visible else len(FakeCluster.gpus)
        self.gpus = detected if num_gpus is None else num_gpus
        self.env = dict(env)                  # what its raylet, and so its workers, inherit
        self.address = f"127.0.0.1:{next(_ports)}"
        self.taken: set[int] = set()
        self.actors: dict[tuple, object] = {}


def make_ray() -> types.ModuleType:
    """A fake `ray` module (and its submodules under ray.util, in `.modules`)."""
    ray = types.ModuleType("ray")
    ray.__version__ = "fake"
    ray.state = {"initialized": False, "namespace": None, "inits": [], "shutdowns": 0, "cluster": None,
                 "started": False, "worker": None}
    node: dict[str, _Cluster] = {}           # the clusters running on the machine, by address
    ray.node = node

    def init(address=None, namespace=None, ignore_reinit_error=False, num_gpus=None, num_cpus=None, **kwargs):
        if ray.state["initialized"]:
            if not ignore_reinit_error:
                raise RuntimeError("Maybe you called ray.init twice by accident? This error can be suppressed "
                                   "by passing in 'ignore_reinit_error=True'")
            return None
        if address in (None, "auto"):
            address = os.environ.get("RAY_ADDRESS") or address
        if address == "auto":                 # any running cluster (Ray's legacy "auto")
            if not node:
                raise ConnectionError("Could not find any running Ray instance.")
            address = next(reversed(node))
        if address in (None, "local"):
            cluster = _Cluster(dict(os.environ), num_gpus)
            node[cluster.address] = cluster
            ray.state["started"] = True
        elif address in node:
            cluster = node[address]
            ray.state["started"] = False
        else:
            raise ConnectionError(f"Failed to connect to Ray cluster at {address}")
        ray.state.update(initialized=True, namespace=namespace, cluster=cluster)
        ray.state["inits"].append({"address": address, "namespace": namespace, **kwargs})
        return None

    def shutdown():
        if ray.state["started"] and ray.state["cluster"] is not None:
            node.pop(ray.state["cluster"].address, None)      # a cluster ends with the driver that started it
        ray.state.update(initialized=False, namespace=None, cluster=None, started=False)
        ray.state["shutdowns"] += 1

    def cluster():
        if not ray.state["initialized"]:
            raise RuntimeError("Ray has not been started yet")
        return ray.state["cluster"]

    def get_gpu_ids():
        worker = ray.state["worker"]
        if worker is None:
            return []
        original = worker["start_env"].get("CUDA_VISIBLE_DEVICES")
        if not original:
            return list(worker["slots"])
        ids = original.split(",")
        return [ids[s] for s in worker["slots"]] if all(s < len(ids) for s in worker["slots"]) else ids

    def worker_env() -> dict:
        """The environment of the fake worker running now (its process's os.environ in real Ray)."""
        return ray.state["worker"]["env"]

    def _place(opts) -> tuple[list[int], object]:
        """The GPU slots a task or actor gets, and what gives them back."""
        c, gpus = cluster(), opts.get("num_gpus", 0) or 0
        strategy = opts.get("scheduling_strategy")
        if isinstance(strategy, PlacementGroupSchedulingStrategy):
            pg, i = strategy.placement_group, strategy.placement_group_bundle_index
            if not 0 <= i < len(pg.bundle_specs):
                raise ValueError(f"bundle index {i} is invalid: the placement group has {len(pg.bundle_specs)} "
                                 "bundles")
            if pg.slots is None or pg.used[i] + gpus > pg.bundle_specs[i].get("GPU", 0) + 1e-9:
                raise GetTimeoutError(f"bundle {i} has not {gpus} GPU left")
            pg.used[i] += gpus
            return (list(pg.slots[i]) if gpus else []), lambda: pg.used.__setitem__(i, pg.used[i] - gpus)
        free = [s for s in range(c.gpus) if s not in c.taken]
        if len(free) < gpus:
            raise GetTimeoutError(f"no {gpus} GPU free")
        slots = free[:int(gpus + 0.999)]
        c.taken.update(slots)
        return slots, lambda: c.taken.difference_update(slots)

    def _run(opts, fn, *args):
        c = cluster()
        env = {**c.env, **((opts.get("runtime_env") or {}).get("env_vars") or {})}
        slots, release = _place(opts)
        saved = ray.state["worker"]
        context = ray.state["worker"] = {"slots": slots, "start_env": dict(env), "env": env, "release": release}
        if slots and env.get(NOSET) != "1":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in get_gpu_ids())
        try:
            return _Ref(fn(*args)), context
        except Exception as err:               # noqa: BLE001 - Ray hands the error to ray.get
            return _Ref(error=err), context
        finally:
            ray.state["worker"] = saved
            if not isinstance(fn, type):
                release()                      # a task gives its GPUs back when it returns

    class _Handle:
        def __init__(self, instance, context):
            self._instance, self._context = instance, context

        def __getattr__(self, name):
            method = getattr(self._instance, name)

            def call(*args):
                saved = ray.state["worker"]
                ray.state["worker"] = self._context
                try:
                    return _Ref(method(*args))
                except Exception as err:       # noqa: BLE001 - as above
                    return _Ref(error=err)
                finally:
                    ray.state["worker"] = saved
            return types.SimpleNamespace(remote=call)

    class _Remote:
        def __init__(self, target, opts):
            self.target, self.opts = target, opts

        def options(self, **kw):
            return _Remote(self.target, {**self.opts, **kw})

        def remote(self, *args):
            if not isinstance(self.target, type):
                return _run(self.opts, self.target, *args)[0]
            key = (self.opts.get("namespace") or ray.state["namespace"], self.opts.get("name"))
            if key[1] is not None and key in cluster().actors:
                if not self.opts.get("get_if_exists"):
                    raise ValueError(f"The name {key[1]} (namespace={key[0]}) is already taken")
                return cluster().actors[key]
            ref, context = _run(self.opts, self.target, *args)
            if ref.error is not None:
                context["release"]()
                raise ref.error
            handle = _Handle(ref.value, context)
            if key[1] is not None:
                cluster().actors[key] = handle
            return handle

    def remote(*args, **opts):
        if args and callable(args[0]):
            return _Remote(args[0], {})
        return lambda target: _Remote(target, opts)

    def get(refs, timeout=None):
        many = isinstance(refs, list)
        for ref in refs if many else [refs]:
            if ref.error is not None:
                raise ref.error
        return [r.value for r in refs] if many else refs.value

    def kill(handle, no_restart=True):
        if handle._instance is not None:
            handle._context["release"]()
        handle._instance = None

    ray.init, ray.shutdown, ray.get, ray.remote, ray.kill = init, shutdown, get, remote, kill
    ray.is_initialized = lambda: ray.state["initialized"]
    ray.get_runtime_context = lambda: types.SimpleNamespace(
        namespace=ray.state["namespace"], gcs_address=ray.state["cluster"].address if ray.state["cluster"] else None)
    ray.get_gpu_ids, ray.worker_env = get_gpu_ids, worker_env
    ray.cluster_resources = lambda: {"GPU": float(cluster().gpus), "CPU": 64.0}
    pg_mod = types.ModuleType("ray.util.placement_group")
    pg_mod.placement_group = lambda bundles, strategy="PACK", **kw: PlacementGroup(cluster(), bundles)
    pg_mod.PlacementGroup = PlacementGroup
    pg_mod.remove_placement_group = lambda pg: cluster().taken.difference_update(s for b in pg.slots or [] for s in b)
    pg_mod.get_current_placement_group = lambda: None
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.PlacementGroupSchedulingStrategy = PlacementGroupSchedulingStrategy
    util = types.ModuleType("ray.util")
    util.__path__ = []
    util.placement_group, util.scheduling_strategies = pg_mod, strategies
    util.get_node_ip_address = lambda: "127.0.0.1"
    util.remove_placement_group = pg_mod.remove_placement_group
    ray.util = util
    ray.__path__ = []
    ray.exceptions = types.SimpleNamespace(GetTimeoutError=GetTimeoutError, ActorDiedError=RuntimeError)
    ray.modules = {"ray": ray, "ray.util": util, "ray.util.placement_group": pg_mod,
                   "ray.util.scheduling_strategies": strategies}
    return ray


class RayWorkerWrapper:
    """What RayWorkerWrapper.__init__ (executor/ray/gpu_worker.py) does with Ray's GPU id: int() of
    ray.get_gpu_ids()[0], then physical_to_local_id through the worker's CUDA_VISIBLE_DEVICES
    (ValueError where the id is not in it). Runs in the fake Ray and in a real one."""

    def __init__(self, rank: int):
        import ray  # the fake above, or the real one (tests/rollout/test_trtllm_real_ray.py)
        env = ray.worker_env() if hasattr(ray, "worker_env") else os.environ
        self.rank, self.gpu, self.env = rank, int(ray.get_gpu_ids()[0]), dict(env)
        visible = env.get("CUDA_VISIBLE_DEVICES")
        self.local = list(map(int, visible.split(","))).index(self.gpu) if visible else self.gpu
        self.physical = int(visible.split(",")[self.local]) if visible else self.local

    def device(self) -> int:
        """The GPU this worker runs on, as CUDA numbers it without CUDA_VISIBLE_DEVICES."""
        return self.physical

    def environment(self) -> dict:
        """The worker process's environment: its raylet's, with the runtime_env's env_vars on top."""
        return self.env
