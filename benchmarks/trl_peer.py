"""TRL's side of benchmarks/vs_trl.py: GRPOTrainer steps on a local model, timed, as JSON.

Runs in TRL's own virtual environment (it needs only torch, transformers, datasets, trl, and
megarl's reward rules, which import nothing but the standard library), started by vs_trl.py:

    PYTHONPATH=$PWD /work/venvs/trl/bin/python benchmarks/trl_peer.py --model DIR --out result.json

One GRPO step = one generation of prompts x n completions + steps_per_generation optimizer steps
(TRL's global steps), so step k's time is the clock between the ends of global steps 2k-2 and 2k.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The settings that make the work equal to megarl's side (vs_trl.py prints them with megarl's).
EQUAL = dict(loss_type="dapo",            # token-level: sum over the batch's tokens / their count (megarl token-mean)
             epsilon=0.2, epsilon_high=0.28,  # clip-higher, megarl clip_ratio_low / clip_ratio_high
             beta=0.0,                    # no KL term, no reference model
             scale_rewards="group",       # GRPO: (r - group mean) / group std (megarl norm_adv_by_std_in_grpo)
             num_iterations=1,            # one pass over the batch (megarl ppo_epochs 1)
             gradient_accumulation_steps=1, steps_per_generation=2,  # two optimizer updates per generation
             temperature=1.0, top_p=1.0, top_k=0, use_vllm=False,
             bf16=False, fp16=False, gradient_checkpointing=False,   # fp32, no recompute (as megarl)
             weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="constant",
             adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
             shuffle_dataset=False)       # prompts in file order (megarl data.shuffle=false)


def load_rows(path: str, count: int) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            rows.append({"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"],
                         "data_source": r["data_source"]})
            if len(rows) == count:
                break
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", default="data/addition/train.jsonl")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fixed-length", action="store_true", help="every completion exactly --max-new tokens")
    a = ap.parse_args()

    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarl.reward.rules import default_compute_score   # the rule megarl's reward manager applies

    def reward(completions, ground_truth, data_source, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [float(default_compute_score(d, t, g)["score"]) for t, g, d in zip(texts, ground_truth, data_source)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_train_begin(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    steps = a.warmup + a.steps
    per_update = a.prompts * a.n // EQUAL["steps_per_generation"]
    rows = load_rows(a.data, a.prompts * steps)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(output_dir=tmp, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
                         disable_tqdm=True, seed=a.seed, learning_rate=a.lr,
                         max_steps=steps * EQUAL["steps_per_generation"],
                         per_device_train_batch_size=per_update, num_generations=a.n,
                         max_completion_length=a.max_new, log_completions=False,
                         generation_kwargs={"min_new_tokens": a.max_new} if a.fixed_length else None, **EQUAL)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(a.model)
        clock = Clock()
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list(rows), callbacks=[clock])
        trainer.train()
        logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    spg = EQUAL["steps_per_generation"]
    step_s = [clock.ends[spg * (k + 1)] - clock.ends[spg * k] for k in range(steps)]
    result = {"step_s": step_s, "optimizer_steps": trainer.state.global_step,
              "mean_completion_tokens": [h["completions/mean_length"] for h in logs],   # one log per generation
              "reward": [h.get("reward") for h in logs],
              "config": {k: getattr(cfg, k) for k in (*EQUAL, "per_device_train_batch_size", "generation_batch_size",
                                                      "num_generations", "max_completion_length", "learning_rate",
                                                      "generation_kwargs")},
              "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                           "datasets": datasets.__version__},
              "threads": torch.get_num_threads(),
              "parameters": sum(p.numel() for p in model.parameters())}
    with open(a.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
