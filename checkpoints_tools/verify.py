"""Check megarl's sharded model against transformers: same logits on fixed random tokens.

    python checkpoints_tools/verify.py --hf path/to/hf --tp 2 --pp 2 [--tol 1e-4]

Shards the HF model over TP x PP gloo processes (or the torchrun ranks), runs one fp32 forward
of `--batch` x `--seq` random tokens (seeded), gathers the logits and compares them with
transformers' own model in fp32. The last line printed is `max abs diff: <x>`; the exit status
is 1 when it exceeds --tol, 2 when the model or layout is refused.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.parallel.local_ranks import launched, run_local  # noqa: E402


def tokens(vocab: int, batch: int, seq: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def sharded_logits(rank: int, world: int, hf: str, tp: int, pp: int, batch: int, seq: int, seed: int):
    from megarl.parallel import state
    from megarl.workers.engine import EngineSpec, MegatronEngine
    state.init_distributed()   # the rank set-up: the engine starts no process group
    eng = MegatronEngine(EngineSpec(hf, tp=tp, pp=pp, trainable=False, dtype="float32"))
    out = eng.logits(tokens(eng.spec.vocab_size, batch, seq, seed))
    return out if rank == 0 else None


def reference_logits(hf: str, ids):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits.float()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    hf = os.path.abspath(a.hf)
    args = (hf, a.tp, a.pp, a.batch, a.seq, a.seed)
    try:
        from megarl.workers.preflight import EngineSpec, read_spec
        read_spec(EngineSpec(hf, tp=a.tp, pp=a.pp))  # refuse a bad model or layout before starting ranks
        if launched():
            rank = int(os.environ["RANK"])
            got = sharded_logits(rank, int(os.environ["WORLD_SIZE"]), *args)
            if rank != 0:
                return 0
        else:
            got = run_local(a.tp * a.pp, sharded_logits, args)[0]
    except ValueError as err:
        print(f"verify: {err}", file=sys.stderr)
        return 2
    ref = reference_logits(hf, tokens(got.shape[-1], a.batch, a.seq, a.seed))
    diff, status = compare(got, ref, a.tol)
    print(f"TP={a.tp} PP={a.pp} logits {tuple(got.shape)} tolerance {a.tol:g}")
    print(f"max abs diff: {diff:.3e}")
    return status


def compare(got, ref, tol: float) -> tuple[float, int]:
    """(max abs difference, exit status: 0 within tolerance, 1 above)."""
    diff = (got - ref).abs().max().item()
    return diff, 0 if diff <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
