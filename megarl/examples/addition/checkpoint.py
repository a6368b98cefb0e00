"""Create the quickstart's checkpoint: tokenizer, small Qwen2 model, brief supervised warm start.

    python -m megarl.examples.addition.checkpoint runs/models/addition     # or via the config:
    actor_rollout_ref.model.bootstrap: megarl.examples.addition:bootstrap

The result is a plain HF directory (config.json, model.safetensors, tokenizer files, and
warmstart.json with the measured held-out accuracy), so every other part of megarl loads it
like any downloaded checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator

import torch

from megarl.examples.addition.model import build_model, build_tokenizer
from megarl.examples.addition.task import AdditionTask
from megarl.examples.addition.warmstart import accuracy, held_out, supervised_train

# Tuned so held-out accuracy after the warm start is clearly below the ceiling (about 0.4
# greedy, 0.3 sampled at T=1) while a few hundred more supervised steps reach ~0.85: see
# benchmarks/addition_task.py for the measurements.
DEFAULT_WARM_START_STEPS = 350
DEFAULT_LR = 1e-3


def bootstrap(model_dir: str, config=None, *, warm_start_steps: int = DEFAULT_WARM_START_STEPS, seed: int = 0,
              min_digits: int = AdditionTask.min_digits, max_digits: int = AdditionTask.max_digits,
              long_digits: int = 0, long_fraction: float = 0.0,
              batch_size: int = 64, lr: float = DEFAULT_LR, eval_rows: int = 512, num_threads: int = 1,
              overwrite: bool = False, verbose: bool = True, **model_overrides) -> str:
    """Build and warm-start the model into `model_dir` unless it already holds a checkpoint.

    `config` (the experiment config, when the trainer passes it) is not needed; the keyword
    arguments come from `actor_rollout_ref.model.bootstrap_kwargs`.

    Written to a temporary sibling directory and renamed at the end, so an interrupted run never
    leaves a half-written checkpoint that a later run would take for a finished one. Under a lock
    beside it: a second launch on the same fresh path waits for the first's model and uses it.
    """
    if os.path.isfile(os.path.join(model_dir, "config.json")) and not overwrite:
        return model_dir
    with building(model_dir, verbose):
        if os.path.isfile(os.path.join(model_dir, "config.json")) and not overwrite:
            return model_dir             # built by the launch this one waited for
        return _build_threads(model_dir, warm_start_steps, seed, min_digits, max_digits, long_digits, long_fraction,
                              batch_size, lr, eval_rows, num_threads, verbose, model_overrides)


@contextlib.contextmanager
def building(model_dir: str, verbose: bool = True) -> Iterator[None]:
    """An exclusive flock on <parent>/.<name>.lock, as the run directory is locked
    (megarl/parallel/lifecycle.py RunDirLock): "pid host" of the holder inside, dropped by the
    kernel however the holder exits; a second builder waits, saying for whom."""
    parent = os.path.dirname(os.path.abspath(model_dir))
    os.makedirs(parent, exist_ok=True)
    path = os.path.join(parent, f".{os.path.basename(os.path.abspath(model_dir))}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (os.pread(fd, 256, 0).decode(errors="replace").split() + ["?", "?"])[:2]
            if verbose:
                print(f"megarl: waiting for pid {holder[0]} on host {holder[1]}, which is building {model_dir}",
                      flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _build_threads(model_dir, warm_start_steps, seed, min_digits, max_digits, long_digits, long_fraction, batch_size,
                   lr, eval_rows, num_threads, verbose, model_overrides) -> str:
    # One intra-op thread: this model's ops are too small to split, and on a busy 2-core machine
    # two OpenMP threads measured far slower than one (benchmarks/addition_task.py --compare-threads).
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        task = AdditionTask(min_digits, max_digits, long_digits, long_fraction)
        return _build(model_dir, warm_start_steps, seed, task, batch_size, lr, eval_rows, verbose, model_overrides)
    finally:
        torch.set_num_threads(previous)


def _build(model_dir, warm_start_steps, seed, task: AdditionTask, batch_size, lr, eval_rows, verbose,
           model_overrides) -> str:
    tok = build_tokenizer()
    model = build_model(tok, seed=seed, **model_overrides)
    val = held_out(task, eval_rows)
    say = print if verbose else (lambda *a, **k: None)
    say(f"megarl: bootstrapping the addition model into {model_dir} "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {warm_start_steps} warm-start steps)")
    stats = supervised_train(model, tok, task, warm_start_steps, batch_size=batch_size, lr=lr,
                             exclude=set(val), log_every=max(1, warm_start_steps // 5) if verbose else 0)
    t0 = time.perf_counter()
    stats["val_accuracy_greedy"] = accuracy(model, tok, val, temperature=0.0)
    stats["val_accuracy_t1"] = accuracy(model, tok, val, temperature=1.0, seed=seed)
    stats["eval_seconds"] = time.perf_counter() - t0
    stats.update(task=dataclasses.asdict(task),
                 seed=seed, batch_size=batch_size, lr=lr)
    say(f"megarl: warm start done in {stats['seconds']:.1f}s; held-out accuracy greedy "
        f"{stats['val_accuracy_greedy']:.3f}, sampled at T=1 {stats['val_accuracy_t1']:.3f}")

    parent = os.path.dirname(os.path.abspath(model_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".bootstrap-", dir=parent)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "warmstart.json"), "w") as f:
            json.dump(stats, f, indent=2)
        # One rename puts the whole model in place; an old one (overwrite) is moved aside first and
        # removed after, so the path never holds half of either.
        old = tempfile.mkdtemp(prefix=".replaced-", dir=parent) if os.path.lexists(model_dir) else None
        if old is not None:
            os.replace(model_dir, os.path.join(old, "model"))
        os.replace(tmp, model_dir)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    return model_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--steps", type=int, default=DEFAULT_WARM_START_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    bootstrap(args.model_dir, warm_start_steps=args.steps, seed=args.seed, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
