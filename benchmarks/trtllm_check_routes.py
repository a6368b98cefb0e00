"""R3 in benchmarks/trtllm_check.py: TensorRT-LLM's routed experts against megatron's router.

    r3 = route_agreement(batch, megatron_routes(policy, batch))   # {"per_layer": [...], "overall": ...}
    r3["passed"]                                                  # every layer at or above R3_MIN

A MoE checkpoint's rollout asks TensorRT-LLM for the experts each fed token went to
(enable_return_routed_experts); megatron scores the same tokens with its own router (RECORD, not
replay) and the two top-k sets are compared position by position, per MoE layer. The batch layout
is megarl/models/routing_replay.py's: routed_experts [B, S, L, K] aligned with input_ids.
"""
from __future__ import annotations

import torch

# The share of (token, layer) top-k sets that must equal megatron's, in every layer. Rollout
# Routing Replay (Ma et al., arXiv 2510.11370) measures about 10% of routers choosing different
# experts between SGLang and Megatron on Qwen3-30B-A3B in bf16, near-ties flipped by kernel
# differences: that is why R3 replays routes. A broken path (positions shifted, layers out of
# order, a rank's slice wrong) agrees at about chance, under 1% for 128 experts top-8.
R3_MIN = 0.8


def megatron_routes(policy, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(routes [B, S, L, K], log-probs [B, R]) of `batch` as megatron's own routers pick them:
    one forward of the frozen policy with its routers recording (megarl/workers/routes.py)."""
    from megarl.models.routing_replay import KEY
    from megarl.parallel import state
    from megarl.workers.outputs import log_prob_outputs

    eng = policy.engine

    def process(out, mb):
        return log_prob_outputs(out, mb, eng.head_weight(), eng.spec.vocab_size, eng.layout.tp_rank,
                                state.tp_group(), 1.0, False)

    rows = eng.forward_rows(batch, policy.micro, process, ("log_probs",), routes="record")
    return rows[KEY], rows["log_probs"]


def route_agreement(batch, megatron: torch.Tensor) -> dict:
    """Per MoE layer, the share of positions whose top-k set (order aside) is megatron's. Every real
    position of a row but its last counts: the engine never feeds the final token, and the rollout
    copies the position before it there (megarl/rollout/base.py pack_routes). Prompt and response
    positions are also reported apart (a prefix served from the KV cache is in the prompt)."""
    from megarl.models.routing_replay import KEY

    engine = batch.batch[KEY].long().sort(dim=-1).values              # [B, S, L, K]
    ours = megatron.to(engine.device).long().sort(dim=-1).values
    if engine.shape != ours.shape:
        raise ValueError(f"TensorRT-LLM's routes {tuple(engine.shape)} and megatron's {tuple(ours.shape)} "
                         "differ in shape: [B, S, MoE layers, top-k] each")
    same = (engine == ours).all(dim=-1)                                # [B, S, L]
    prompt, total = batch.batch["prompt_lens"], batch.batch["prompt_lens"] + batch.batch["response_lens"]
    pos = torch.arange(engine.shape[1]).unsqueeze(0)                   # [1, S]
    fed = pos < (total - 1).unsqueeze(1)                               # [B, S]
    in_prompt = fed & (pos < prompt.unsqueeze(1))
    in_response = fed & ~in_prompt

    def share(mask):
        return round(same[mask].float().mean().item(), 6) if bool(mask.any()) else None

    per_layer = [round(same[..., layer][fed].float().mean().item(), 6) for layer in range(same.shape[-1])]
    return {"per_layer": per_layer, "overall": share(fed), "prompt": share(in_prompt),
            "response": share(in_response), "positions": int(fed.sum()), "top_k": engine.shape[-1],
            "threshold": R3_MIN, "passed": min(per_layer) >= R3_MIN}


def markdown(r3: dict | None) -> list[str]:
    """The report's R3 lines (nothing for a dense model)."""
    if not r3:
        return []
    layers = ", ".join(f"{a:.3f}" for a in r3["per_layer"])
    return [f"- R3 routes, TensorRT-LLM against megatron's router ({r3['positions']} positions, top-{r3['top_k']}): "
            f"{r3['overall']:.4f} of top-k sets equal overall (prompt {r3['prompt']}, response {r3['response']}); "
            f"{'passed' if r3['passed'] else 'FAILED'}: every layer needs {r3['threshold']}",
            f"- R3 agreement per MoE layer: {layers}",
            f"- log-probs with megatron routing itself (what R3 removes): max abs "
            f"{r3.get('logprob_max_abs_diff_own_routes', float('nan')):.3e}"]
