"""vLLM's weight-transfer API (vllm/distributed/weight_transfer/) behind megarl's weight sync, on CUDA.

vLLM's worker keeps a weight-update session (vllm/v1/worker/gpu_worker.py): start_weight_update,
update_weights(update_info) per chunk, finish_weight_update, each refused out of order, and a
failed update_weights closes the session itself. Its checkpoint-format engines (IPC, NCCL) open
vLLM's layer-wise reload in start and finalize it in finish, as megarl's own reload does
(worker.py). megarl's begin/load/finish maps onto that session one to one, bucket for bucket.

The transport: vLLM's IPC engine sends CUDA IPC handles to another process and its NCCL engine
broadcasts from a trainer rank 0 over a group of its own. megarl runs vLLM's engine core inside
the rollout rank (args.set_environment), where the bucket is already in the process and on the
rank's GPU, and CUDA opens an IPC handle only in a process other than its exporter. So megarl
registers an in-process engine with vLLM's engine factory (which takes engine classes at run
time): its update info carries the bucket's tensors, which collective_rpc hands over as they are.

Where vLLM has no such API (no `weight_transfer_config` among EngineArgs' fields, or engines
without start_weight_update), the engine keeps the reload path of worker.py.

Sources (vllm-project/vllm; docs/rollout.md lists them with the rules the tests hold):
  weight_transfer/base.py @ 02f250b0   engine lifecycle; parse_*_info: a TypeError becomes ValueError
  weight_transfer/factory.py @ 047c993c  register_engine(name, cls); a second one is a ValueError;
                                       create_engine: an unknown backend is a ValueError
  v1/worker/gpu_worker.py (index excerpt, no commit)  the worker's session rules
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

BACKEND = "megarl_in_process"
CONFIG = {"backend": BACKEND}


def available(engine_args_cls) -> bool:
    """vLLM's build has the weight-transfer API in the form megarl drives: EngineArgs takes a
    weight_transfer_config and its engines own start/finish (base.py @ 02f250b0; older engines
    took the layer-wise reload from the worker and a load_weights callable instead)."""
    if "weight_transfer_config" not in {f.name for f in dataclasses.fields(engine_args_cls)}:
        return False
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine  # optional, loaded with vLLM
    except ImportError:
        return False
    return callable(getattr(WeightTransferEngine, "start_weight_update", None))


def register() -> None:
    """megarl's in-process engine in vLLM's factory, before vLLM builds its workers (they create
    their engine from weight_transfer_config when they load the model)."""
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,  # optional
                                                       WeightTransferUpdateInfo)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # optional

    @dataclasses.dataclass
    class InProcessInitInfo(WeightTransferInitInfo):
        pass

    @dataclasses.dataclass
    class InProcessUpdateInfo(WeightTransferUpdateInfo):
        names: list
        tensors: list

        def __post_init__(self):
            if len(self.tensors) != len(self.names):
                raise ValueError(f"`tensors` should be of the same size as `names`: got {len(self.tensors)} "
                                 f"and {len(self.names)}")
            for name, t in zip(self.names, self.tensors):
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"weight {name}: a {type(t).__name__}, not a tensor (megarl's in-process "
                                     "engine takes tensors; is vLLM's engine core in another process?)")

    class InProcessEngine(WeightTransferEngine):
        init_info_cls = InProcessInitInfo
        update_info_cls = InProcessUpdateInfo

        def init_transfer_engine(self, init_info) -> None:
            pass                                    # nothing to join: the tensors are in this process

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload  # optional
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload  # optional
            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info) -> None:
            # vLLM's model classes define load_weights; nn.Module's __getattr__ types it as a tensor
            self.model.load_weights(list(zip(update_info.names, update_info.tensors)))  # type: ignore[operator]

        def shutdown(self) -> None:
            pass

        @staticmethod
        def trainer_send_weights(iterator, trainer_args) -> None:
            raise NotImplementedError("megarl's rollout rank calls update_weights itself (megarl/rollout/vllm/)")

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, InProcessEngine)
    except ValueError:
        pass                                        # an earlier engine of this process registered it


def update_info(named: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """One bucket as the in-process engine's update info (megarl's names and tensors, unchanged)."""
    named = list(named)
    return {"names": [n for n, _ in named], "tensors": [t for _, t in named]}


def sleep_level(expected: Iterable[str], model_tensors: Iterable[str]) -> int:
    """vLLM's level 2 discards the weights (level 1 keeps a host copy), so it is right only when
    the next sync rewrites every weight of the model: each sync must deliver every expected name
    (WeightState refuses the rest) and vLLM's engine takes no delta syncs. A model tensor outside
    the expected names keeps its old value through a sync: level 1 (verl picks levels alike)."""
    return 2 if set(model_tensors) <= set(expected) else 1
