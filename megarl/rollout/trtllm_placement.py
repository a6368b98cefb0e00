"""Where TensorRT-LLM's TP workers run: on exactly the GPUs of the rollout TP group's ranks.

With `orchestrator_type="ray"` TensorRT-LLM starts a Ray instance of its own on the leader's host
(unless told to join another) and one Ray actor per TP rank, on the GPUs that Ray sees. Under
torchrun or Slurm megarl owns the GPUs, so:

  1. every rank of the rollout TP group reports (host, device UUID); the group must sit on one host;
  2. the leader builds the LLM with CUDA_VISIBLE_DEVICES set to exactly those UUIDs, in TP-rank
     order (`only_devices`): the Ray instance TensorRT-LLM starts, and so its workers, see only
     the group's GPUs. The user never runs `ray start`; the instance goes with llm.shutdown()
     (TRTLLMEngine.close). An explicit placement in engine_kwargs.trtllm (ray_placement_config,
     placement_groups) overrides this, and the check below still runs;
  3. after start-up, `check_worker_devices` compares the UUIDs the workers report
     (`report_device_id`, on TensorRT-LLM's Ray workers and on the extension below for versions
     without it) with the group's, and stops with the fix on any mismatch.

Set equality is what the refit needs: every rank puts the full tensors of a bucket on its own GPU
and keys the IPC handles by its UUID; each worker opens the handles of the GPU it runs on.
Each rank must be able to name the other ranks' GPUs (torchrun, or srun without per-task GPU
binding); a launcher that hides them makes the workers fail to start or the check fail.
"""
from __future__ import annotations

import contextlib
import os
import socket

try:                                       # the worker-side class; TensorRT-LLM imports it by name
    from tensorrt_llm.llmapi.rlhf_utils import WorkerExtension as _Base
except Exception:                          # no tensorrt_llm here: the class is never instantiated
    _Base = object

EXTENSION = "megarl.rollout.trtllm_placement.DeviceReportingExtension"
PLACEMENT_KEYS = ("ray_placement_config", "placement_groups", "placement_bundle_indices")


class DeviceReportingExtension(_Base):
    """TensorRT-LLM's RLHF worker extension (update_weights from IPC handles) plus the device UUID
    each worker runs on, for the placement check."""

    def report_device_id(self) -> str:
        from tensorrt_llm._torch.utils import get_device_uuid
        return get_device_uuid(self.device_id)


def host_name() -> str:
    return socket.gethostname()


def group_devices(members: list[tuple[str, str]], tp_size: int) -> list[str]:
    """The TP group's GPU UUIDs in rank order, from each rank's (host, UUID)."""
    hosts = sorted({h for h, _ in members})
    if len(hosts) > 1:
        raise RuntimeError(f"the rollout TP group spans hosts {hosts}; megarl places TensorRT-LLM's TP workers on one "
                           "host: keep tensor_model_parallel_size <= GPUs per node")
    uuids = [u for _, u in members]
    if len(uuids) != tp_size:
        raise RuntimeError(f"tensor_model_parallel_size={tp_size} but the engine got {len(uuids)} rank(s) in its TP "
                           "group: build it on every rank of the group with tp_group=<that group>")
    if len(set(uuids)) != len(uuids):
        raise RuntimeError(f"ranks of the rollout TP group share a GPU ({uuids}); give each rank its own GPU "
                           "(LOCAL_RANK -> cuda device)")
    return uuids


@contextlib.contextmanager
def only_devices(uuids: list[str]):
    """CUDA_VISIBLE_DEVICES = these UUIDs while the LLM starts (CUDA accepts UUIDs there, which do
    not depend on the launcher's device numbering); restored afterwards. This process's own CUDA
    context is already made and is not affected; the processes started meanwhile inherit it."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(uuids)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def check_worker_devices(worker_uuids: list[str], group_uuids: list[str]) -> None:
    """The engine's workers must run on exactly the TP group's GPUs, one each."""
    workers = sorted(str(u) for u in worker_uuids)
    group = sorted(str(u) for u in group_uuids)
    if workers != group:
        raise RuntimeError(f"TensorRT-LLM's TP workers run on GPUs {workers} but the rollout TP group's ranks hold "
                           f"{group}: a weight refit would find no handle for some worker. Give each rank its own "
                           "GPU, let every rank see the node's GPUs, and drop any placement from engine_kwargs.trtllm")
