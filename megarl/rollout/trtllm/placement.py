"""Where TensorRT-LLM's TP workers run: on exactly the GPUs of the rollout TP group's ranks.

How TensorRT-LLM's Ray executor assigns GPUs (tensorrt_llm/executor/ray/executor.py at 061a914e,
executor/ray/gpu_worker.py at a3dfe261; executor/ray_executor.py at 0777969c and
executor/ray_gpu_worker.py at 8579c297 before the move):
  - it sets RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, keeps the process's Ray where one is
    attached, else attaches to a running one (address="auto") unless TLLM_RAY_FORCE_LOCAL_CLUSTER=1,
    else starts a local one that sees the GPUs CUDA_VISIBLE_DEVICES names; the workers go to the
    placement groups it is given (ray_placement_config), else to a PACK group it makes;
  - each worker gets the leader's whole environment (runtime_env env_vars = os.environ), so
    CUDA_VISIBLE_DEVICES and PYTHONPATH travel with it;
  - RayWorkerWrapper.__init__ does `int(ray.get_gpu_ids()[0])` (Ray returns the worker's own
    CUDA_VISIBLE_DEVICES entry, ray/_private/worker.py) and maps it back with
    `list(map(int, CUDA_VISIBLE_DEVICES.split(",")))`: the entries must be integer ordinals; a
    GPU UUID raises ValueError in every version read.

The workers' environment is the leader's (executor.py at 061a914e: env_vars = os.environ minus
RAY_RAYLET_PID / RAY_NODE_IP_ADDRESS, plus TLLM_DISABLE_MPI=1 and MASTER_ADDR = the Ray head's
address). Under torchrun that carries the trainer's RANK / LOCAL_RANK / WORLD_SIZE / MASTER_PORT
and TORCHELASTIC_* (a worker would read another process group's rank, size and port), and
megatron's CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue: the inference kernels of a worker
serialise). `worker_env` removes them while the LLM starts, sets NCCL_CUMEM_ENABLE=1 (NeMo-RL's
TensorRT-LLM workers set it; an explicit value is kept) and puts TensorRT-LLM's bin directory
first on PATH (NeMo-RL finds it, and the NVRTC headers beside it, through `pip show tensorrt_llm`).

So the leader starts the LLM inside `worker_env`: megarl's source root prepended to PYTHONPATH so
the workers import the extension below without megarl being pip-installed (on this node; workers
on other nodes of an existing Ray cluster need megarl installed there, and `start_failure` says so
in one line). In the node's Ray cluster (node_ray.py, the default) the workers keep the launcher's
CUDA_VISIBLE_DEVICES and take the bundles holding the group's ordinals (each rank's device index
translated through the launcher's CUDA_VISIBLE_DEVICES, `device_ordinal`). With
TLLM_RAY_FORCE_LOCAL_CLUSTER=1 (the user's choice) the LLM starts a Ray of its own that sees
CUDA_VISIBLE_DEVICES = the group's ordinals in TP-rank order. A launcher that hides the other
ranks' GPUs from the leader's process (Slurm with ConstrainDevices and per-task binding) leaves the
workers no GPU: run the rollout TP group's ranks with the node's GPUs visible. Everything is
restored afterwards; the leader's CUDA context already exists and is not affected.
After start-up `check_worker_devices` compares the UUIDs the workers report
(RayWorkerWrapper.report_device_id) with the group's and stops with the fix on any mismatch.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

try:                                       # the worker-side class; TensorRT-LLM imports it by name
    from tensorrt_llm.llmapi.rlhf_utils import WorkerExtension as _Base
except Exception:                          # no tensorrt_llm here: the class is never instantiated
    _Base = object

EXTENSION = "megarl.rollout.trtllm.placement.DeviceReportingExtension"
# torchrun's variables (torch/distributed/run.py, elastic agent) and megatron's queue limit: never
# the workers' (see the module docstring).
TRAINER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_PORT", "CUDA_DEVICE_MAX_CONNECTIONS")
TRAINER_PREFIXES = ("TORCHELASTIC_",)
PLACEMENT_KEYS = ("ray_placement_config", "placement_groups", "placement_bundle_indices")


class DeviceReportingExtension(_Base):
    """TensorRT-LLM's RLHF worker extension (update_weights from IPC handles) plus the device UUID
    each worker runs on, for the placement check on versions whose wrapper lacks it."""

    def reset_prefix_cache(self) -> None:
        """Forget the KV blocks that prefix reuse would serve again. TensorRT-LLM's extension has
        this method on newer commits (rlhf_utils.py at 04762f3b); where it lacks it, the executor's
        own reset, which its update_weights(None) calls (rlhf_utils.py at 65b31db)."""
        base = getattr(super(), "reset_prefix_cache", None)
        if base is not None:
            return base()
        return self.engine.reset_prefix_cache()

    def report_device_id(self) -> str:
        from tensorrt_llm._torch.utils import get_device_uuid  # optional dependency: runs in TRT-LLM's workers
        return get_device_uuid(self.device_id)


def host_name() -> str:
    return socket.gethostname()


def megarl_root() -> str:
    """The directory that holds the megarl package (what the workers need on PYTHONPATH): three
    folders above this file, megarl/rollout/trtllm/placement.py."""
    return str(Path(__file__).resolve().parents[3])


def device_ordinal(index: int, visible: str | None) -> str:
    """How a fresh process on this host names this rank's device `index`: the index itself, or the
    launcher's CUDA_VISIBLE_DEVICES entry at that index (checked by `group_devices`, on every rank)."""
    if not visible:
        return str(index)
    entries = [e.strip() for e in visible.split(",")]
    return entries[index] if index < len(entries) else f"cuda:{index} of CUDA_VISIBLE_DEVICES={visible}"


