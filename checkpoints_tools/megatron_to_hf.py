"""Convert a megatron distributed checkpoint (any TP/PP layout) back to an HF directory.

    python checkpoints_tools/megatron_to_hf.py --ckpt path/to/ckpt --out path/to/hf [--dtype bfloat16]

Works in one process: the checkpoint's tensors are read whole and mapped with the pure functions
of megarl/models/convert.py. The output has config.json, safetensors and the tokenizer files
kept in the checkpoint's `hf/` folder, and loads with transformers. A critic checkpoint becomes a
*ForSequenceClassification model (one label). The dtype defaults to the source HF checkpoint's,
so HF -> megatron -> HF is bit-exact.

A checkpoint of a LoRA run (actor_rollout_ref.model.lora_rank > 0) becomes the merged model
(W + alpha/r B A, PEFT's merge_and_unload); `--peft-adapter DIR` also writes the adapters alone
as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for the base model:

    python checkpoints_tools/megatron_to_hf.py --ckpt ckpt/global_step_50/actor --out merged --peft-adapter adapter
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def export(ckpt: str, out: str, dtype: str | None = None, peft_adapter: str | None = None) -> None:
    import torch
    import torch.distributed as dist

    from megarl.models.convert import checkpoint_to_hf
    from megarl.models.hf_checkpoint import save_hf
    from megarl.models.lora_options import checkpoint_adapters, is_adapter_name, merge_into_hf
    from megarl.models.spec import ModelSpec
    from megarl.workers.checkpoint import HF_DIR, plain_tensors, read_meta, saved_converters

    if not dist.is_initialized():  # megatron's reader wants a process group; one rank is enough
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    with sealed_source(ckpt) as src:   # the checked bytes: in place, or a private copy (staging.py)
        meta = read_meta(src)
        config = dict(meta["hf_config"])
        spec = ModelSpec.from_hf_config(config)
        head = meta["head"]
        if head == "value":
            family = {"llama": "Llama", "qwen2": "Qwen2"}[spec.family]
            config.update(architectures=[f"{family}ForSequenceClassification"], num_labels=1,
                          id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        target = getattr(torch, dtype or meta["hf_dtype"])
        config["dtype"] = str(target).replace("torch.", "")
        whole = plain_tensors(src)
        lora = saved_converters(meta).get("lora")
        if peft_adapter and not lora:
            raise ValueError(f"{ckpt}: holds no LoRA adapters (saved without lora_rank); drop --peft-adapter")
        adapters = checkpoint_adapters(whole)
        tensors = checkpoint_to_hf({k: v for k, v in whole.items() if not is_adapter_name(k)}, spec, head)
        if lora:
            tensors = merge_into_hf(tensors, adapters, lora["alpha"] / lora["rank"])
        save_hf(out, ((n, t.to(target)) for n, t in tensors), config,
                aux_from=os.path.join(src, HF_DIR))
        if peft_adapter:
            _save_peft(peft_adapter, adapters, lora, target)


def _save_peft(out: str, adapters: dict, lora: dict, dtype) -> None:
    import json

    from safetensors.torch import save_file

    from megarl.models.lora_options import peft_config
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(peft_config(lora, None), f, indent=2)
    save_file({k: v.to(dtype).contiguous() for k, v in adapters.items()},
              os.path.join(out, "adapter_model.safetensors"))


@contextlib.contextmanager
def sealed_source(ckpt: str):
    """A role directory of a step megarl saved (global_step_N/actor) is checked against the step's
    manifest first, as a resume checks it: torch's reader unpickles `.metadata`, so a file changed
    since the save is refused before it is read (verified_io.Refused). Yields the directory to read:
    `ckpt`, or its checked private copy where another user could change the path to it
    (megarl/trainer/staging.py). A checkpoint outside a sealed step is read where it is."""
    from megarl.trainer import staging, verified_io
    step = os.path.dirname(ckpt)
    if not os.path.isfile(os.path.join(step, verified_io.MANIFEST)):
        yield ckpt
        return
    try:
        digests = verified_io.verify(step)
        with staging.megatron_source(step, digests, [os.path.basename(ckpt)], say=print) as src:
            yield os.path.join(src, os.path.basename(ckpt))
    except verified_io.Refused as err:
        raise ValueError(f"refused {step}: {err}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="megatron distributed checkpoint directory")
    ap.add_argument("--out", required=True, help="HF directory to write")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="tensor dtype (default: the source HF checkpoint's)")
    ap.add_argument("--peft-adapter", default=None,
                    help="a LoRA checkpoint: also write its adapters as a PEFT adapter directory here")
    a = ap.parse_args(argv)
    try:
        export(os.path.abspath(a.ckpt), os.path.abspath(a.out), a.dtype,
               os.path.abspath(a.peft_adapter) if a.peft_adapter else None)
    except ValueError as err:
        print(f"megatron_to_hf: {err}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
