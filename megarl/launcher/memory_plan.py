"""The memory plan `megarl-train --check` prints: per rank of each role, the bytes its state and
activations take, against the device's memory.

    plan = memory_plan(cfg, hf_config, device_bytes)   # config.json + the config; no torch, no megatron
    print(plan.render())                               # one line per role and stage, one per phase
    plan.check_fits()                                  # ConfigError: the largest term and a fix

Static parts (parameters, gradient buffers, optimizer state) follow megatron-core 0.16's layout as
megarl builds it (megarl/workers/shards.py, optim.py): DDP's grad buffer in fp32
(grad_reduce_in_fp32), one bucket per buffer (overlap_grad_reduce off), and with the distributed
optimizer the buffers padded as `_ParamAndGradBuffer` pads them (each parameter starts at a
multiple of 64 elements, each bucket ends at a multiple of lcm(DP, 128), the shared embedding in a
bucket of its own) with a param buffer in the weights' dtype, while the fp32 master weights and
Adam's two moments cover only this DP rank's slice of each bucket. tests/test_memory_plan_exact.py
checks these numbers against the tensors a built model and optimizer hold.

Activations are an estimate (`activation_bytes`); the engine's share is verl's
gpu_memory_utilization of the device, its weights included.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from megarl.config.errors import ConfigError
from megarl.models.convert import EMBED, OUTPUT, megatron_names, shard_shape
from megarl.models.hf_config import with_overrides
from megarl.models.spec import ModelSpec, stage_layers

GIB = 2**30
DEVICE_MEMORY_ENV = "MEGARL_DEVICE_MEMORY_GB"   # the device's memory where --check sees no GPU (a login node)

# megatron registers a layer's parameters in module order: the attention's output projection
# (built by Attention) before the fused QKV and the q/k norms (built by SelfAttention).
_LAYER_ORDER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.weight",
                "self_attention.linear_qkv.bias", "self_attention.q_layernorm.", "self_attention.k_layernorm.",
                "pre_mlp_layernorm.", "mlp.")


def _module_rank(name: str) -> int:
    rest = name.split(".", 3)[3] if name.startswith("decoder.layers.") else ""
    return next((i for i, p in enumerate(_LAYER_ORDER) if rest.startswith(p)), len(_LAYER_ORDER))


@dataclass(frozen=True)
class Layout:
    """One role's parallel layout and numeric choices, as megarl/workers/actor.py:engine_spec builds them."""
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    param_bytes: int = 2              # bf16 on CUDA; fp32 (4) on CPU
    host_step: bool = False           # torch's Adam keeps a 0-d `step` per parameter on the host (CPU runs)
    recompute: str | None = None      # None, "full" or "selective"


@dataclass
class Static:
    params: int = 0
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


# -- parameters of one pipeline stage -------------------------------------------------------------------
def stage_parameters(spec: ModelSpec, lay: Layout, pp_rank: int, head: str = "lm",
                     ep_rank: int = 0) -> list[list[tuple[str, int, bool, bool]]]:
    """Per virtual-pipeline chunk of stage `pp_rank`: (global name, elements on this TP rank, expert
    (a separate buffer when EP > 1), shared embedding (a bucket of its own)), in megatron's order."""
    per_chunk = spec.num_layers // (lay.pp * lay.vpp)
    layers = stage_layers(spec, pp_rank, lay.pp, lay.vpp)
    per_ep = spec.num_experts // lay.ep if spec.num_experts else 0
    experts = range(ep_rank * per_ep, (ep_rank + 1) * per_ep) if spec.num_experts else None
    tied = head == "lm" and spec.tie_word_embeddings and lay.pp > 1
    out = []
    for v in range(lay.vpp):
        first, last = pp_rank == 0 and v == 0, pp_rank == lay.pp - 1 and v == lay.vpp - 1
        chunk_layers = layers[v * per_chunk:(v + 1) * per_chunk]
        names = megatron_names(spec, range(chunk_layers[0], chunk_layers[-1] + 1) if chunk_layers else range(0),
                               first, last, head, experts)
        body = sorted((n for n in names if n.startswith("decoder.layers.")),
                      key=lambda n: (int(n.split(".")[2]), _module_rank(n)))
        ordered = [n for n in names if n == EMBED] + body + [n for n in names if n not in body and n != EMBED]
        rows = []
        for n in ordered:
            numel = math.prod(shard_shape(n, spec, lay.tp, head))
            expert = lay.ep > 1 and ".mlp.experts." in n
            rows.append((n, numel, expert, tied and n in (EMBED, OUTPUT)))
        out.append(rows)
    return out


