"""Configuration of rollout (`actor_rollout_ref.rollout.*`).

Every field of verl's RolloutConfig is accepted with verl's meaning. Fields that only one
engine understands are handed to it (see each engine's module); `engine_kwargs.<name>` passes
arguments to an engine verbatim, so new engine options need no code change here.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.transports import transport_options
from megarl.config.errors import ConfigError
from megarl.config.typed import Section, require
from megarl.engines import EngineInfo, config_info, declaring


CODEC_MODULES = {"zstd": "zstandard", "lz4": "lz4"}   # delta_compression -> its package (megarl[compress])


def codec_problem(codec: str) -> str | None:
    """Why delta compression `codec` cannot run here (one line naming the fix), or None. The config
    check and every builder of delta options ask it, so a missing package stops a run (or a
    benchmark) when it is built, not inside a rank's sync."""
    if codec == "none":
        return None
    if codec not in CODEC_MODULES:
        return f"unknown delta compression {codec!r}; use one of none, {', '.join(CODEC_MODULES)}"
    module = CODEC_MODULES[codec]
    if importlib.util.find_spec(module) is None:
        return (f"delta compression {codec} needs the {module} package: pip install {module} (or megarl[compress]), "
                "or set delta_compression=none")
    return None


def check_sampling(obj, prefix: str = "") -> None:
    """The sampling rules shared by training and validation sampling."""
    p = prefix
    require(obj.temperature >= 0, f"{p}temperature", f"got {obj.temperature}, must be >= 0 (0 = greedy)")
    require(0 < obj.top_p <= 1, f"{p}top_p", f"got {obj.top_p}, must be in (0, 1]")
    require(obj.top_k == -1 or obj.top_k >= 1, f"{p}top_k", f"got {obj.top_k}, must be -1 (off) or >= 1")
    require(obj.n >= 1, f"{p}n", f"got {obj.n}, must be >= 1")


