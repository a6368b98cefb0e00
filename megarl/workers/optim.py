"""Optimizer and learning-rate schedule for the trainable roles.

    opt = build_optimizer(model_chunks, optim_cfg, dtype)   # megatron's on CUDA, CPUAdamW on CPU
    applied, grad_norm = optimizer_step(opt, clip_grad, bad_loss)
    apply_schedule(opt, step, optim_cfg)

On CUDA megatron's own optimizer runs (bf16 params with fp32 master weights, optionally the
distributed optimizer). Its grad clipping asserts CUDA tensors, so on CPU `CPUAdamW` runs
torch's AdamW over DDP's fp32 `main_grad` with the same grouping (no weight decay on biases and
norms), the same grad-norm rule (shared and TP-duplicate parameters counted once) and the
same sharded-checkpoint format.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from megarl.config.errors import ConfigError
from megarl.workers.config import OptimConfig


# -- learning-rate schedule (pure) -------------------------------------------------------------------
def schedule_steps(cfg: OptimConfig) -> tuple[int, int]:
    """(warm-up steps, decay steps) with the config's fallbacks resolved; refuses a decaying
    schedule whose length is unknown."""
    total = cfg.total_training_steps
    warmup = cfg.lr_warmup_steps if cfg.lr_warmup_steps >= 0 else int(cfg.lr_warmup_steps_ratio * max(total, 0))
    decay = cfg.lr_decay_steps if cfg.lr_decay_steps is not None else total
    if cfg.lr_decay_style != "constant" and (decay is None or decay <= 0):
        raise ConfigError(f"lr_decay_style={cfg.lr_decay_style} needs a schedule length; set optim.lr_decay_steps "
                          "or trainer.total_training_steps", "optim.lr_decay_steps")
    if cfg.lr_warmup_steps < 0 and cfg.lr_warmup_steps_ratio > 0 and total <= 0:
        raise ConfigError("lr_warmup_steps_ratio needs trainer.total_training_steps; set optim.lr_warmup_steps instead",
                          "optim.lr_warmup_steps_ratio")
    return warmup, max(decay or 0, 0)


def lr_at(step: int, cfg: OptimConfig) -> float:
    """LR for the `step`-th scheduler step (0-based): linear warm-up from 0 (verl's and megatron's
    convention, so the first warm-up step has LR 0), then constant, linear or cosine decay to
    min_lr at `decay` steps, min_lr after."""
    warmup, decay = schedule_steps(cfg)
    if warmup > 0 and step < warmup:
        return cfg.lr * step / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    if step >= decay:
        return cfg.min_lr
    ratio = (step - warmup) / max(decay - warmup, 1)
    coeff = 1.0 - ratio if cfg.lr_decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def apply_schedule(optimizer, step: int, cfg: OptimConfig) -> float:
    """Set every param group's LR for scheduler step `step`, and its weight decay (megatron's groups
    carry `wd_mult`: 0 for biases and norms; it expects its scheduler to apply it). Returns the LR."""
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 1.0)
    return lr


# -- optimizers ----------------------------------------------------------------------------------------
def _counts_in_norm(p: torch.nn.Parameter) -> bool:
    """A parameter's gradient enters the norm once: shared copies (a tied embedding's last-stage
    twin) and TP replicas (norms, a value head) only on TP rank 0."""
    if getattr(p, "shared", False):
        return False
    return getattr(p, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_rank() == 0


class CPUAdamW:
    """torch AdamW over megatron DDP's `main_grad`, shaped like megatron's optimizer."""

    def __init__(self, chunks: list[torch.nn.Module], cfg: OptimConfig):
        decay, no_decay = [], []
        for chunk in chunks:
            for p in chunk.parameters():
                if p.requires_grad:
                    (no_decay if p.dim() == 1 else decay).append(p)
        groups = [{"params": decay, "weight_decay": cfg.weight_decay, "wd_mult": 1.0},
                  {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
        self.params = decay + no_decay
        self._norm_parts: tuple[list, list] | None = None
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas),
                                           eps=cfg.eps, weight_decay=cfg.weight_decay,
                                           foreach=False)  # the foreach kernels slow this CPU down

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def prepare_grads(self) -> bool:
        for p in self.params:
            p.grad = p.main_grad  # a view of DDP's grad buffer: no copy
        return False

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """The global L2 norm of the gradients, accumulated in float64. One vector_norm per
        parameter reads the fp32 gradient once; a float64 copy of every gradient cost more than
        the AdamW step (benchmarks/update_profile.py)."""
        if self._norm_parts is None:    # parallel state is fixed once the model is built
            self._norm_parts = ([p for p in self.params if _counts_in_norm(p) and getattr(p, "allreduce", True)],
                                [p for p in self.params if _counts_in_norm(p) and not getattr(p, "allreduce", True)])
        sq = torch.zeros(2, dtype=torch.float64)   # [dense, MoE experts]: experts differ over the EP ranks too
        for i, part in enumerate(self._norm_parts):
            for p in part:
                sq[i] += torch.linalg.vector_norm(p.main_grad, dtype=torch.float64).square()
        if ps.get_expert_model_parallel_world_size() > 1:
            dist.all_reduce(sq[:1], group=ps.get_model_parallel_group())
            dist.all_reduce(sq[1:], group=ps.get_expert_tensor_model_pipeline_parallel_group())
        else:   # both over the model-parallel group: one collective
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        return float(sq.sum().sqrt())

    @torch.no_grad()
    def clip(self, grad_norm: float, max_norm: float) -> None:
        scale = max_norm / (grad_norm + 1e-6)
        if scale < 1.0:
            for p in self.params:
                p.main_grad.mul_(scale)

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    # -- checkpoints (megatron's format: per-parameter states sharded like the parameter) -------
    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None):
        """megatron's signature; `metadata` picks the distributed optimizer's layout, which this one has not."""
        if is_loading:
            self._init_state()
        state = self.optimizer.state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict,
                                                   (p for g in self.optimizer.param_groups for p in g["params"]))
        step = next((s["step"] for s in state["state"].values() if "step" in s), torch.tensor(0.0))
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        return {"optimizer": state, "common_step": step.clone() if torch.is_tensor(step) else step}

    def load_state_dict(self, sharded: dict) -> None:
        state = sharded["optimizer"]
        for s in state["state"].values():
            s["step"] = torch.as_tensor(sharded["common_step"], dtype=torch.float32).clone()
        self.optimizer.load_state_dict(state)

    def _init_state(self) -> None:
        init_adam_state(self.optimizer)


def init_adam_state(opt: torch.optim.Optimizer) -> None:
    """Give every parameter of a fresh torch Adam/AdamW the state its first step would create
    (step 0, zero moments), so a checkpoint has tensors to load into."""
    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if g.get("amsgrad"):
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def prime_for_load(opt) -> None:
    """Before loading a checkpoint into megatron's optimizer. Without Transformer Engine or Apex,
    megatron-core (0.16) runs torch's Adam and reads `step` from every parameter's state in
    DistributedOptimizer.state_dict(), which sharded_state_dict(is_loading=True) calls first: a
    fresh optimizer (a resume) has none and fails a bare assert. Fused optimizers keep their step
    in the param groups and need nothing."""
    for part in _megatron_parts(opt):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) and not inner.state:
            init_adam_state(inner)


def load_optimizer(opt, state) -> None:
    """Load a checkpoint's optimizer state (what dist_checkpointing.load returned for
    `opt.sharded_state_dict(..., is_loading=True)`) into `opt`.

    megatron-core 0.16's DistributedOptimizer cannot load its own `fully_reshardable` state into
    torch's Adam (no Transformer Engine or Apex): it gives every parameter's state a `step`
    from the param groups, then copies each state tensor from the loaded ones, which carry no
    `step` (`_set_main_param_and_optimizer_states`: KeyError 'step'). So the groups load first,
    the per-parameter `step`s step aside while the tensors load, and come back after, each its own
    tensor: megatron hands every parameter one shared `step`, which torch's Adam would then advance
    once per parameter per update (a wrong bias correction from the first step after a resume)."""
    if isinstance(opt, CPUAdamW):
        opt.load_state_dict(state)
        return
    parts = _megatron_parts(opt)
    states = [state] if len(parts) == 1 else [state[k] for k in sorted(state)]
    for part, st in zip(parts, states):
        inner = getattr(part, "optimizer", None)
        if not (isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
                and st.get("param_state_sharding_type") == "fully_reshardable"):
            part.load_state_dict(st)
            continue
        part.load_state_dict({k: v for k, v in st.items() if k not in ("param_state", "param_state_sharding_type")})
        steps = {p: s.pop("step") for p, s in inner.state.items() if "step" in s}
        try:
            part.load_parameter_state_from_fully_reshardable(st["param_state"])
        finally:
            for p, step in steps.items():
                inner.state[p]["step"] = step.detach().clone()
    if len(parts) > 1:
        opt._synchronize_steps()


def build_optimizer(chunks: list[torch.nn.Module], cfg: OptimConfig, dtype: torch.dtype,
                    use_distributed_optimizer: bool = False):
    if not torch.cuda.is_available():
        if use_distributed_optimizer:
            raise ConfigError("the distributed optimizer needs CUDA; set megatron.use_distributed_optimizer=false "
                              "on CPU",
                              "megatron.use_distributed_optimizer")
        return CPUAdamW(chunks, cfg)
    ocfg = OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
                           adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.eps,
                           clip_grad=cfg.clip_grad, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                           params_dtype=dtype, use_distributed_optimizer=use_distributed_optimizer,
                           decoupled_weight_decay=True)
    return get_megatron_optimizer(ocfg, chunks)


def _megatron_parts(opt) -> list:
    return list(getattr(opt, "chained_optimizers", [opt]))


def optimizer_step(opt, max_norm: float, bad_loss: bool = False) -> tuple[bool, float]:
    """Clip and apply the accumulated gradients unless the loss or the grad norm is NaN/inf.
    Returns (applied, grad norm). Every rank reaches the same decision: the norm is reduced over
    the model-parallel group after DP reduction, and `bad_loss` is already agreed on."""
    found_inf = opt.prepare_grads()
    norm = float("nan") if found_inf else float(opt.get_grad_norm())
    if bad_loss or not math.isfinite(norm):
        opt.zero_grad()
        return False, norm
    if isinstance(opt, CPUAdamW):
        opt.clip(norm, max_norm)
    else:
        for part in _megatron_parts(opt):
            params = part.get_parameters()
            if params and not getattr(part, "is_stub_optimizer", False):
                clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=norm)
    opt.step_with_ready_grads()
    opt.zero_grad()
    return True, norm
