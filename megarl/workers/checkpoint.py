"""Megatron distributed checkpoints of a role: model, optimizer, LR-schedule position.

    engine.save_checkpoint(dir)      # every rank; torch_dist format through megatron.core.dist_checkpointing
    engine.load_checkpoint(dir)      # any (TP, PP): tensors are stored with their global shapes

Called through the engine (megarl/workers/engine.py), whose cpu_compat boundary megatron needs on CPU.

Layout of `dir`: megatron's files (one global tensor per parameter; fused QKV and gate/up are
stored TP-independently by megatron's own sharding rules; transformer layers stacked along a
leading layer axis), plus `hf/` with config.json and the tokenizer files of the source model,
so `checkpoints_tools/megatron_to_hf.py` can write a complete HF directory. The common state
`megarl` records the HF config, head kind, padded vocabulary and scheduler step.
"""
from __future__ import annotations

import json
import os
import queue
import shutil

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megarl.models.converters import checkpoint_mismatch
from megarl.models.hf_checkpoint import AUX_FILES
from megarl.workers.optim import load_optimizer, prime_for_load

try:    # the async writer's module; a megatron-core without it has no helper process to bind
    from megatron.core.dist_checkpointing.strategies import filesystem_async
except ImportError:
    filesystem_async = None

META = "megarl"
HF_DIR = "hf"
# How megatron's distributed optimizer lays out its state in the checkpoint. Its default,
# fully_sharded_model_space, is refused by megatron-core 0.16's own checkpoint validation
# ("ShardedTensor.flattened_range is not supported"); fully_reshardable stores each state tensor in
# the parameter's global shape, so a resume may change TP, PP and DP (as the model part can).
# Plain (non-distributed) optimizers ignore the key.
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class CheckpointMismatch(ValueError):
    """A checkpoint that is whole but not this role's (another head, vocabulary padding, model
    converter such as LoRA, or model): the message names what differs and the fix."""


def read_meta(path: str) -> dict:
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CheckpointMismatch(f"{path}: not a megatron distributed checkpoint (no metadata.json)")
    common = dist_checkpointing.load_common_state_dict(path)
    if META not in common:
        raise CheckpointMismatch(f"{path}: a megatron checkpoint without megarl's metadata; convert it with "
                                 "checkpoints_tools/hf_to_megatron.py")
    return common[META]


def _meta(engine) -> dict:
    spec = engine.spec
    return {"hf_config": spec.hf_config, "head": engine.es.head, "padded_vocab": spec.padded_vocab(engine.layout.tp),
            "sched_step": engine.sched_step, "hf_dtype": str(engine.hf_dtype).replace("torch.", ""),
            "saved_layout": [engine.layout.tp, engine.layout.pp], "saved_cp_vpp": [engine.layout.cp, engine.layout.vpp],
            "converters": engine.converters.options}


def saved_converters(meta: dict) -> dict:
    """The model converters a checkpoint was saved with, name -> options (a checkpoint written
    before they were recorded holds its LoRA settings under "lora")."""
    if "converters" in meta:
        return dict(meta["converters"])
    return {"lora": meta["lora"]} if meta.get("lora") else {}


def save_checkpoint(path: str, engine, with_optimizer: bool = True) -> None:
    engine.onload()
    model_sd = _model_state(engine)
    sd = {**model_sd, META: _meta(engine)}
    if with_optimizer and engine.optimizer is not None:
        sd["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, metadata=OPTIM_METADATA)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    megatron_results_queue_in_process()
    dist_checkpointing.save(sd, path, content_metadata=OPTIM_METADATA)
    if dist.get_rank() == 0:  # after megatron's save, which wants an empty directory
        _write_hf_aux(path, engine)
    dist.barrier()


def load_checkpoint(path: str, engine, with_optimizer: bool = True) -> None:
    meta = read_meta(path)
    if meta["head"] != engine.es.head:
        raise CheckpointMismatch(f"{path}: holds a model with a {meta['head']!r} head; this role needs "
                                 f"{engine.es.head!r}")
    pv = engine.spec.padded_vocab(engine.layout.tp)
    if meta["padded_vocab"] != pv:
        raise CheckpointMismatch(f"{path}: padded vocabulary {meta['padded_vocab']} differs from {pv} at "
                                 f"TP={engine.layout.tp} (saved with a TP that is not a power of two); load it with "
                                 "the TP it was saved with")
    differs = checkpoint_mismatch(saved_converters(meta), engine.converters.options)
    if differs:
        raise CheckpointMismatch(f"{path}: {differs}")
    engine.onload()
    model_sd = _model_state(engine)
    sd = dict(model_sd)
    load_optim = with_optimizer and engine.optimizer is not None and _has_optimizer(path)
    if load_optim:
        prime_for_load(engine.optimizer)
        sd["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIM_METADATA)
    loaded = dist_checkpointing.load(sd, path)
    missing, unexpected = [], []
    for key, model in zip(model_sd, engine.models):
        m, u = model.load_state_dict(loaded[key], strict=False)
        missing += [k for k in m if not k.endswith("_extra_state")]
        unexpected += u
    if missing or unexpected:
        raise CheckpointMismatch(f"{path}: checkpoint does not match the model (missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]})")
    if load_optim:
        load_optimizer(engine.optimizer, loaded["optimizer"])
        engine.update.resume(int(meta["sched_step"]))


def _model_state(engine) -> dict:
    """{"model": ...}, or one entry per virtual-pipeline chunk ("model0", "model1", ... as
    Megatron-LM names them). Tensors are keyed by their global names inside, so a checkpoint
    saved with chunks loads without them and the other way round."""
    if len(engine.models) == 1:
        return {"model": engine.models[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(engine.models)}


def _has_optimizer(path: str) -> bool:
    return any(k.startswith("optimizer.") for k in dist_checkpointing.load_tensors_metadata(path))


def _write_hf_aux(path: str, engine) -> None:
    out = os.path.join(path, HF_DIR)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(engine.spec.hf_config, f, indent=2)
    src = engine.es.model_path
    if src:
        for name in AUX_FILES:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(out, name))


def plain_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint, whole, keyed by megatron's checkpoint key. Needs
    torch.distributed (one process is enough) but no megatron layout. Transformer layers come
    stacked: `decoder.layers.X` has a leading layer axis."""

    meta = dist_checkpointing.load_tensors_metadata(path)
    wanted = {k: v for k, v in meta.items() if not k.startswith("optimizer.")}
    return dict(dist_checkpointing.load(wanted, path, validate_access_integrity=False))


def megatron_results_queue_in_process() -> None:
    """Give megatron's checkpoint writer a queue in this process. megatron-core (0.16,
    dist_checkpointing/strategies/filesystem_async.py) otherwise makes one on a rank's first save
    through a spawned multiprocessing Manager: a process that re-imports the launching module (3-4 s
    of a 2-core machine on every run's first save), and that nothing stops when the rank is killed
    (it lived on, ~275 MB, holding the launcher's output pipe). megarl saves synchronously: the
    writer's results are put and read in the rank's own process (its forked bucket writers report
    through a queue of their own), so a plain queue serves and no helper process exists."""
    fa = filesystem_async
    if fa is None or getattr(fa, "_results_queue", "absent") is not None:   # set already, or a megatron without it
        return
    fa._results_queue = queue.Queue()
