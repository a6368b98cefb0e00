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
  - RayExecutor.__init__ (same file) calls ray.init(address="auto", ignore_reinit_error=True) unless
    TLLM_RAY_FORCE_LOCAL_CLUSTER=1: in a process already attached (connect, below) Ray returns at
    once, so the executor counts the cluster as not its own; its shutdown then neither calls
    ray.shutdown() nor removes a placement group it was given (a list of groups: not its own).

The cluster is the job's: its first leader on the node starts it and records its address in a
file named by the job (job_key) in this user's private directory; the job's other leaders attach
to that address. address="auto" would join whatever Ray the node runs (RAY_ADDRESS, the last
`ray start`), another user's or another job's.

Which GPU a bundle holds is Ray's choice, so the node's placement actor asks each bundle once
(ray.get_gpu_ids() of a task in it) and a group takes the bundles holding its ranks' GPUs: each
worker runs on its own rank's GPU, as check_worker_devices then confirms. ray.get_gpu_ids() maps
Ray's slot through the worker's own CUDA_VISIBLE_DEVICES (Ray 2.60 worker.py), so TensorRT-LLM's
workers, which inherit the leader's, must see the launcher's list, not the group's ordinals.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass

from megarl.parallel.actor_pool import share_ray
from megarl.parallel.ray_auth import private_temp_dir, ray_token_auth
from megarl.rollout.trtllm.placement import megarl_root
from megarl.storage.private_out import new_file

NAMESPACE = "trtllm"                 # RayExecutor's ray.init namespace (executor.py at 061a914e)
ACTOR = "megarl_trtllm_node"
_HELD: dict[str, object] = {}        # Ray ends a named actor that is not detached with its last handle
log = logging.getLogger(__name__)
FOREIGN_RAY = ("Ray already runs in this process and is not this job's TensorRT-LLM node cluster (megarl's reward "
               "or tool pool started it): with rollout.name=trtllm set reward_model.launch_reward_fn_async=false "
               "and actor_rollout_ref.rollout.multi_turn.tool_backend=thread, or use another engine")


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


# What tells one job from another on a node: the scheduler's job, torchrun's run and rendezvous
# (the same on every rank of a launch, different for two launches sharing the node), and the user.
JOB_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
            "MASTER_ADDR", "MASTER_PORT")


def job_key(env: dict[str, str]) -> str:
    """Names this job's node cluster and placement actor. Without a launcher's variables the process
    is a job of its own."""
    parts = [f"uid={os.getuid()}"] + [f"{k}={env[k]}" for k in JOB_VARS if k in env]
    if len(parts) == 1:
        parts.append(f"pid={os.getpid()}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _record_path(key: str) -> str:
    """Where the job's cluster address lives: a file in this user's private 0700 directory, which
    no other user can write (ray_auth.private_temp_dir's parent)."""
    return os.path.join(os.path.dirname(private_temp_dir()), f"trtllm-node-{key}.json")


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    try:
        os.kill(int(record["pid"]), 0)               # the cluster lives with the process that started it
    except (ProcessLookupError, KeyError, ValueError, TypeError):
        return None
    except PermissionError:
        pass                                         # alive, another user's pid: the connect below tells
    return record if record["pid"] != os.getpid() or _initialized() else None


def _initialized() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _runtime_env() -> dict:
    """The workers of the job's cluster import megarl (the placement actor, megarl's extension) and,
    for megarl's pools sharing it, the user's modules, as ensure_ray's own cluster does."""
    paths = [megarl_root(), os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}}


def connect(ray, key: str, num_gpus: int | None = None, num_cpus: int | None = None) -> str:
    """Attach this process to the job's Ray cluster on this node by its recorded address, starting it
    (Ray's own GPU and CPU detection, or `num_gpus` / `num_cpus`) if no leader of the job has: a file lock keeps two
    leaders from starting two. Never address="auto": that finds whichever Ray the node (RAY_ADDRESS,
    /tmp/ray's last cluster) last started, another user's or another job's. The cluster asks for
    Ray's token (ray_auth.py); the record passes the token to the job's other leaders. Returns the
    cluster's address."""
    path = _record_path(key)
    if ray.is_initialized():
        record = _read(path)
        here = ray.get_runtime_context().gcs_address
        if record is None or record["address"] != here:
            raise RuntimeError(FOREIGN_RAY)
        return share_ray(here)
    with open(path + ".lock", "w") as lock, _without("RAY_ADDRESS"):
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = _read(path)
        if record is not None:
            if record.get("token"):
                os.environ["RAY_AUTH_TOKEN"] = record["token"]
            ray_token_auth()
            ray.init(address=record["address"], namespace=NAMESPACE, runtime_env=_runtime_env())
            return share_ray(record["address"])
        warning = ray_token_auth()
        if warning:
            log.warning(warning)
        ray.init(address="local", num_gpus=num_gpus, num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False,
                 _temp_dir=private_temp_dir(), runtime_env=_runtime_env())
        address = ray.get_runtime_context().gcs_address
        with new_file(os.path.dirname(path), os.path.basename(path)) as f:     # private, whole or absent
            json.dump({"address": address, "pid": os.getpid(), "token": os.environ.get("RAY_AUTH_TOKEN")}, f)
        return share_ray(address)


@contextlib.contextmanager
def _without(name: str):
    """RAY_ADDRESS names some running Ray; the job's cluster is addressed explicitly, and ray_auth
    would take the variable for a cluster to join and leave the token off."""
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def node_bundles(ray, key: str) -> NodeBundles:
    """This job's placement on the node, one bundle per GPU of the cluster (made on first use,
    shared afterwards)."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus < 1:
        raise RuntimeError("the job's Ray cluster on this node has no GPU: start the training ranks with the "
                           "node's GPUs visible (CUDA_VISIBLE_DEVICES as the launcher sets it)")
    actor = ray.remote(num_cpus=0)(NodePlacement).options(
        name=f"{ACTOR}_{key}", namespace=NAMESPACE, get_if_exists=True).remote(gpus)
    # the first handle in this cluster is the one that keeps the actor
    _HELD.setdefault(f"{ray.get_runtime_context().gcs_address}/{key}", actor)
    return ray.get(actor.bundles.remote(), timeout=180)


def placement_kwargs(args_mod, nb: NodeBundles, ordinals: list[int], share: float = 1.0) -> dict:
    """LLM(ray_placement_config=...) for the group: the node's group, its bundles in rank order."""
    indices = bundle_plan(nb.gpus, ordinals, share)
    return {"ray_placement_config": args_mod.RayPlacementConfig(
        placement_groups=[nb.pg], placement_bundle_indices=[indices], per_worker_gpu_share=share)}
