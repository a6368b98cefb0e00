"""The memory plan `megarl-train --check` prints: per rank of each role (actor, critic, reference)
the bytes of its parameters, gradient buffers, optimizer state and activations, the rollout
engine's weights and KV cache, and whether it all fits the device.

    plan = memory_plan(cfg, hf_config)     # config.json + the config; no megatron
    print(plan.render())                   # a line per role and stage, a line per stage's phases, the largest
    plan.check_fits()                      # ConfigError: the largest term and a fix

The bytes come from megarl/launcher/memory_terms.py. The device's memory comes from torch.cuda, or,
on a machine without a GPU (a login node), from MEGARL_DEVICE_MEMORY_GB; without either there is
no fit verdict, and the plan says so.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from megarl.config.errors import ConfigError
from megarl.launcher.memory_terms import Layout, Static, activation_bytes, logits_bytes, static_bytes
from megarl.models.convert import hf_shapes
from megarl.models.hf_config import with_overrides
from megarl.models.spec import ModelSpec
from megarl.workers.config import MegatronConfig, recompute_overrides

GIB = 2**30
DEVICE_MEMORY_ENV = "MEGARL_DEVICE_MEMORY_GB"   # the device's memory where --check sees no GPU (a login node)


@dataclass
class RoleRow:
    role: str
    stage: str
    static: Static
    activations: int = 0
    logits: int = 0                # the last stage's LM head and loss (memory_terms.logits_bytes)
    offloaded: int = 0             # bytes the role moves to host memory while the engine runs
    note: str = ""


@dataclass
class Plan:
    """Per pipeline stage, each role's bytes; the engine's weights and KV cache on a rollout rank.
    megarl's engines read gpu_memory_utilization as verl does: everything on the device while the
    engine runs (the trainer's kept state, the engine's weights, its KV cache) stays within that
    fraction of the device (megarl/rollout/trtllm/resources.py, native/engine.py)."""
    rows: list[RoleRow] = field(default_factory=list)
    engine_weights: int = 0
    kv_token_bytes: int = 0        # K and V of one token, all layers, one rollout TP rank
    seq_tokens: int = 0            # one sequence: prompt + response
    utilization: float = 0.5
    colocated: bool = True
    device_bytes: int | None = None
    device_source: str = ""

    def _stages(self) -> dict[str, list[RoleRow]]:
        out: dict[str, list[RoleRow]] = {}
        for r in self.rows:
            out.setdefault(r.stage, []).append(r)
        return out

    def train_terms(self, rows: list[RoleRow]) -> dict[str, int]:
        terms = {f"{r.role} {k}": getattr(r.static, k) for r in rows for k in ("params", "grads", "optimizer")}
        act = max(rows, key=lambda r: r.activations + r.logits)
        terms[f"{act.role} activations"] = act.activations      # one role trains at a time
        terms[f"{act.role} logits"] = act.logits
        return {k: v for k, v in terms.items() if v}

    def kept(self, rows: list[RoleRow]) -> int:
        return sum(r.static.total - r.offloaded for r in rows) if self.colocated else 0

    def kv_bytes(self, rows: list[RoleRow]) -> int | None:
        if not self.device_bytes:
            return None
        return int(self.utilization * self.device_bytes) - self.kept(rows) - self.engine_weights

    def render(self) -> str:
        def g(b: float) -> str:
            return f"{b / GIB:.2f} GiB" if b >= GIB / 10 or not b else f"{b / 2**20:.1f} MiB"
        lines = [f"megarl: memory plan per rank (device: {self.device_source})"]
        for r in self.rows:
            s = r.static
            lines.append(f"  {r.role:<7} {r.stage:<10} params {g(s.params)}  grads {g(s.grads)}  optimizer "
                         f"{g(s.optimizer)}  activations {g(r.activations)}"
                         + (f"  logits {g(r.logits)}" if r.logits else "") + (f"  ({r.note})" if r.note else ""))
        stages = self._stages()
        for stage, rows in stages.items():
            need = sum(self.train_terms(rows).values())
            fit = ""
            if self.device_bytes:
                spare = self.device_bytes - need
                fit = f": fits, {g(spare)} to spare" if spare >= 0 else f": does NOT fit, {g(-spare)} over"
            line = f"  {stage}: training {g(need)}{fit}; rollout: engine weights {g(self.engine_weights)}"
            kv = self.kv_bytes(rows)
            if kv is not None:
                line += (f", KV cache {g(max(kv, 0))} ({max(kv, 0) // max(self.kv_token_bytes, 1)} tokens; one "
                         f"sequence is {self.seq_tokens}), trainer kept {g(self.kept(rows))}")
            lines.append(line)
        if len(stages) > 1:
            stage, need = self.largest()
            lines.append(f"  largest: {stage}, training {g(need)}")
        if not self.device_bytes and not self.device_source.startswith("cpu"):
            lines.append(f"  no fit verdict: this machine has no GPU; {DEVICE_MEMORY_ENV}=<GiB per device> gives one")
        return "\n".join(lines)

    def largest(self) -> tuple[str, int]:
        """The stage whose training needs the most bytes, and those bytes."""
        return max(((stage, sum(self.train_terms(rows).values())) for stage, rows in self._stages().items()),
                   key=lambda sn: sn[1])

    def check_fits(self) -> None:
        """ConfigError, one line, for a stage that cannot hold its training state or leaves the
        engine no KV cache for one sequence."""
        if not self.device_bytes:
            return
        for stage, rows in self._stages().items():
            terms = self.train_terms(rows)
            need = sum(terms.values())
            if need > self.device_bytes:
                term, size = max(terms.items(), key=lambda kv: kv[1])
                raise ConfigError(f"training on {stage} needs {need / GIB:.1f} GiB per rank, over the device's "
                                  f"{self.device_bytes / GIB:.1f} GiB; the largest term is {term} "
                                  f"({size / GIB:.1f} GiB): {_fix(term)}", "memory plan")
            kv = self.kv_bytes(rows) or 0
            if kv < self.seq_tokens * self.kv_token_bytes:
                raise ConfigError(
                    f"the rollout engine gets {max(kv, 0) / GIB:.2f} GiB of KV cache on {stage}, less than one "
                    f"{self.seq_tokens}-token sequence: gpu_memory_utilization={self.utilization:g} of "
                    f"{self.device_bytes / GIB:.1f} GiB minus its weights ({self.engine_weights / GIB:.1f} GiB) and "
                    f"the trainer state kept on the device ({self.kept(rows) / GIB:.1f} GiB); raise "
                    "actor_rollout_ref.rollout.gpu_memory_utilization, raise rollout TP, or offload the trainer "
                    "(<role>.megatron.param_offload / grad_offload / optimizer_offload)", "memory plan")


def _fix(term: str) -> str:
    if "logits" in term:
        return ("lower ppo_micro_batch_size_per_gpu (or ppo_max_token_len_per_gpu), or raise TP (the LM head's "
                "vocabulary rows split over it)")
    if "activations" in term:
        return ("turn on recompute (actor_rollout_ref.model.enable_gradient_checkpointing=true), lower "
                "ppo_micro_batch_size_per_gpu (or ppo_max_token_len_per_gpu), or raise TP / CP")
    if "optimizer" in term:
        return "use the distributed optimizer over more DP ranks (megatron.use_distributed_optimizer), or raise TP / PP"
    return "raise TP / PP (megatron.tensor_model_parallel_size / pipeline_model_parallel_size)"


# -- from the config -------------------------------------------------------------------------------------
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}


def device_memory(cfg) -> tuple[str, int | None, str]:
    """(plan device, its bytes or None, where the number comes from). torch is imported only when
    the config may use a GPU."""
    if cfg.trainer.device == "cpu":
        return "cpu", None, "cpu: host memory, no fit verdict"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return "cuda", props.total_memory, f"{props.name}, {props.total_memory / GIB:.1f} GiB from torch.cuda"
    given = os.environ.get(DEVICE_MEMORY_ENV)
    if given:
        try:
            gb = float(given)
        except ValueError:
            raise ConfigError(f"{DEVICE_MEMORY_ENV}={given!r} is not a number; give the GiB of one device, e.g. 80",
                              DEVICE_MEMORY_ENV) from None
        return "cuda", int(gb * GIB), f"{gb:g} GiB from {DEVICE_MEMORY_ENV}"
    if cfg.trainer.device == "cuda":
        return "cuda", None, "no GPU visible"
    return "cpu", None, "trainer.device=auto and no GPU visible: planned as a CPU run"


def _role_layout(cfg, mc, dtype: str, gpu: bool, recompute: str | None) -> Layout:
    dp = cfg.data_parallel_size(mc)
    dist = mc.use_distributed_optimizer if mc.use_distributed_optimizer is not None else gpu
    pbytes = (2 if gpu else 4) if dtype == "auto" else _DTYPE_BYTES[dtype]
    return Layout(tp=mc.tensor_model_parallel_size, pp=mc.pipeline_model_parallel_size,
                  vpp=mc.virtual_pipeline_model_parallel_size or 1, ep=mc.expert_model_parallel_size,
                  cp=mc.context_parallel_size, dp=dp, sequence_parallel=mc.sequence_parallel_on,
                  distributed_optimizer=dist, param_bytes=pbytes, host_step=not gpu, recompute=recompute)


def _recompute(model, mc) -> str | None:
    over = {**recompute_overrides(model.gradient_checkpointing_kwargs), **mc.override_transformer_config}
    return over.get("recompute_granularity") or ("full" if model.enable_gradient_checkpointing else None)


def _logprob_temperature(ro) -> float:
    """The temperature the trainer scores log-probs at (megarl/rollout/base.py:SamplingParams): 1 when greedy."""
    return 1.0 if not ro.do_sample or ro.temperature == 0 else ro.temperature


def _offloaded(mc, static: Static, gpu: bool) -> int:
    if not gpu or mc is None:
        return 0
    return (static.params * mc.param_offload + static.grads * mc.grad_offload
            + static.optimizer * mc.optimizer_offload)


def memory_plan(cfg, hf_config: dict, critic_hf: dict | None = None) -> Plan:
    """The plan for `cfg` with the actor's config.json (`critic_hf`: the critic's, when it loads its own)."""
    device, total, source = device_memory(cfg)
    gpu = device == "cuda"
    spec = ModelSpec.from_hf_config(with_overrides(hf_config, dict(cfg.model.override_config)))
    data, actor, ro = cfg.data, cfg.actor, cfg.rollout
    seq = data.max_prompt_length + data.max_response_length
    plan = Plan(seq_tokens=seq, utilization=ro.gpu_memory_utilization, colocated=ro.placement != "disaggregated",
                device_bytes=total, device_source=source)
    roles = [("actor", actor.megatron, actor.dtype, spec, "lm", True, actor)]
    if cfg.critic.enable:
        cspec = spec if critic_hf is None else ModelSpec.from_hf_config(critic_hf)
        roles.append(("critic", cfg.critic.megatron, actor.dtype, cspec, "value", True, cfg.critic))
    # A model converter (LoRA) freezes the base and trains what it adds: the plan holds the base's
    # weights and says that the added parameters' bytes are not in it.
    converted = sorted(cfg.model.converter_options())
    if (actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not cfg.model.reference_is_base:
        ref = cfg.actor_rollout_ref.ref
        roles.append(("ref", ref.megatron or actor.megatron, actor.dtype, spec, "lm", False, None))
    for role, mc, dtype, rspec, head, trainable, rcfg in roles:
        mc = mc or MegatronConfig()
        lay = _role_layout(cfg, mc, dtype, gpu, _recompute(cfg.model, mc) if trainable else None)
        micro_rows = (rcfg.ppo_micro_batch_size_per_gpu or 1) if rcfg is not None else 0
        # the critic's null batching keys mean the actor's (ExperimentConfig fills only some of them)
        dynamic = rcfg is not None and bool(actor.use_dynamic_bsz if rcfg.use_dynamic_bsz is None
                                            else rcfg.use_dynamic_bsz)
        budget = (rcfg.ppo_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu) if rcfg is not None else 0
        tokens = (budget if dynamic else micro_rows * seq) if rcfg is not None else 0
        mini_rows = (rcfg.ppo_mini_batch_size or 1) * ro.n // max(lay.dp, 1) if rcfg is not None else 0
        n_micro = max(1, -(-mini_rows // max(micro_rows, 1)))
        scored = tokens * data.max_response_length // seq     # full-length rows: each scores its response
        for pp_rank in range(lay.pp):
            base_only = role == "actor" and bool(converted)
            static = static_bytes(rspec, lay, pp_rank, head, trainable and not base_only)
            act = activation_bytes(rspec, lay, tokens, n_micro, lay.param_bytes, pp_rank) if trainable else 0
            last_lm = trainable and head == "lm" and pp_rank == lay.pp - 1 and scored > 0
            logits = logits_bytes(rspec, lay, scored, lay.param_bytes, _logprob_temperature(ro),
                                  actor.entropy_coeff != 0) if last_lm else 0
            offl = _offloaded(mc, static, gpu)
            if role == "ref" and gpu and cfg.actor_rollout_ref.ref.param_offload:
                offl = static.params
            note = ", ".join(filter(None, [
                f"{'/'.join(converted)}: the base's weights; what it adds is not planned" if base_only else "",
                f"DP {lay.dp}" + (" distributed optimizer" if lay.distributed_optimizer and trainable else ""),
                f"recompute {lay.recompute}" if lay.recompute else "",
                (f"{tokens}-token micro-batches" if act else "")]))
            plan.rows.append(RoleRow(role, f"pp stage {pp_rank}", static, act, logits, offl, note))
    rtp = ro.tensor_model_parallel_size
    ebytes = (2 if gpu else 4) if ro.dtype == "auto" else _DTYPE_BYTES.get(ro.dtype, 2)
    plan.engine_weights = sum(math.prod(s) for s in hf_shapes(spec, "lm").values()) * ebytes // rtp
    kv_heads = max(1, spec.num_kv_heads // rtp)          # fewer KV heads than ranks: each rank holds one
    plan.kv_token_bytes = 2 * spec.num_layers * kv_heads * spec.head_dim * ebytes
    return plan
