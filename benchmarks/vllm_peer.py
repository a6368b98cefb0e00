"""vLLM's side of benchmarks/rollout_throughput.py: vLLM through megarl's adapter
(rollout.name=vllm) on the benchmark's model, prompts and sampling settings, its rows and
log-probs checked once against the contract and transformers before it is timed. Joins where
vllm imports (the README's "Using vLLM"); runs on CPU only.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import torch

from megarl.rollout.base import SamplingParams


@contextlib.contextmanager
def _quiet_fds(log_path: str):
    """Send this process's stdout/stderr (file descriptors 1 and 2, so C++ warnings, progress bars
    and child processes started meanwhile too) to `log_path` for the duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def score(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of `tokens` after `prompt` under a transformers model (one forward)."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return lp.gather(1, ids[0, len(prompt):, None]).squeeze(1).tolist()


def vllm_runner(args, prompts, sp: SamplingParams, reference=None):
    """vLLM through megarl's adapter (rollout.name=vllm, megarl/rollout/vllm/): same model directory,
    prompts (token ids), n, lengths, temperature, seed and stop ids, log-probs in megarl's convention.
    Returns run() -> generated tokens, or None when vllm does not import. Before returning, one
    generate is checked: n rows per prompt, each ending on a stop id or at max_tokens, no stop id
    inside, and (with `reference`, a transformers model) its log-probs against that model's."""
    import tempfile
    if args.device != "cpu":
        print("  vllm: not run (megarl runs vLLM on CPU only)")
        return None
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    log = tempfile.NamedTemporaryFile(prefix="vllm_peer_", suffix=".log", delete=False).name
    t = time.perf_counter()
    try:
        with _quiet_fds(log):                                 # vLLM's import and start-up print a lot
            import vllm  # noqa: F401 - optional: the peer joins where it imports
    except Exception as err:                                  # noqa: BLE001 - any import failure means absent
        os.unlink(log)
        print(f"  vllm: not run ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
        return None
    from megarl.config.errors import ConfigError
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.vllm.engine import VLLMEngine
    longest = max(map(len, prompts))
    cfg = RolloutConfig(name="vllm", load_format="auto", dtype=args.dtype, free_cache_engine=False,
                        enable_sleep_mode=False, prompt_length=longest, response_length=sp.max_tokens,
                        max_num_seqs=max(len(prompts) * sp.n, 1))
    try:
        with _quiet_fds(log):
            engine = VLLMEngine(args.model_dir, cfg)
    except ConfigError as err:                                # a shape it refuses (head size): said, not run
        print(f"  vllm: not run ({err})")
        return None
    except Exception:
        print(f"  vllm: start-up failed; its log: {log}")
        raise
    start = time.perf_counter() - t
    stops = sp.stop_ids

    def run() -> int:
        return sum(len(c.token_ids) for g in engine.generate(prompts, sp) for c in g)

    groups = engine.generate(prompts, sp)                     # the check (and a first warm-up)
    rows = [(p, c) for p, g in zip(prompts, groups) for c in g]
    tokens = sum(len(c.token_ids) for _, c in rows)
    ended = sum(1 for _, c in rows if c.token_ids and c.token_ids[-1] in stops)
    at_max = sum(1 for _, c in rows if len(c.token_ids) == sp.max_tokens and c.token_ids[-1] not in stops)
    inside = sum(1 for _, c in rows if any(x in stops for x in c.token_ids[:-1]))
    lp_ok = all(len(c.log_probs) == len(c.token_ids) for _, c in rows)
    line = (f"  vllm check: {len(rows)} rows (expected {len(prompts)} x n={sp.n} = {len(prompts) * sp.n}), "
            f"{tokens} tokens; {ended} end on a stop id, {at_max} at max_tokens, {inside} with a stop id inside; "
            f"log-probs {'on every token' if lp_ok else 'MISSING'}")
    if reference is not None and lp_ok:
        diffs = [abs(a - b) for p, c in rows if c.token_ids
                 for a, b in zip(c.log_probs, score(reference, list(p), list(c.token_ids), sp.logprob_temperature))]
        line += f" (vs transformers on the same tokens: max |diff| {max(diffs):.1e}, mean {statistics.mean(diffs):.1e})"
    print(line)
    print(f"  vllm: {vllm.__version__} through megarl's adapter (rollout.name=vllm: in-process, eager), up in "
          f"{start:.0f} s, torch threads here {torch.get_num_threads()}; its log: {log}")
    if len(rows) != len(prompts) * sp.n or ended + at_max != len(rows) or inside or not lp_ok:
        raise RuntimeError("vllm's rows do not match the other engines' contract; see the check line above")
    return run
