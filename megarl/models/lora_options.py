"""LoRA's options and the linears it adapts, without torch (config checks read them before a
model loads; megarl/models/lora.py builds the adapters)."""
from __future__ import annotations

from dataclasses import dataclass

# megatron linear -> (its place in the layer, the HF projections it fuses, column-parallel)
LINEARS = {
    "linear_qkv": ("self_attention", ("q_proj", "k_proj", "v_proj"), True),
    "linear_proj": ("self_attention", ("o_proj",), False),
    "linear_fc1": ("mlp", ("gate_proj", "up_proj"), True),
    "linear_fc2": ("mlp", ("down_proj",), False),
}
HF_PLACE = {"self_attention": "self_attn", "mlp": "mlp"}     # where HF keeps the projection
PROJECTIONS = tuple(p for _, parts, _ in LINEARS.values() for p in parts)
SUFFIX = "_lora"


@dataclass(frozen=True)
class LoraOptions:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]        # HF projection names (q_proj ... down_proj)
    dropout: float = 0.0
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self) -> None:
        if self.rank <= 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA: lora_rank must be > 0 (got {self.rank}) and lora_dropout in [0, 1) "
                             f"(got {self.dropout})")


def parse_targets(targets) -> tuple[str, ...]:
    """"all-linear" (every linear of a layer, not the LM head, as PEFT reads it), or a list of HF
    projection names (q_proj ... down_proj) and megatron linear names (linear_qkv ... linear_fc2)."""
    if targets in (None, "all-linear", ["all-linear"]):
        return PROJECTIONS
    names = [targets] if isinstance(targets, str) else list(targets)
    out: list[str] = []
    for n in names:
        if n in LINEARS:
            out += LINEARS[n][1]
        elif n in PROJECTIONS:
            out.append(n)
        else:
            raise ValueError(f"target_modules: {n!r} is not a linear megarl adapts; use all-linear or names from "
                             f"{', '.join(PROJECTIONS)} (or megatron's {', '.join(LINEARS)})")
    return tuple(p for p in PROJECTIONS if p in out)


def converter_entry(model) -> dict[str, dict]:
    """verl's LoRA keys of a model config (lora_rank, lora_alpha, target_modules, lora_dropout) as
    the `lora` converter's entry, {"lora": options}; {} where lora_rank is 0. The keys act here:
    megarl/models/lora.py builds the converter from these options."""
    if not model.lora_rank:
        return {}
    return {"lora": {"rank": model.lora_rank, "alpha": float(model.lora_alpha),
                     "target_modules": list(parse_targets(model.target_modules)),
                     "dropout": float(model.lora_dropout)}}


def is_adapter_name(name: str) -> bool:
    """Whether a parameter's name is a LoRA adapter's (`...linear_qkv_lora.A_q_proj`)."""
    return any(f".{kind}{SUFFIX}." in name or name.startswith(kind + SUFFIX + ".") for kind in LINEARS)


# -- a checkpoint's adapters, whole (checkpoints_tools/megatron_to_hf.py) ----------------------------
def peft_key(layer: int, kind: str, part: str, which: str) -> str:
    """PEFT's key (get_peft_model_state_dict) of one adapter tensor; `layer` counts from 0."""
    return f"base_model.model.model.layers.{layer}.{HF_PLACE[LINEARS[kind][0]]}.{part}.lora_{which}.weight"


def checkpoint_adapters(tensors: dict) -> dict:
    """{PEFT key: tensor} from a megatron checkpoint's whole tensors (layers stacked on axis 0, as
    megarl.workers.checkpoint.plain_tensors reads them): every TP split is already whole there."""
    out = {}
    for key, value in tensors.items():
        if not key.startswith("decoder.layers.") or not is_adapter_name(key):
            continue
        where, module, leaf = key[len("decoder.layers."):].split(".")
        which, part = leaf.split("_", 1)
        for n in range(value.shape[0]):
            out[peft_key(n, module[: -len(SUFFIX)], part, which)] = value[n]
    return out


def merge_into_hf(hf: list, adapters: dict, scale: float) -> list:
    """HF (name, tensor) pairs with W + scale * B @ A for every adapted projection (in fp32, back
    to W's dtype): PEFT's merge_and_unload on whole tensors."""
    out = []
    for name, w in hf:
        a = adapters.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        if a is not None and name.endswith(".weight"):
            b = adapters[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
            w = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
        out.append((name, w))
    return out


def peft_config(opts: dict, base_model: str | None) -> dict:
    """PEFT's adapter_config.json for a megarl LoRA (the converter's options)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(opts["rank"]), "lora_alpha": opts["alpha"],
            "lora_dropout": opts.get("dropout", 0.0), "target_modules": list(opts["target_modules"]),
            "bias": "none", "fan_in_fan_out": False, "base_model_name_or_path": base_model}