@dataclass
class SamplingConfig(Section):
    """Validation sampling (`rollout.val_kwargs`)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    do_sample: bool = False

    def __post_init__(self):
        check_sampling(self)


@dataclass
class MultiTurnConfig(Section):
    """Multi-turn rollouts with tools (megarl/rollout/multiturn); `rollout.tools=tools.yaml` turns it on."""
    enable: bool = False
    max_assistant_turns: int | None = None  # None: until no tool call or the response budget is spent
    max_user_turns: int | None = None      # simulated-user turns (interactions); None: 1 when one is set
    max_tool_response_length: int = 256    # tokens of one tool's output kept (the marker and wrapper on top)
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    tool_config_path: str | None = None    # same as rollout.tools
    interaction_config_path: str | None = None
    max_parallel_calls: int = 1            # calls executed per assistant turn; 1: a turn stops at </tool_call>
    format: str = "hermes"                 # how tool calls appear in text: <tool_call>{json}</tool_call>
    tool_timeout_s: float = 30.0           # per call, from when it starts running
    tool_workers: int = 8                  # calls run at once
    # thread: in this process (a call past its timeout is abandoned, not killed);
    # ray: in Ray actors, killed and replaced on timeout (sandboxing for untrusted or hanging tools).
    tool_backend: Literal["thread", "ray"] = "thread"
    # How tool output is placed in the sequence: the chat template's tool message (auto: when the
    # template renders a "tool" role), or <tool_response>...</tool_response> (plain).
    tool_response_render: Literal["auto", "chat_template", "plain"] = "auto"
    # Re-render chat prompts with the tool list (tools=... in apply_chat_template) when the chat
    # template renders tools, so the model is told which tools exist (as verl's tool agent loop does).
    tools_in_prompt: bool = True

    def __post_init__(self):
        require(self.max_assistant_turns is None or self.max_assistant_turns >= 1, "max_assistant_turns",
                "must be >= 1 or null (no limit besides the response budget)")
        require(self.max_user_turns is None or self.max_user_turns >= 0, "max_user_turns", "must be >= 0 or null")
        require(self.max_tool_response_length >= 1, "max_tool_response_length", "must be >= 1 token")
        require(self.max_parallel_calls >= 1, "max_parallel_calls", "must be >= 1")
        require(self.tool_timeout_s > 0, "tool_timeout_s", "must be > 0 seconds")
        require(self.tool_workers >= 1, "tool_workers", "must be >= 1")
        require(self.format == "hermes", "format",
                f"got {self.format!r}; megarl parses the hermes format (<tool_call>{{json}}</tool_call>, "
                "as Qwen2.5/Qwen3 and most open tool-calling models emit): set format=hermes")


@dataclass
class ServerConfig(Section):
    timeout: float = 60.0
    max_attempts: int = 3
    max_connections: int = 1000


# The weight sync's section sits under rollout's (actor_rollout_ref.rollout.checkpoint_engine.*,
# as in verl); megarl/checkpoint_engine reads it from here.
@dataclass
class CheckpointEngineConfig(Section):
    # A registered transport (megarl/transports/: colocated, the engine on the
    # training ranks; distributed, the engine on ranks of its own; disk, HF safetensors in
    # `disk_dir` for an engine in another job), or auto (from placement). delta_sharded: verl's name
    # for the distributed transport with delta on (verl-project/verl c04f5e9,
    # verl/checkpoint_engine/delta_checkpoint_engine.py, registers "delta" and "delta_sharded").
    # naive: verl 0.9.1's default, its engine for a rollout on the training ranks
    # (verl/checkpoint_engine/base.py registers ColocatedCheckpointEngine as "naive"): the colocated transport.
    backend: str = "auto"
    bucket_size_mb: float = 512            # one bucket's buffer (MiB); a rank holds at most two, plus one tensor
    overlap: bool = True                   # move the next bucket while the engine loads this one
    disk_dir: str | None = None            # backend=disk: where step_NNNNNN/ exports and `latest` go
    disk_keep: int = 2                     # backend=disk: newest exports kept (older ones are deleted)
    update_weights_bucket_megabytes: float | None = None  # verl's name for bucket_size_mb
    # distributed only (null: true there): engine ranks keep the last complete weights in host
    # memory (one model copy per engine rank) and reload them when a sync fails, so the engine goes
    # on generating on its old weights. false: an in-place engine (native, hf) refuses to generate
    # until a sync succeeds.
    keep_previous_weights: bool | None = None
    # Delta sync (distributed and disk transports, docs/weight-sync.md): send only the elements
    # whose engine-dtype bits changed. auto: on where the engine's weights are 16-bit or narrower.
    # The sender keeps its last-sent shards (engine dtype) in host memory: model bytes / trainer TP / PP.
    delta: bool | Literal["off", "on", "auto"] | None = None   # null: off (on with backend=delta_sharded);
    # a bare on/off in YAML reads as true/false, taken as on/off
    delta_anchor_every: int = 20           # a full sync every this many syncs (also after failures, resumes, restarts)
    delta_dense_above: float = 0.25        # a bucket with more than this fraction changed is sent dense
    delta_compression: Literal["none", "zstd", "lz4"] = "none"   # frames compressed where it makes them smaller
    delta_copy: Literal["host", "device"] = "host"   # where the sender keeps its last-sent copy
    # verl's key: transport name -> its own options, typed by the options class each transport registers
    # once the names are known (megarl/transports/__init__.py check_transport); only the chosen one's may be given
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def options(self, name: str) -> Any:
        """The options transport `name` builds with: those given, else its class's defaults."""
        return self.engine_kwargs.get(name) or transport_options(name, {})

    def __post_init__(self):
        if self.update_weights_bucket_megabytes is not None:
            self.bucket_size_mb = self.update_weights_bucket_megabytes
        if isinstance(self.delta, bool):
            self.delta = "on" if self.delta else "off"
        if self.backend == "delta_sharded":
            require(self.delta in (None, "on"), "delta",
                    "backend=delta_sharded (verl) is the distributed transport with "
                    "delta on; remove delta=off or use backend=distributed")
            self.backend, self.delta = "distributed", "on"
        if self.backend == "naive":
            self.backend = "colocated"
        self.delta = self.delta or "off"
        require(self.delta_anchor_every >= 1, "delta_anchor_every", "must be >= 1 (1: every sync is full)")
        require(0 < self.delta_dense_above <= 1, "delta_dense_above", "must be in (0, 1]")
        require(self.bucket_size_mb > 0, "bucket_size_mb", "must be > 0 (MiB)")
        require(self.disk_keep >= 1, "disk_keep", "must be >= 1 (the newest export is always kept)")


