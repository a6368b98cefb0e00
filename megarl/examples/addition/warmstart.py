"""Supervised warm start and evaluation of the addition model, in plain transformers/torch.

The warm start teaches the answer format and some of the arithmetic; it is kept short on
purpose so that held-out accuracy stays well below the ceiling and RL has room to improve it.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from megarl.examples.addition.task import SFT_SEED, AdditionTask, answer_text, prompt_text, split_problems


def sft_batch(tokenizer, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `prompt answer <eos>` rows and labels that score only the answer and EOS."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows, labels = [], []
    for a, b in pairs:
        p = tokenizer.encode(prompt_text(a, b))
        r = tokenizer.encode(answer_text(a, b)) + [eos]
        rows.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])              # [B, S]
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])           # [B, S]
    return ids, lab


def supervised_train(model, tokenizer, task: AdditionTask, steps: int, batch_size: int = 64, lr: float = 1e-3,
                     seed: int = SFT_SEED, exclude: set | None = None, warmup: int = 20, log_every: int = 0,
                     label_smoothing: float = 0.0) -> dict:
    """`steps` AdamW steps of next-token loss on the answers of fresh problems (never `exclude`)."""
    torch.manual_seed(seed)
    stream = task.problems(seed, exclude=exclude or set())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    model.train()
    start, losses = time.perf_counter(), []
    for step in range(steps):
        ids, lab = sft_batch(tokenizer, [next(stream) for _ in range(batch_size)])
        logits = model(input_ids=ids).logits[:, :-1].float()                       # [B, S-1, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1),
                                                 ignore_index=-100, label_smoothing=label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"sft step {step + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.4f}", flush=True)
    model.eval()
    return {"steps": steps, "seconds": time.perf_counter() - start,
            "final_loss": sum(losses[-20:]) / min(20, len(losses) or 1)}


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0) -> list[str]:
    """Decoded completions (special tokens dropped). Prompts of equal length run as one batch,
    so no padding is ever inside a sequence; temperature 0 is greedy."""
    gen = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    by_len: dict[int, list[int]] = defaultdict(list)
    encoded = [tokenizer.encode(p) for p in prompts]
    for i, ids in enumerate(encoded):
        by_len[len(ids)].append(i)
    out: list[str] = [""] * len(prompts)
    model.eval()
    for _, rows in sorted(by_len.items()):
        ids = torch.tensor([encoded[i] for i in rows])                             # [b, P]
        done = torch.zeros(len(rows), dtype=torch.bool)
        new = []
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids).logits[:, -1].float()                   # [b, V]
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            else:
                nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            new.append(nxt)
            done |= nxt == eos
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if done.all():
                break
        toks = torch.stack(new, dim=1).tolist()
        for row, seq in zip(rows, toks):
            if eos in seq:
                seq = seq[:seq.index(eos) + 1]
            out[row] = tokenizer.decode(seq, skip_special_tokens=True)
    return out


def accuracy(model, tokenizer, pairs: list[tuple[int, int]], temperature: float = 0.0, seed: int = 0,
             max_new_tokens: int | None = None) -> float:
    """Exact-match accuracy of the completions of `a+b=` (the reward the quickstart trains on)."""
    budget = max_new_tokens or max(len(answer_text(a, b)) for a, b in pairs) + 2
    outs = generate(model, tokenizer, [prompt_text(a, b) for a, b in pairs], budget, temperature, seed)
    return sum(o.strip() == answer_text(a, b) for o, (a, b) in zip(outs, pairs)) / len(pairs)


def held_out(task: AdditionTask, n_val: int = 512) -> list[tuple[int, int]]:
    return split_problems(task, 0, n_val)[1]
