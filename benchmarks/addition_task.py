"""Is the quickstart's addition task tuned right? Warm start, headroom, and learnability.

    python benchmarks/addition_task.py [--warm-steps 350] [--more-sft 300] [--rl-steps 60] [--rl-lr 1e-4 3e-4]
    python benchmarks/addition_task.py --compare-threads     # warm-start speed, 1 vs 2 torch threads
    python benchmarks/addition_task.py --smoke               # CI: a few steps of each part

Prints, side by side: the warm start's wall time and held-out accuracy (greedy and sampled at
T=1), the accuracy after `--more-sft` further supervised steps (the headroom is learnable), and
after `--rl-steps` of plain single-process GRPO built from megarl.algos (reward-driven training
closes part of it). This is a sanity check of the task, not of megarl's distributed trainer.

Figures, with their dates, machines and commands: docs/measurements.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time

import numpy as np
import torch

from megarl.algos.advantages import get_adv_estimator
from megarl.algos.losses import Aggregator, ClipParams, get_policy_loss
from megarl.examples.addition.model import build_model, build_tokenizer
from megarl.examples.addition.task import AdditionTask, answer_text, prompt_text, split_problems
from megarl.examples.addition.warmstart import accuracy, supervised_train
from megarl.reward.rules import default_compute_score


def exact(text: str, truth: str) -> float:
    return default_compute_score("addition", text, truth)["score"]


def partial(text: str, truth: str) -> float:
    """1 for the exact answer, else half the fraction of answer digits right (aligned from the
    right) -- a denser signal for groups with no exact answer."""
    if exact(text, truth):
        return 1.0
    t = text.strip()
    if not t.isdigit():
        return 0.0
    hits = sum(x == y for x, y in zip(reversed(t), reversed(truth)))
    return 0.5 * hits / max(len(t), len(truth))


REWARD = exact


@torch.no_grad()
def sample(model, tok, prompt_ids: list[int], n: int, max_new: int, gen: torch.Generator) -> list[list[int]]:
    """n completions (token ids, EOS included when produced) of one prompt at temperature 1."""
    ids = torch.tensor([prompt_ids] * n)
    eos = tok.eos_token_id
    done = torch.zeros(n, dtype=torch.bool)
    out = []
    for _ in range(max_new):
        probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), -1)
        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        nxt = torch.where(done, torch.full_like(nxt, tok.pad_token_id), nxt)
        out.append(nxt)
        done |= nxt == eos
        ids = torch.cat([ids, nxt[:, None]], 1)
        if done.all():
            break
    rows = torch.stack(out, 1).tolist()
    return [r[:r.index(eos) + 1] if eos in r else [t for t in r if t != tok.pad_token_id] for r in rows]


def grpo_step(model, opt, tok, problems, n: int, max_new: int, gen, updates: int = 1, sched=None) -> float:
    """GRPO on `problems` (n samples each): `updates` clipped-ratio steps on the same samples
    (PPO epochs); returns the mean reward."""
    seqs, uids, rewards = [], [], []
    for k, (a, b) in enumerate(problems):
        p = tok.encode(prompt_text(a, b))
        for r in sample(model, tok, p, n, max_new, gen):
            seqs.append((p, r))
            uids.append(k)
            text = tok.decode(r, skip_special_tokens=True)
            rewards.append(float(REWARD(text, answer_text(a, b))))
    B, R = len(seqs), max(len(r) for _, r in seqs)
    # Prompts of one batch may differ in length: run each (prompt, response) on its own row,
    # right-padded; the loss only reads response positions.
    S = max(len(p) + len(r) for p, r in seqs)
    ids = torch.full((B, S), tok.pad_token_id)
    resp_pos = torch.zeros(B, R, dtype=torch.long)
    mask = torch.zeros(B, R)
    targets = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(seqs):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        resp_pos[i, :len(r)] = torch.arange(len(p) - 1, len(p) + len(r) - 1)
        targets[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    scores = torch.zeros(B, R)
    lens = mask.sum(-1).long()
    scores[torch.arange(B), lens - 1] = torch.tensor(rewards)
    adv, _ = get_adv_estimator("grpo")(scores, mask, uid=np.array(uids))

    def log_probs():
        logits = model(input_ids=ids).logits.float()                                  # [B, S, V]
        logp_all = torch.log_softmax(logits.gather(1, resp_pos[..., None].expand(-1, -1, logits.shape[-1])), -1)
        return logp_all.gather(-1, targets[..., None]).squeeze(-1)                     # [B, R]

    old = None
    for _ in range(updates):
        logp = log_probs()
        old = logp.detach() if old is None else old
        loss, _ = get_policy_loss("vanilla")(old, logp, adv, mask, ClipParams(), Aggregator("token-mean"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
    return float(np.mean(rewards))


def compare_threads(steps: int = 30, repeats: int = 3) -> None:
    """Warm-start speed with 1 vs 2 torch threads, alternated, medians after a warm-up run."""
    tok, task, times = build_tokenizer(), AdditionTask(), {1: [], 2: []}
    for r in range(repeats + 1):
        for n in (1, 2):
            torch.set_num_threads(n)
            st = supervised_train(build_model(tok), tok, task, steps)
            if r:
                times[n].append(st["seconds"])
    med = {n: float(np.median(t)) for n, t in times.items()}
    print(json.dumps({"sft_steps": steps, "median_s_1_thread": round(med[1], 2), "median_s_2_threads": round(med[2], 2),
                      "ratio_2_over_1": round(med[2] / med[1], 2)}), flush=True)


SMOKE = dict(warm_steps=10, more_sft=5, rl_steps=2, prompts=2, n=2)   # --smoke (CI): it runs, not what it learns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm-steps", type=int, default=None, help="default: the bootstrap's")
    ap.add_argument("--more-sft", type=int, default=300)
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    ap.add_argument("--layers", type=int, default=None, help="default: the bootstrap model's")
    ap.add_argument("--min-digits", type=int, default=AdditionTask.min_digits)
    ap.add_argument("--max-digits", type=int, default=AdditionTask.max_digits)
    ap.add_argument("--rl-steps", type=int, default=60)
    ap.add_argument("--rl-lr", type=float, nargs="+", default=[1e-4], help="one RL run from the warm start per value")
    ap.add_argument("--rl-warmup", type=int, default=5, help="linear learning-rate warm-up steps of the RL optimiser")
    ap.add_argument("--updates", type=int, default=1, help="optimiser steps per batch of samples (PPO epochs)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest for this model)")
    ap.add_argument("--reward", choices=["exact", "partial"], default="exact")
    ap.add_argument("--compare-threads", action="store_true", help="only time the warm start at 1 vs 2 threads")
    ap.add_argument("--smoke", action="store_true", help=f"CI's shape: {SMOKE}")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    if args.compare_threads:
        compare_threads()
        return
    global REWARD
    REWARD = {"exact": exact, "partial": partial}[args.reward]
    from megarl.examples.addition import checkpoint as bs
    torch.set_num_threads(args.threads)
    warm = args.warm_steps if args.warm_steps is not None else bs.DEFAULT_WARM_START_STEPS
    task = AdditionTask(args.min_digits, args.max_digits)
    train, val = split_problems(task, 3000, 256)
    tok = build_tokenizer()
    model = build_model(tok, seed=0, **({"num_hidden_layers": args.layers} if args.layers else {}))
    st = supervised_train(model, tok, task, warm, exclude=set(val), lr=bs.DEFAULT_LR,
                          label_smoothing=args.label_smoothing)
    res = {"warm_start_steps": warm, "warm_start_s": round(st["seconds"], 1),
           "warm_greedy": accuracy(model, tok, val, 0.0), "warm_t1": accuracy(model, tok, val, 1.0, seed=1)}
    print(json.dumps(res), flush=True)
    warm_model = copy.deepcopy(model)
    if args.more_sft:
        sft = copy.deepcopy(warm_model)
        supervised_train(sft, tok, task, args.more_sft, exclude=set(val), seed=99, lr=bs.DEFAULT_LR)
        res.update(sft_more_steps=args.more_sft, sft_greedy=accuracy(sft, tok, val, 0.0),
                   sft_t1=accuracy(sft, tok, val, 1.0, seed=1))
        print(json.dumps({k: res[k] for k in ("sft_more_steps", "sft_greedy", "sft_t1")}), flush=True)
    for lr in args.rl_lr if args.rl_steps else []:
        rl = copy.deepcopy(warm_model)
        rl.train()
        opt = torch.optim.AdamW(rl.parameters(), lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.rl_warmup)))
        gen = torch.Generator().manual_seed(0)
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        for step in range(1, args.rl_steps + 1):
            problems = [train[i] for i in rng.choice(len(train), args.prompts, replace=False)]
            reward = grpo_step(rl, opt, tok, problems, args.n, task.max_answer_chars() + 1, gen, args.updates, sched)
            if step % 10 == 0 or step == args.rl_steps:
                rl.eval()
                g, t = accuracy(rl, tok, val, 0.0), accuracy(rl, tok, val, 1.0, seed=1)
                rl.train()
                print(json.dumps({"rl_lr": lr, "rl_step": step, "train_reward": round(reward, 3), "val_greedy": g,
                                  "val_t1": t, "rl_s": round(time.perf_counter() - t0, 1)}), flush=True)
        res[f"rl_lr{lr:g}"] = {"steps": args.rl_steps, "greedy": g, "t1": t}
    print("summary", json.dumps(res))
    import resource
    print(f"peak resident MiB: main {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} (one process; "
          f"load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