@dataclass
class CostModelConfig(Section):
    """The engine cost model's terms (megarl/rollout/cost_model.py says where they come from)."""
    enable: bool = False
    decode_s: float = 0.46e-3           # a: seconds per decode step (H100, built-in engine)
    decode_row_s: float = 0.0           # b: seconds per row of a decode step (flat on the H100)
    prefill_token_s: float = 16e-6      # c: seconds per prefilled prompt token (H100, 0.058 s / 3,661 tokens)
    scale: float = 1.0                  # every term times this (the trainer's slowdown against a GPU)

    def __post_init__(self):
        for key in ("decode_s", "decode_row_s", "prefill_token_s"):
            require(getattr(self, key) >= 0, key, f"got {getattr(self, key)}, must be >= 0 seconds")
        require(self.scale > 0, "scale", f"got {self.scale}, must be > 0 (1 = the GPU's own time)")


@dataclass
class RolloutConfig(Section):
    # Engine: native (built in, runs anywhere), trtllm (TensorRT-LLM), hf (transformers' generate),
    # custom (a user's BaseRollout subclass from custom_cls_path / custom_cls_name), or any other
    # declared in megarl/engines/; vllm and sglang are declared and refused with the reason.
    name: str = "native"
    mode: Literal["async", "sync"] = "sync"   # both: the step waits for its generations (refused.py ALREADY)
    custom_cls_path: str | None = None
    custom_cls_name: str | None = None

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    n: int = 1
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    over_sample_rate: float = 0.0

    prompt_length: int | None = None       # None: data.max_prompt_length
    response_length: int | None = None     # None: data.max_response_length
    max_response_length: int | None = None  # seed docs' spelling of response_length

    dtype: str = "auto"                    # auto: bf16 on GPU, fp32 on CPU (exact log-probs)
    gpu_memory_utilization: float = 0.5
    # native: true runs every decode step eagerly; false or null captures it in CUDA graphs (one
    # per bucketed batch size, replayed each step; CUDA only, CPU always runs eagerly). null is
    # the default so the built-in engine is fast on GPU unless asked otherwise; false is refused for
    # an engine that declares no graph capture (hf has none, TensorRT-LLM takes its own setting).
    enforce_eager: bool | None = None
    free_cache_engine: bool = True
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192    # native: padded prompt tokens per batched prefill pass
    max_model_len: int | None = None
    max_num_seqs: int = 1024
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)

    log_prob_micro_batch_size: int | None = None
    log_prob_micro_batch_size_per_gpu: int | None = None
    # The actor's old-log-prob pass (verl's keys): None takes actor.use_dynamic_bsz / ppo_max_token_len_per_gpu.
    log_prob_use_dynamic_bsz: bool | None = None
    log_prob_max_token_len_per_gpu: int | None = None
    # MoE: the engine returns each token's top-k experts per MoE layer (batch key `routed_experts`)
    # for R3 routing replay (verl's key; actor_rollout_ref.actor.router_replay.mode=R3 needs it).
    enable_rollout_routing_replay: bool = False

    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    tools: str | None = None               # a tools.yaml (verl's rollout guide); turns multi_turn on
    interactions: list[str] = field(default_factory=list)
    server: ServerConfig = field(default_factory=ServerConfig)
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)

    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = True
    load_format: str = "dummy"
    quantization: str | None = None

    # Where the engine runs: on the training ranks (colocated, sleeping while the trainer works)
    # or on ranks of its own (disaggregated: the last `disaggregated_ranks` of the world).
    placement: Literal["colocated", "disaggregated"] = "colocated"
    disaggregated_ranks: int = 0
    engine_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)  # {engine name: kwargs}
    # Over-long prompts: refuse ("error") or keep the last prompt_length tokens ("left").
    prompt_truncation: Literal["error", "left"] = "error"
    # Paces the engine like a GPU (megarl/rollout/cost_model.py): benchmarks and CI on CPU only.
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)

    def __post_init__(self):
        check_sampling(self)
        require(self.repetition_penalty > 0, "repetition_penalty", "must be > 0 (1.0 = off)")
        info = config_info(self.name)
        if info is not None:
            check_engine_asks(self, info)
        else:                           # a user's class: its abilities are checked where it loads
            require(bool(self.custom_cls_path and self.custom_cls_name), "custom_cls_path",
                    f"name={self.name} needs custom_cls_path=<file.py or module> and custom_cls_name=<class>")
        require(self.tensor_model_parallel_size >= 1, "tensor_model_parallel_size", "must be >= 1")
        require(self.pipeline_model_parallel_size == 1, "pipeline_model_parallel_size",
                "rollout engines here shard by TP only; set it to 1 and raise tensor_model_parallel_size")
        require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        for key in ("prompt_length", "response_length", "max_response_length", "max_model_len"):
            require(getattr(self, key) is None or getattr(self, key) >= 1, key, "must be >= 1 token (or null)")
        if self.max_response_length is not None:
            require(self.response_length in (None, self.max_response_length), "max_response_length",
                    f"conflicts with response_length={self.response_length}; set only one")
            self.response_length = self.max_response_length
        mt = self.multi_turn
        require(self.tools is None or mt.tool_config_path in (None, self.tools), "tools",
                f"conflicts with multi_turn.tool_config_path={mt.tool_config_path}; set only one")
        if self.tools is not None or self.interactions or mt.tool_config_path or mt.interaction_config_path:
            self.multi_turn.enable = True
            if self.multi_turn.tool_config_path is None:
                self.multi_turn.tool_config_path = self.tools
        require(self.placement == "colocated" or self.disaggregated_ranks >= 1, "disaggregated_ranks",
                "placement=disaggregated needs disaggregated_ranks >= 1 (ranks given to the engine)")


