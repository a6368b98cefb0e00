"""Process groups for training: torch.distributed, megatron's (TP, PP, DP) layout, device choice.

    init_distributed(timeout_s=cfg.trainer.collective_timeout_s)   # NCCL on CUDA, gloo on CPU
    lay = init_model_parallel(tp=2, pp=2)                           # megatron parallel_state
    lay = init_model_parallel(tp=1, pp=2, cp=2, vpp=2)              # context / virtual pipeline
    lay.tp_rank, lay.pp_rank, lay.dp_rank, lay.cp_rank, lay.is_last_stage ...

Ranks come from the environment torchrun, srun (megarl's launch scripts export RANK/WORLD_SIZE)
or tests/distributed.py set. Megatron's parallel_state is process-global, so every role in a
megarl process shares one layout (ExperimentConfig refuses differing ones).
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from megarl.parallel import address_space, cpu_compat, loopback


def device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


# The timeout init_distributed was given. Every group made later gets it too: torch's new_group and
# megatron's groups otherwise wait 30 minutes, so a stopped rank would hold the others that long.
_timeout = datetime.timedelta(seconds=600.0)


def collective_timeout() -> datetime.timedelta:
    """What a collective of any megarl group waits for its peers (trainer.collective_timeout_s)."""
    return _timeout


@contextlib.contextmanager
def _groups_default_to(timeout: datetime.timedelta):
    """Groups created inside get `timeout` when their creator names none (megatron 0.16.1 omits it
    for its expert-data-parallel gloo group): torch reads these defaults at each new_group."""
    c10d = dist.distributed_c10d
    saved = c10d.default_pg_timeout, c10d.default_pg_nccl_timeout
    c10d.default_pg_timeout = timeout
    if saved[1] is not None:
        c10d.default_pg_nccl_timeout = timeout
    try:
        yield
    finally:
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = saved


def init_distributed(timeout_s: float = 600.0, store=None, rank: int | None = None,
                     world_size: int | None = None) -> None:
    """Start torch.distributed (idempotent); on CPU install the megatron shim. Without `store`
    the default group is every rank in the environment; with it (a prefix of the job's store),
    the `world_size` ranks that pass the same store: one side of a disaggregated job."""
    global _timeout
    _timeout = datetime.timedelta(seconds=timeout_s)
    cpu_compat.install()
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    if dist.is_initialized():
        return
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise RuntimeError(f"environment variable {key} is not set; start megarl with torchrun, srun "
                               "(launch/) or megarl-train, which set it")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        # On one node without torchrun's agent store, the store listens on loopback only (parallel/loopback.py).
        store = loopback.job_store(timeout)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where = {} if store is None else {"store": store, "rank": rank, "world_size": world_size}
    address_space.check_room_for_group()        # under ulimit -v: fail in one line, never hang (address_space.py)
    # device_id binds NCCL to this rank's GPU (without it NCCL guesses from the global rank and warns)
    dist.init_process_group(backend(), timeout=timeout, device_id=device() if torch.cuda.is_available() else None,
                            **where)


def require_distributed(who: str) -> None:
    """Stop in one line where the rank set-up has not started torch.distributed: only the rank
    set-up starts it (megarl/job/ranks.py:setup_ranks for a run, init_distributed for a tool),
    so the collective timeout is given in one place."""
    if not dist.is_initialized():
        raise RuntimeError(f"{who} needs torch.distributed started first: call megarl.parallel.state."
                           "init_distributed(timeout_s) in the rank set-up (setup_ranks does it for a run)")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp: int = 1          # context parallel: ranks of one DP replica that split the sequence
    cp_rank: int = 0
    vpp: int = 1         # virtual pipeline: model chunks per pipeline stage
    ep: int = 1                            # expert parallel (MoE): over the DP ranks
    ep_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_model_parallel(tp: int, pp: int, seed: int = 42, cp: int = 1, vpp: int | None = None,
                        ep: int = 1) -> Layout:
    """Set up megatron's parallel_state for (TP, CP, PP, virtual PP) over all ranks;
    DP = world / (TP x CP x PP); MoE experts split over EP ranks taken from DP x CP (expert TP = TP).
    Calling again with the same layout is a no-op; another is refused."""
    vpp = vpp if vpp and vpp > 1 else None
    world = dist.get_world_size()
    if world % (tp * cp * pp):
        raise ValueError(f"TP {tp} x CP {cp} x PP {pp} = {tp * cp * pp} does not divide the {world} ranks; "
                         "change the layout")
    if (world // (tp * pp)) % ep:
        raise ValueError(f"EP {ep} must divide DP x CP = {world // (tp * pp)} (world / TP x PP); change the layout")
    if ps.model_parallel_is_initialized():
        cur = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
               ps.get_context_parallel_world_size(), ps.get_virtual_pipeline_model_parallel_world_size(),
               ps.get_expert_model_parallel_world_size())
        if cur != (tp, pp, cp, vpp, ep):
            raise ValueError(f"megatron is already set up for TP={cur[0]} PP={cur[1]} CP={cur[2]} VPP={cur[3]} "
                             f"EP={cur[4]}; every megarl role in one process must share that layout (asked for "
                             f"TP={tp} PP={pp} CP={cp} VPP={vpp} EP={ep})")
        return layout()
    with _groups_default_to(_timeout), address_space.checked_groups():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp, virtual_pipeline_model_parallel_size=vpp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=tp,
                                     create_gloo_process_groups=torch.cuda.is_available(),
                                     distributed_timeout_minutes=_timeout.total_seconds() / 60)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return layout()


def layout() -> Layout:
    return Layout(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                  dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                  pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
                  cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                  vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
                  ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank())


def destroy_model_parallel() -> None:
    ps.destroy_model_parallel()


def tp_group():
    return ps.get_tensor_model_parallel_group()


def cp_group():
    return ps.get_context_parallel_group()


def pp_group():
    return ps.get_pipeline_model_parallel_group()


def dp_group():
    return ps.get_data_parallel_group()


def ep_group():
    return ps.get_expert_model_parallel_group()


def pp_last_rank() -> int:
    """Global rank of the last pipeline stage in this rank's pipeline."""
    return ps.get_pipeline_model_parallel_last_rank()
