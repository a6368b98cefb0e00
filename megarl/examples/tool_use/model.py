"""A character-level tokenizer and a tiny Qwen2 taught the tool-call format in a few seconds.

    python -m megarl.examples.tool_use.model --out runs/models/tool-use --data data/tool_use

The task: prompt "Q: 3+4\\n"; the model calls the calculator,
    <tool_call>{"name":"calculator","arguments":{"a":3,"b":4}}</tool_call>
the tool's output arrives as "\\n<tool_response>7</tool_response>\\n" (the agent loop's plain
rendering), and the model answers "A: 7" then EOS. The tool tags and the JSON keys are single
tokens (as Qwen2.5 makes <tool_call> one token), everything else one token per (printable ASCII) character.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]          # printable ASCII: tool errors are readable
WORDS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
         '"name"', '"arguments"', '"calculator"', '"a"', '"b"']


def build_tokenizer(tool_tokens: bool = True):
    """tool_tokens=False: the tags and keys are spelled out character by character (so
    </tool_call> is 12 tokens and a turn cannot stop on it as a token)."""

    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + CHARS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")   # one token per character
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIALS)
    if tool_tokens:
        core.add_tokens([AddedToken(w, special=False, normalized=False) for w in WORDS])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def prompt_text(a: int, b: int) -> str:
    return f"Q: {a}+{b}\n"


def call_text(a: int, b: int) -> str:
    return f'<tool_call>{{"name":"calculator","arguments":{{"a":{a},"b":{b}}}}}</tool_call>'


def tool_text(a: int, b: int) -> str:
    return f"\n<tool_response>{a + b}</tool_response>\n"


def answer_text(a: int, b: int) -> str:
    return f"A: {a + b}"


def build_model(tokenizer, seed: int = 0):
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def example(tokenizer, a: int, b: int, whole: bool = True) -> tuple[list[int], list[int]]:
    """Token ids and labels (on the model's own parts only). whole: the exchange, call -> tool
    output -> answer, EOS; else the call then EOS, so a turn that is not stopped at </tool_call>
    ends right after it (as Qwen's </tool_call><|im_end|>)."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)   # noqa: E731
    p, c, eos = enc(prompt_text(a, b)), enc(call_text(a, b)), [tokenizer.eos_token_id]
    if not whole:
        return p + c + eos, [-100] * len(p) + c + eos
    t, ans = enc(tool_text(a, b)), enc(answer_text(a, b)) + eos
    return p + c + t + ans, [-100] * len(p) + c + [-100] * len(t) + ans


def train(tokenizer, steps: int = 250, batch_size: int = 32, lr: float = 5e-3, seed: int = 0):
    """SFT on random single-digit problems; ~250 steps reach greedy accuracy 100/100 (seconds on CPU)."""
    model = build_model(tokenizer, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.05, 1 - s / steps))
    rng = random.Random(seed)
    model.train()
    # One thread: these ops are tiny, and on a shared machine two threads can be many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loss = _steps(model, opt, sched, tokenizer, rng, steps, batch_size)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return model, loss


def _steps(model, opt, sched, tokenizer, rng, steps: int, batch_size: int) -> float:
    for _ in range(steps):
        rows = [example(tokenizer, rng.randint(0, 9), rng.randint(0, 9), whole=k % 4 != 0) for k in range(batch_size)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r, _ in rows])       # [B, S]
        lab = torch.tensor([lb + [-100] * (width - len(lb)) for _, lb in rows])                      # [B, S]
        logits = model(input_ids=ids).logits[:, :-1]                                               # [B, S-1, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return float(loss.item())


def bootstrap(model_dir: str, config=None, *, steps: int = 250, seed: int = 0, overwrite: bool = False) -> str:
    """`actor_rollout_ref.model.bootstrap: megarl.examples.tool_use:bootstrap`: train and save the
    model to `model_dir` and the tokenizer to `model_dir/tokenizer` (set model.tokenizer_path to it:
    next to a Qwen2 config.json, transformers 5 would load it as a Qwen2 tokenizer and lose spaces)."""
    if os.path.isfile(os.path.join(model_dir, "config.json")) and not overwrite:
        return model_dir
    tok = build_tokenizer()
    start = time.perf_counter()
    model, loss = train(tok, steps, seed=seed)
    parent = os.path.dirname(os.path.abspath(model_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".bootstrap-", dir=parent)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(os.path.join(tmp, "tokenizer"))
        with open(os.path.join(tmp, "sft.json"), "w") as f:
            json.dump({"steps": steps, "seed": seed, "final_loss": loss, "seconds": time.perf_counter() - start}, f)
        if os.path.isdir(model_dir):
            shutil.rmtree(model_dir)
        os.replace(tmp, model_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    print(f"megarl: trained the tool-use model ({steps} steps, {time.perf_counter() - start:.1f}s, final loss "
          f"{loss:.4f}) into {model_dir}")
    return model_dir


def write_data(out_dir: str, val_count: int = 20, seed: int = 0) -> None:
    """verl-format rows for every single-digit problem: prompt "Q: a+b\n", ground truth a+b."""
    problems = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(problems)
    os.makedirs(out_dir, exist_ok=True)
    for split, part in (("val", problems[:val_count]), ("train", problems[val_count:])):
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
            for a, b in part:
                f.write(json.dumps({"prompt": prompt_text(a, b), "data_source": "tool_use",
                                    "reward_model": {"ground_truth": str(a + b)}}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="model directory (tokenizer in <out>/tokenizer)")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--data", help="also write train/val rows here (e.g. data/tool_use)")
    args = ap.parse_args()
    bootstrap(args.out, steps=args.steps, overwrite=True)
    if args.data:
        write_data(args.data)


if __name__ == "__main__":
    main()
