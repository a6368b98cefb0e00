"""Convert an HF checkpoint directory into a megatron distributed checkpoint.

    python checkpoints_tools/hf_to_megatron.py --hf path/to/hf --out path/to/ckpt --tp 2 --pp 2
    torchrun --nproc_per_node 4 checkpoints_tools/hf_to_megatron.py --hf ... --out ... --tp 2 --pp 2

Without a launcher it starts TP x PP local processes itself (gloo on CPU, NCCL on GPU). Each rank
reads only its own slices of the safetensors files. The result reloads under any (TP, PP)
(megatron dist_checkpointing), e.g. through `megatron.dist_checkpointing_path` in a megarl
config, and converts back with `megatron_to_hf.py --trust-unsealed-checkpoint` (no step manifest
seals it: the flag says you trust it). `--head value` writes a critic (the HF checkpoint's `score`
head when it has one, else zeros).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.parallel.local_ranks import launched, run_local  # noqa: E402


def convert(rank: int, world: int, hf: str, out: str, tp: int, pp: int, head: str) -> None:
    from megarl.parallel import state
    from megarl.workers.engine import EngineSpec, MegatronEngine
    state.init_distributed()   # the rank set-up: the engine starts no process group
    eng = MegatronEngine(EngineSpec(hf, tp=tp, pp=pp, head=head, trainable=False, dtype="float32",
                                    head_from_checkpoint=head == "value" and _has_score(hf)))
    eng.save_checkpoint(out, with_optimizer=False)


def _has_score(hf: str) -> bool:
    from megarl.models.hf_checkpoint import HFCheckpoint
    return "score.weight" in HFCheckpoint(hf)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--out", required=True, help="directory for the megatron distributed checkpoint")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--head", choices=["lm", "value"], default="lm")
    a = ap.parse_args(argv)
    args = (os.path.abspath(a.hf), os.path.abspath(a.out), a.tp, a.pp, a.head)
    try:
        from megarl.workers.preflight import EngineSpec, read_spec
        # Refuse a bad model, checkpoint or layout here, before any rank starts.
        read_spec(EngineSpec(args[0], tp=a.tp, pp=a.pp, head=a.head,
                             head_from_checkpoint=a.head == "value" and _has_score(args[0])))
        if launched():
            convert(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), *args)
        else:
            run_local(a.tp * a.pp, convert, args)
    except ValueError as err:
        print(f"hf_to_megatron: {err}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"wrote {a.out} (TP={a.tp} PP={a.pp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
