"""Convert a megatron distributed checkpoint (any TP/PP layout) back to an HF directory.

    python checkpoints_tools/megatron_to_hf.py --ckpt path/to/ckpt --out path/to/hf [--dtype bfloat16]

Works in one process: the checkpoint's tensors are read whole and mapped with the pure functions
of megarl/models/convert.py. The output has config.json, safetensors and the tokenizer files
kept in the checkpoint's `hf/` folder, and loads with transformers. A critic checkpoint becomes a
*ForSequenceClassification model (one label). The dtype defaults to the source HF checkpoint's,
so HF -> megatron -> HF is bit-exact.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def export(ckpt: str, out: str, dtype: str | None = None) -> None:
    import torch
    import torch.distributed as dist

    from megarl.models.convert import checkpoint_to_hf
    from megarl.models.hf_checkpoint import save_hf
    from megarl.models.spec import ModelSpec
    from megarl.workers.checkpoint import HF_DIR, plain_tensors, read_meta

    if not dist.is_initialized():  # megatron's reader wants a process group; one rank is enough
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    check_sealed(ckpt)
    meta = read_meta(ckpt)
    config = dict(meta["hf_config"])
    spec = ModelSpec.from_hf_config(config)
    head = meta["head"]
    if head == "value":
        family = {"llama": "Llama", "qwen2": "Qwen2"}[spec.family]
        config.update(architectures=[f"{family}ForSequenceClassification"], num_labels=1,
                      id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    target = getattr(torch, dtype or meta["hf_dtype"])
    config["dtype"] = str(target).replace("torch.", "")
    tensors = checkpoint_to_hf(plain_tensors(ckpt), spec, head)
    save_hf(out, ((n, t.to(target)) for n, t in tensors), config, aux_from=os.path.join(ckpt, HF_DIR))


def check_sealed(ckpt: str) -> None:
    """A role directory of a step megarl saved (global_step_N/actor) is checked against the step's
    manifest first, as a resume checks it: torch's reader unpickles `.metadata`, so a file changed
    since the save is refused before it is read (verified_io.Refused)."""
    from megarl.trainer import verified_io
    for step in (ckpt, os.path.dirname(ckpt)):
        if os.path.isfile(os.path.join(step, verified_io.MANIFEST)):
            try:
                verified_io.verify(step)
            except verified_io.Refused as err:
                raise ValueError(f"refused {step}: {err}") from None
            return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="megatron distributed checkpoint directory")
    ap.add_argument("--out", required=True, help="HF directory to write")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="tensor dtype (default: the source HF checkpoint's)")
    a = ap.parse_args(argv)
    try:
        export(os.path.abspath(a.ckpt), os.path.abspath(a.out), a.dtype)
    except ValueError as err:
        print(f"megatron_to_hf: {err}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