def buffer_layout(params: list[tuple[int, bool]], dp: int, distributed: bool) -> tuple[int, list, list]:
    """megatron's _ParamAndGradBuffer with no bucket size (megarl reduces gradients after the
    backward): `params` (elements, own bucket) in registration order -> (buffer elements,
    buckets [(start, end)], parameter ranges [(start, end)] in the same order)."""
    def pad(n: int, d: int) -> int:
        return -(-n // d) * d
    bucket_div = math.lcm(dp, 128)
    start = bucket_start = 0
    buckets, in_bucket, ranges = [], 0, [None] * len(params)
    for i in range(len(params) - 1, -1, -1):          # megatron walks the parameters backwards
        numel, own = params[i]
        if distributed:
            start = pad(start, 64)
        if own and distributed and in_bucket:
            end = pad(start, bucket_div)
            buckets.append((bucket_start, end))
            start = bucket_start = end
            in_bucket = 0
        ranges[i] = (start, start + numel)
        in_bucket += 1
        if own and distributed:
            end = pad(start + numel, bucket_div)
            buckets.append((bucket_start, end))
            start = bucket_start = end
            in_bucket = 0
        else:
            start += numel
    if in_bucket:
        end = pad(start, bucket_div) if distributed else start
        buckets.append((bucket_start, end))
        start = end
    return (buckets[-1][1] if buckets else 0), buckets, ranges


def _optimizer_elements(ranges: list, buckets: list, dp: int) -> int:
    """The most parameter elements any DP rank's slice of the buckets covers (the distributed
    optimizer keeps master weights and moments for those only, padding excluded)."""
    best = 0
    for r in range(dp):
        got = 0
        for b0, b1 in buckets:
            lo, hi = b0 + (b1 - b0) // dp * r, b0 + (b1 - b0) // dp * (r + 1)
            got += sum(max(0, min(hi, e) - max(lo, s)) for s, e in ranges if b0 <= s < b1)
        best = max(best, got)
    return best


def static_bytes(spec: ModelSpec, lay: Layout, pp_rank: int, head: str = "lm", trainable: bool = True) -> Static:
    """Parameters, gradient buffers and optimizer state of one rank of stage `pp_rank` (its largest
    DP slice with the distributed optimizer)."""
    out = Static()
    moments = 8 + (4 if lay.param_bytes != 4 else 0)   # Adam's two fp32 moments (+ fp32 masters below fp32)
    world = lay.dp * lay.tp * lay.pp * lay.cp
    for chunk in stage_parameters(spec, lay, pp_rank, head):
        n_tensors = len(chunk)
        if not trainable:
            out.params += sum(n for _, n, _, _ in chunk) * lay.param_bytes
            continue
        for expert in (False, True):
            group = [(n, own) for _, n, e, own in chunk if e == expert]
            if not group:
                continue
            dp = world // (lay.pp * lay.ep * lay.tp) if expert else lay.dp * lay.cp
            numel, buckets, ranges = buffer_layout(group, dp, lay.distributed_optimizer)
            out.grads += numel * 4                                  # grad_reduce_in_fp32
            if lay.distributed_optimizer:
                out.params += numel * lay.param_bytes               # params become views of this buffer
                out.optimizer += _optimizer_elements(ranges, buckets, dp) * moments
            else:
                real = sum(n for n, _ in group)
                out.params += real * lay.param_bytes
                out.optimizer += real * moments
        if lay.host_step:
            out.optimizer += 4 * n_tensors
    return out


# -- activations ---------------------------------------------------------------------------------------
def activation_bytes(spec: ModelSpec, lay: Layout, tokens: int, micro_batches: int, act_bytes: int = 2) -> int:
    """Activations stored for the backward on pipeline stage 0 (the stage that holds the most),
    for micro-batches of `tokens` tokens. Per layer, the tensors Korthikanti et al. 2022 ("Reducing
    Activation Recomputation in Large Transformer Models", section 4.1) count, for megarl's layers:
    RMSNorm inputs 2*2sh, QKV input 2sh, Q/K/V 2s(h+2*kv*hn), the attention output 2sh (flash
    attention stores no s x s scores: their 5as^2 term is gone), fc1 input 2sh, SwiGLU's fc1 output
    4sf and product 2sf; no dropout masks (dropout 0). Sequence parallelism divides all of it by TP
    (without it the norm and linear inputs, 8sh, are whole on every TP rank); full recompute keeps
    only each layer's input (2sh) plus one layer's full set. 1F1B keeps min(PP, micro-batches)
    micro-batches in flight on stage 0, times 1 + (PP-1)/(PP*VPP) when interleaved (section 4.2.3)."""
    s = tokens / lay.cp
    h, kvd = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    f = (spec.moe_ffn_hidden_size * spec.moe_topk + spec.shared_expert_ffn) if spec.is_moe else spec.ffn_hidden_size
    whole = 8 * h                                      # norms' and linears' inputs: replicated without SP
    split = 2 * (h + 2 * kvd) + 2 * h + 6 * f          # Q/K/V, attention output, SwiGLU (TP-sharded)
    per_tp = (whole + split) / lay.tp if lay.sequence_parallel else whole + split / lay.tp
    layer = s * per_tp * act_bytes / 2
    layers = spec.num_layers // lay.pp
    if lay.recompute == "full":
        kept = s * 2 * h / (lay.tp if lay.sequence_parallel else 1) * act_bytes / 2
        stage = kept * layers + layer
    else:
        stage = layer * layers
    in_flight = min(lay.pp, micro_batches) if lay.pp > 1 else 1
    if lay.vpp > 1:
        in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.vpp)
    return int(stage * in_flight)