def group_devices(members: list[tuple[str, str, str]], tp_size: int) -> tuple[list[str], list[int]]:
    """The TP group's (GPU UUIDs, CUDA ordinals) in rank order, from each rank's (host, UUID, ordinal)."""
    hosts = sorted({m[0] for m in members})
    if len(hosts) > 1:
        raise RuntimeError(f"the rollout TP group spans hosts {hosts}; megarl places TensorRT-LLM's TP workers on one "
                           "host: keep tensor_model_parallel_size <= GPUs per node")
    uuids, ordinals = [m[1] for m in members], [str(m[2]) for m in members]
    if len(uuids) != tp_size:
        raise RuntimeError(f"tensor_model_parallel_size={tp_size} but the engine got {len(uuids)} rank(s) in its TP "
                           "group: build it on every rank of the group with tp_group=<that group>")
    if len(set(uuids)) != len(uuids):
        raise RuntimeError(f"ranks of the rollout TP group share a GPU ({uuids}); give each rank its own GPU "
                           "(LOCAL_RANK -> cuda device)")
    bad = [o for o in ordinals if not o.isdigit()]
    if bad:
        raise RuntimeError(f"the rollout TP group's GPUs are named {ordinals} by CUDA_VISIBLE_DEVICES, but "
                           "TensorRT-LLM's Ray workers parse integer ids (executor/ray/gpu_worker.py): set "
                           "CUDA_VISIBLE_DEVICES to integer ordinals (not GPU UUIDs or MIG ids)")
    return uuids, [int(o) for o in ordinals]


def tensorrt_llm_bin(tllm) -> str | None:
    """TensorRT-LLM's bin directory (inside the installed package), or None without a file path."""
    path = getattr(tllm, "__file__", None)
    return os.path.join(os.path.dirname(path), "bin") if path else None


