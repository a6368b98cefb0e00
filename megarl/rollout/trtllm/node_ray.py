"""One Ray cluster per node for TensorRT-LLM's TP workers, and the bundles each rollout TP group takes.

With TLLM_RAY_FORCE_LOCAL_CLUSTER=1 every TP group's leader starts a Ray instance of its own: TP 1
on 8 GPUs starts 8, each sizing its own object store and CPU count. Instead the leaders of a node
share one cluster and one placement group of one GPU bundle per node GPU, and each passes its
bundles to TensorRT-LLM as verl and NeMo-RL do (RayPlacementConfig; facts in docs/trtllm.md):

  - RayPlacementConfig (llm_args.py) refuses placement_groups without placement_bundle_indices
    (and the reverse), lists of different lengths, a group that is not a Ray PlacementGroup and a
    per_worker_gpu_share outside (0, 1];
  - RayExecutor._get_placement_group (executor/ray/executor.py at e14a6f64) refuses bundle
    indices that do not add up to the world size, and create_workers schedules worker `rank` with
    num_gpus=per_worker_gpu_share in bundle `indices[rank]` (PlacementGroupSchedulingStrategy);
  - with placement groups given, it attaches to the running cluster (ray.init(address="auto"))
    and, having started nothing, leaves it running at LLM.shutdown().

Which GPU a bundle holds is Ray's choice, so the node's placement actor asks each bundle once
(ray.get_gpu_ids() of a task in it) and a group takes the bundles holding its ranks' GPUs: each
worker runs on its own rank's GPU, as check_worker_devices then confirms.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
from dataclasses import dataclass

NAMESPACE = "trtllm"                 # RayExecutor's ray.init namespace (executor.py at 061a914e)
ACTOR = "megarl_trtllm_node"
_HELD: dict[str, object] = {}        # Ray ends a named actor that is not detached with its last handle


@dataclass(frozen=True)
class NodeBundles:
    """The node's placement group and the GPU id (Ray's, the launcher's CUDA ordinal) of each bundle."""
    pg: object
    gpus: tuple[str, ...]


def bundle_plan(bundle_gpus: list[str] | tuple[str, ...], ordinals: list[int], share: float = 1.0) -> list[int]:
    """The bundle indices, in TP-rank order, that hold the group's GPUs; refuses what RayExecutor
    and RayPlacementConfig refuse (a share outside (0, 1], a GPU no bundle holds, two ranks on one)."""
    if not 0 < share <= 1.0:
        raise ValueError(f"per_worker_gpu_share must be in (0, 1], got {share}: megarl gives each TP worker its "
                         "rank's whole GPU (1.0)")
    where = {str(g): i for i, g in enumerate(bundle_gpus)}
    missing = [o for o in ordinals if str(o) not in where]
    if missing or len(set(ordinals)) != len(ordinals):
        raise RuntimeError(f"the node's Ray placement group holds GPUs {list(bundle_gpus)}, the rollout TP group "
                           f"needs {list(ordinals)} (one bundle each): start the node's Ray with every GPU the "
                           "trainer's ranks use visible (CUDA_VISIBLE_DEVICES as the launcher sets it)")
    return [where[str(o)] for o in ordinals]


def _gpu_of_bundle() -> str:
    import ray  # optional: only TensorRT-LLM's Ray executor needs it
    return str(ray.get_gpu_ids()[0])


class NodePlacement:
    """The node's placement group, made once by the first leader that asks (a named Ray actor:
    get_if_exists makes the creation atomic across the node's leaders). The actor and the group go
    with the leader that made them, which ends with the others."""

    def __init__(self, gpus: int):
        import ray  # optional: only TensorRT-LLM's Ray executor needs it
        from ray.util.placement_group import placement_group  # optional, as above
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # optional, as above
        self.pg = placement_group([{"GPU": 1, "CPU": 1} for _ in range(gpus)], strategy="STRICT_PACK")
        ray.get(self.pg.ready(), timeout=120)
        probe = ray.remote(num_gpus=1, num_cpus=0)(_gpu_of_bundle)
        self.gpus = tuple(ray.get([probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=i)).remote() for i in range(gpus)]))

    def bundles(self) -> NodeBundles:
        return NodeBundles(self.pg, self.gpus)


def job_key(env: dict[str, str]) -> str:
    """Names this job's placement actor: torchrun's rendezvous is the same on all its ranks and
    differs between two jobs sharing a node."""
    return f"{env.get('MASTER_ADDR', 'local')}_{env.get('MASTER_PORT', '0')}"


def connect(ray, gpus: int, lock_dir: str | None = None) -> None:
    """Attach this process to the node's Ray, starting it (with `gpus` GPUs) if no leader has: a
    file lock keeps two leaders from starting two. The starting leader's process owns it."""
    if ray.is_initialized():
        return
    path = os.path.join(lock_dir or tempfile.gettempdir(), f"megarl-trtllm-ray-{os.getuid()}.lock")
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            ray.init(address="auto", namespace=NAMESPACE, include_dashboard=False)
        except ConnectionError:
            ray.init(num_gpus=gpus, namespace=NAMESPACE, include_dashboard=False)


def node_bundles(ray, gpus: int, key: str) -> NodeBundles:
    """This job's placement on the node (made on first use, shared afterwards)."""
    actor = ray.remote(num_cpus=0)(NodePlacement).options(
        name=f"{ACTOR}_{key}", namespace=NAMESPACE, get_if_exists=True).remote(gpus)
    _HELD.setdefault(key, actor)     # the first handle is the one that keeps it
    return ray.get(actor.bundles.remote(), timeout=180)


def placement_kwargs(args_mod, nb: NodeBundles, ordinals: list[int], share: float = 1.0) -> dict:
    """LLM(ray_placement_config=...) for the group: the node's group, its bundles in rank order."""
    indices = bundle_plan(nb.gpus, ordinals, share)
    return {"ray_placement_config": args_mod.RayPlacementConfig(
        placement_groups=[nb.pg], placement_bundle_indices=[indices], per_worker_gpu_share=share)}