# -- the plan --------------------------------------------------------------------------------------------
@dataclass
class RoleRow:
    role: str
    stage: str
    static: Static
    activations: int = 0
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
        act = max(rows, key=lambda r: r.activations)
        terms[f"{act.role} activations"] = act.activations      # one role trains at a time
        return {k: v for k, v in terms.items() if v}

    def kept(self, rows: list[RoleRow]) -> int:
        return sum(r.static.total - r.offloaded for r in rows) if self.colocated else 0

    def kv_bytes(self, rows: list[RoleRow]) -> int | None:
        if not self.device_bytes:
            return None
        return int(self.utilization * self.device_bytes) - self.kept(rows) - self.engine_weights

    def render(self) -> str:
        def g(b: float) -> str:
            return f"{b / GIB:.2f}"
        lines = [f"megarl: memory plan per rank, GiB (device: {self.device_source})"]
        for r in self.rows:
            s = r.static
            lines.append(f"  {r.role:<7} {r.stage:<10} params {g(s.params)}  grads {g(s.grads)}  optimizer "
                         f"{g(s.optimizer)}  activations {g(r.activations)}{'  (' + r.note + ')' if r.note else ''}")
        for stage, rows in self._stages().items():
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
        if not self.device_bytes:
            lines.append(f"  no fit verdict: this machine has no GPU; {DEVICE_MEMORY_ENV}=<GiB per device> gives one")
        return "\n".join(lines)

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
    import torch  # lazy: a CPU config never loads it here
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
    from megarl.workers.config import recompute_overrides
    over = {**recompute_overrides(model.gradient_checkpointing_kwargs), **mc.override_transformer_config}
    return over.get("recompute_granularity") or ("full" if model.enable_gradient_checkpointing else None)


def _offloaded(mc, static: Static, gpu: bool) -> int:
    if not gpu or mc is None:
        return 0
    return (static.params * mc.param_offload + static.grads * mc.grad_offload
            + static.optimizer * mc.optimizer_offload)


def memory_plan(cfg, hf_config: dict, critic_hf: dict | None = None) -> Plan:
    """The plan for `cfg` with the actor's config.json (`critic_hf`: the critic's, when it loads its own)."""
    from megarl.workers.config import MegatronConfig
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
    if actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        ref = cfg.actor_rollout_ref.ref
        roles.append(("ref", ref.megatron or actor.megatron, actor.dtype, spec, "lm", False, None))
    for role, mc, dtype, rspec, head, trainable, rcfg in roles:
        mc = mc or MegatronConfig()
        lay = _role_layout(cfg, mc, dtype, gpu, _recompute(cfg.model, mc) if trainable else None)
        micro_rows = (rcfg.ppo_micro_batch_size_per_gpu or 1) if rcfg is not None else 0
        dynamic = rcfg is not None and bool(rcfg.use_dynamic_bsz)
        tokens = (rcfg.ppo_max_token_len_per_gpu if dynamic else micro_rows * seq) if rcfg is not None else 0
        mini_rows = (rcfg.ppo_mini_batch_size or 1) * ro.n // max(lay.dp, 1) if rcfg is not None else 0
        n_micro = max(1, -(-mini_rows // max(micro_rows, 1)))
        for pp_rank in range(lay.pp):
            static = static_bytes(rspec, lay, pp_rank, head, trainable)
            act = activation_bytes(rspec, lay, tokens, n_micro, lay.param_bytes) if trainable and pp_rank == 0 else 0
            offl = _offloaded(mc, static, gpu)
            if role == "ref" and gpu and cfg.actor_rollout_ref.ref.param_offload:
                offl = static.params
            note = ", ".join(filter(None, [
                f"DP {lay.dp}" + (" distributed optimizer" if lay.distributed_optimizer and trainable else ""),
                f"recompute {lay.recompute}" if lay.recompute else "",
                (f"{tokens}-token micro-batches" if act else "")]))
            plan.rows.append(RoleRow(role, f"pp stage {pp_rank}", static, act, offl, note))
    rtp = ro.tensor_model_parallel_size
    ebytes = (2 if gpu else 4) if ro.dtype == "auto" else _DTYPE_BYTES.get(ro.dtype, 2)
    from megarl.models.convert import hf_shapes
    plan.engine_weights = sum(math.prod(s) for s in hf_shapes(spec, "lm").values()) * ebytes // rtp
    kv_heads = max(1, spec.num_kv_heads // rtp)          # fewer KV heads than ranks: each rank holds one
    plan.kv_token_bytes = 2 * spec.num_layers * kv_heads * spec.head_dim * ebytes
    return plan
