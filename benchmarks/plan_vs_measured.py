"""The memory plan (megarl/launcher/memory_plan.py, memory_terms.py) against what
benchmarks/gpu_update_step.py measured on one rank; benchmarks/gpu_check.py reports it.

    rows = compare(hf_config, result)     # result: gpu_update_step.run(...)'s dict
    print(table(rows))

Two rows: the static part (parameters, grad buffers, optimizer state: the trainer's device bytes
before offload, `offload.resident_gb_before`), which the plan must match to the byte; and the update
phase's peak (`memory/update_actor_peak_gb`, torch.cuda.max_memory_allocated over update_policy,
CUDA only), which the plan estimates as static + activations: it is within PEAK_TOLERANCE or
flagged. The peak also holds what the estimate leaves out (the LM head's chunks, the loss's
temporaries, the allocator's rounding).
"""
from __future__ import annotations

from megarl.launcher.memory_terms import Layout, activation_bytes, static_bytes
from megarl.models.spec import ModelSpec

GIB = 2**30
PEAK_TOLERANCE = 0.25
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def planned(hf_config: dict, result: dict) -> dict[str, int]:
    """The plan's bytes for the benchmark's run: its model, dtype, optimizer, recompute and batch."""
    spec = ModelSpec.from_hf_config(hf_config)
    width = _BYTES[result["dtype"]]
    lay = Layout(distributed_optimizer=bool(result["distributed_optimizer"]), param_bytes=width,
                 host_step=not str(result["device"]).startswith("cuda"),
                 recompute="full" if result.get("recompute") else None)
    static = static_bytes(spec, lay, 0).total
    sequences, prompt, response = result["batch"]
    micro = result["micro"]
    act = activation_bytes(spec, lay, micro * (prompt + response), -(-sequences // micro), width)
    return {"static": static, "update_actor peak": static + act}


def compare(hf_config: dict, result: dict) -> list[dict]:
    """One row per phase the benchmark measured: planned and measured GiB, their ratio, and ok
    (the static part: equal bytes; the peak: within PEAK_TOLERANCE of the plan)."""
    plan = planned(hf_config, result)
    measured = {"static": result["offload"]["resident_gb_before"] * GIB}
    peak = result.get("memory", {}).get("memory/update_actor_peak_gb")
    if peak is not None:
        measured["update_actor peak"] = peak * GIB
    rows = []
    for phase, want in plan.items():
        got = measured.get(phase)
        if got is None:
            continue
        ok = round(got) == want if phase == "static" else abs(got - want) <= PEAK_TOLERANCE * want
        rows.append({"phase": phase, "planned_gb": want / GIB, "measured_gb": got / GIB,
                     "ratio": got / want if want else None, "ok": ok})
    return rows


def table(rows: list[dict]) -> str:
    return "; ".join(f"{r['phase']}: planned {r['planned_gb']:.3f} GiB, measured {r['measured_gb']:.3f} GiB "
                     f"({'ok' if r['ok'] else 'OFF'}, x{r['ratio']:.2f})" for r in rows)
