"""Everything decided before a rank allocates memory: the role's model, checkpoint and layout.

    spec, ckpt, hf_dtype = read_spec(EngineSpec(path, tp=2, pp=2))   # ValueError naming the problem

Only headers and config.json are read, and megatron is not imported, so tools and workers refuse
bad input in a second, on every rank alike (no rank is left waiting in a collective).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from megarl.config.dtypes import NAMES, canonical
from megarl.config.errors import ConfigError
from megarl.models.hf_checkpoint import HFCheckpoint
from megarl.models.hf_config import with_overrides
from megarl.models.spec import ModelSpec, check_layout
from megarl.workers.checkpoint import read_meta
from megarl.workers.config import OptimConfig


@dataclass
class EngineSpec:
    model_path: str | None                  # HF directory (None when loading a dist checkpoint)
    tp: int = 1
    pp: int = 1
    ep: int = 1                             # expert parallel (MoE models)
    etp: int | None = None                  # expert tensor parallel (None: TP, the only value megarl takes)
    head: str = "lm"                        # "lm" or "value"
    head_from_checkpoint: bool = False      # value head: read `score.weight` (else zeros)
    trainable: bool = True
    optim: OptimConfig | None = None
    dtype: str = "auto"                     # auto: bf16 on CUDA, fp32 on CPU
    override_config: dict = field(default_factory=dict)
    dist_checkpoint: str | None = None      # load weights from a megatron distributed checkpoint
    use_distributed_optimizer: bool = False
    sequence_parallel: bool = False
    cp: int = 1                             # context parallel size
    vpp: int | None = None                  # virtual pipeline chunks per stage (None: 1)
    recompute: bool = False
    routing_replay: bool = False            # MoE: routers built with megatron's RouterReplay (router_replay.mode)
    packing: bool = True                    # THD-packed micro-batches (model.use_remove_padding)
    transformer_overrides: dict = field(default_factory=dict)
    ddp_overrides: dict = field(default_factory=dict)  # megatron DDP options (<role>.megatron.override_ddp_config)
    converters: list | dict = field(default_factory=list)  # model converters, by name (megarl/models/converters.py)
    seed: int = 42
    role: str = "actor"


def resolve_dtype(name: str, trainable: bool) -> torch.dtype:
    cuda = torch.cuda.is_available()
    if name == "auto":
        return torch.bfloat16 if cuda else torch.float32
    if canonical(name) is None:
        raise ConfigError(f"dtype={name!r}: use auto, {NAMES}", "dtype")
    dtype = getattr(torch, canonical(name))
    if not cuda and dtype != torch.float32:
        raise ConfigError(f"dtype={name} needs CUDA (megatron's mixed-precision optimizer); use float32 or auto on CPU",
                          "dtype")
    return dtype


def read_spec(es: EngineSpec) -> tuple[ModelSpec, HFCheckpoint | None, torch.dtype]:
    """The model's spec and its checkpoint, checked against the layout and (headers only) the
    tensors, before anything is allocated. Every rank runs this and fails the same way."""
    if es.dist_checkpoint:
        meta = read_meta(es.dist_checkpoint)
        spec = ModelSpec.from_hf_config(with_overrides(meta["hf_config"], es.override_config))
        ckpt, hf_dtype = None, getattr(torch, meta["hf_dtype"])
    else:
        ckpt = HFCheckpoint(es.model_path)
        spec = ModelSpec.from_hf_config(with_overrides(ckpt.config, es.override_config))
        if es.head == "value" and es.head_from_checkpoint and spec.head != "score":
            fix = ("give reward_model.model.path a reward model" if es.role == "reward_model"
                   else "use critic.model.init_from=actor")
            raise ValueError(f"{es.model_path}: the {es.role} needs a `score` head from this checkpoint "
                             f"(a *ForSequenceClassification model); {spec.architecture} has none: {fix}")
        if es.head == "value" and es.head_from_checkpoint and spec.num_labels != 1:
            raise ValueError(f"{es.model_path}: score head has {spec.num_labels} labels; a value head needs 1")
        if es.head == "lm" and spec.head != "lm":
            raise ValueError(f"{es.model_path}: {spec.architecture} has no LM head; the actor and reference need "
                             "a *ForCausalLM checkpoint")
        # The backbone always; the LM head for lm roles; `score.weight` only when the value head loads it.
        need = "lm" if es.head == "lm" else ("value" if es.head_from_checkpoint else "none")
        ckpt.validate(spec, head=need)
        hf_dtype = ckpt.dtype("model.embed_tokens.weight")
    world = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else None
    check_layout(spec, es.tp, es.pp, es.ep, world=world)
    check_chunks(spec, es.pp, es.vpp, es.role)
    return spec, ckpt, hf_dtype


def check_chunks(spec: ModelSpec, pp: int, vpp: int | None, role: str = "actor_rollout_ref.actor") -> None:
    """Virtual pipeline: every chunk holds the same number of layers."""
    if vpp and vpp > 1 and spec.num_layers % (pp * vpp):
        fits = [v for v in range(2, spec.num_layers // pp + 1) if spec.num_layers % (pp * v) == 0]
        raise ConfigError(f"the model's {spec.num_layers} layers do not split into PP {pp} x VPP {vpp} equal "
                          f"chunks; pick a VPP with PP x VPP dividing {spec.num_layers} "
                          f"({'e.g. ' + str(fits[0]) if fits else 'here: null'})",
                          f"{role}.megatron.virtual_pipeline_model_parallel_size")