def worker_environment(ordinals: list[int] | None, env: dict[str, str], bin_dir: str | None = None
                       ) -> dict[str, str | None]:
    """The variables to change while the LLM starts (None: removed), see the module docstring.
    `ordinals`: the group's, for a Ray of the LLM's own (TLLM_RAY_FORCE_LOCAL_CLUSTER=1); None in
    the node's cluster, whose workers keep the launcher's CUDA_VISIBLE_DEVICES: Ray maps a worker's
    GPU slot through it (node_ray.py), and a shorter list would map every worker to its first GPU."""
    paths = [megarl_root()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != megarl_root()]
    out: dict[str, str | None] = {k: None for k in env if k in TRAINER_VARS or k.startswith(TRAINER_PREFIXES)}
    out.update({"PYTHONPATH": os.pathsep.join(paths), "NCCL_CUMEM_ENABLE": env.get("NCCL_CUMEM_ENABLE", "1")})
    if ordinals is not None:
        out.update({"CUDA_VISIBLE_DEVICES": ",".join(str(o) for o in ordinals),
                    "TLLM_RAY_FORCE_LOCAL_CLUSTER": env.get("TLLM_RAY_FORCE_LOCAL_CLUSTER", "1")})
    if bin_dir:
        out["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", "").split(os.pathsep)
                                                   if p and p != bin_dir])
    return out


@contextlib.contextmanager
def worker_env(ordinals: list[int] | None, tllm=None):
    """os.environ carries `worker_environment` while the LLM starts; restored afterwards."""
    overrides = worker_environment(ordinals, dict(os.environ), tensorrt_llm_bin(tllm) if tllm else None)
    saved = {k: os.environ.get(k) for k in overrides}
    for key, value in overrides.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield overrides
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


TRTLLM_NAMESPACE = "trtllm"    # the namespace RayExecutor passes to ray.init (executor.py at 061a914e)


def check_process_ray() -> None:
    """Refuse, before the LLM starts, a process whose Ray is already up (megarl's reward or tool
    pool). RayExecutor's ray.init(..., ignore_reinit_error=True) would then run the workers in that
    Ray, not in one of their own that sees only the group's GPUs, and LLM.shutdown() calls
    ray.shutdown() under the pool (it counts the cluster as its own with
    TLLM_RAY_FORCE_LOCAL_CLUSTER=1). Ray allows one instance per process, so the two cannot be
    kept apart in it. Another TensorRT-LLM engine's Ray (namespace "trtllm") is TensorRT-LLM's own
    way. Only looks where ray is already imported: nothing else can have started it."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and ray.get_runtime_context().namespace != TRTLLM_NAMESPACE:
        raise RuntimeError("Ray already runs in this process (megarl's reward or tool pool); TensorRT-LLM's "
                           "executor would run its workers in it and shut it down with the LLM: with "
                           "rollout.name=trtllm set reward_model.launch_reward_fn_async=false and "
                           "actor_rollout_ref.rollout.multi_turn.tool_backend=thread, or use another engine")


def start_failure(err: BaseException) -> str | None:
    """One line for the start-up failures megarl's placement can cause, else None."""
    chain, seen = [], err
    while seen is not None:
        chain.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    text = " <- ".join(chain)
    if "worker extension" in text or "died during initialization" in text:
        return (f"TensorRT-LLM's Ray workers did not start ({text}): they import {EXTENSION} from PYTHONPATH, which "
                f"megarl sets to {megarl_root()} for them; where they run on another node (an existing Ray cluster), "
                f"install megarl there too (pip install -e <checkout>)")
    return None


def check_worker_devices(worker_uuids: list[str], group_uuids: list[str]) -> None:
    """Each worker must run on a GPU of the TP group, and no two on the same one (the refit keys
    the IPC handles by UUID; which worker of Ray's bundle takes which GPU is Ray's choice)."""
    workers = [str(u) for u in worker_uuids]
    strays = [f"worker {i} on {u}" for i, u in enumerate(workers) if u not in group_uuids]
    if strays or len(set(workers)) != len(workers) or len(workers) != len(group_uuids):
        raise RuntimeError(f"TensorRT-LLM's TP workers run on GPUs {workers} ({', '.join(strays) or 'not one each'}) "
                           f"but the rollout TP group's ranks hold {list(group_uuids)}: a weight refit would find no "
                           "handle for some worker. Give each rank its own GPU, let the leader's process see the "
                           "group's GPUs, and drop any placement from engine_kwargs.trtllm")