def check_engine_asks(ro: RolloutConfig, info: EngineInfo, key: str = "") -> None:
    """What this section asks of the engine that the engine does not declare it can do. `key`: the
    section's own key where this runs outside the section (a user's class, once loaded)."""
    if ro.enforce_eager is False and not info.captures_cuda_graphs:
        graphs = ", ".join(declaring("captures_cuda_graphs"))
        raise ConfigError(f"false asks for CUDA graphs, which the {ro.name} engine does not capture (engines "
                          f"that do: {graphs}); {info.graphs_hint}", "enforce_eager").under(key)
    if info.max_tp and ro.tensor_model_parallel_size > info.max_tp:
        raise ConfigError(f"={ro.tensor_model_parallel_size}: the {ro.name} engine runs at rollout TP {info.max_tp} or "
                          f"less in megarl ({info.summary}); set it to {info.max_tp} (each rank then runs its own "
                          "engine)", "tensor_model_parallel_size").under(key)
    if info.tp_colocated_only and ro.tensor_model_parallel_size > 1 and ro.placement != "colocated":
        raise ConfigError(f"={ro.tensor_model_parallel_size} with placement={ro.placement}: the {ro.name} engine forms "
                          "its TP groups over every rank of the job, which the trainer's ranks never join; use "
                          "placement=colocated, or tensor_model_parallel_size=1 (each rollout rank its own engine)",
                          "tensor_model_parallel_size").under(key)
    for sleep_key in ("free_cache_engine", "enable_sleep_mode"):
        if not info.sleeps and getattr(ro, sleep_key):
            raise ConfigError(f"=true asks the {ro.name} engine to sleep between rollouts, which it cannot "
                              f"({info.summary} has no sleep mode); set actor_rollout_ref.rollout.free_cache_engine"
                              "=false and enable_sleep_mode=false", sleep_key).under(key)
    if ro.enable_rollout_routing_replay and not info.records_routes:
        use = " or ".join(f"rollout.name={name}" for name in declaring("records_routes"))
        raise ConfigError(f"{info.why_no_routes}; for R3 use {use}, or R2 (actor_rollout_ref.actor.router_replay."
                          "mode=R2) with this key off", "enable_rollout_routing_replay").under(key)
