"""Convert a megatron distributed checkpoint (any TP/PP layout) back to an HF directory.

    python checkpoints_tools/megatron_to_hf.py --ckpt run/global_step_N/actor --out path/to/hf [--dtype bfloat16]

The role directory of a step megarl saved is checked against the step's manifest first (as a
resume is); a checkpoint no manifest vouches for (hf_to_megatron.py's output, a link out of a step)
is refused unless `--trust-unsealed-checkpoint` says every file in it is trusted: torch unpickles
its `.metadata`. An --out (or --peft-adapter) that already holds weight files is refused unless
`--overwrite`, which removes them, so no stale shard or index is left beside the export.

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
import stat
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def export(ckpt: str, out: str, dtype: str | None = None, peft_adapter: str | None = None, *,
           trust_unsealed: bool = False, overwrite: bool = False) -> None:
    from megarl.models.hf_checkpoint import check_target, save_hf

    # Refused here, before megatron is imported, a process group starts or the checkpoint is read.
    step = sealed_step(ckpt, trust_unsealed)
    dirs = [d for d in (out, peft_adapter) if d]
    for d in dirs:
        check_target(d, overwrite)
        private_target(d, make=False)

    import torch
    import torch.distributed as dist

    from megarl.models.convert import checkpoint_to_hf
    from megarl.models.lora_options import checkpoint_adapters, is_adapter_name, merge_into_hf
    from megarl.models.spec import ModelSpec
    from megarl.workers.checkpoint import HF_DIR, plain_tensors, read_meta
    if not dist.is_initialized():  # megatron's reader wants a process group; one rank is enough
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    with sealed_source(ckpt, step) as src:   # the checked bytes, held open (staging.py)
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
        lora = _saved_lora(ckpt, meta)
        if peft_adapter and not lora:
            raise ValueError(f"{ckpt}: holds no LoRA adapters (saved without lora_rank); drop --peft-adapter")
        whole = plain_tensors(src)
        adapters = checkpoint_adapters(whole)
        tensors = checkpoint_to_hf({k: v for k, v in whole.items() if not is_adapter_name(k)}, spec, head)
        _check_adapters(ckpt, whole, adapters, lora, [n for n, _ in tensors])
        if lora:
            tensors = merge_into_hf(tensors, adapters, lora.scale)
        for d in dirs:
            private_target(d, make=True)
        save_hf(out, ((n, t.to(target)) for n, t in tensors), config,
                aux_from=os.path.join(src, HF_DIR), overwrite=overwrite)
        if peft_adapter:
            _save_peft(peft_adapter, adapters, lora, target, overwrite)


def _saved_lora(ckpt: str, meta: dict):
    """The checkpoint's LoRA options, checked (megarl/models/lora.py), or None without LoRA."""
    from megarl.models.lora import saved_options
    from megarl.workers.checkpoint import saved_converters
    if "lora" not in saved_converters(meta):
        return None
    try:
        return saved_options(saved_converters(meta)["lora"])
    except ValueError as err:
        raise ValueError(f"{ckpt}: {err}") from None


def _check_adapters(ckpt: str, whole: dict, adapters: dict, lora, hf_names: list[str]) -> None:
    """Every adapter tensor the checkpoint holds is merged, and every targeted projection has one:
    an export that left adapters out would write the base model under the trained one's name."""
    from megarl.models.lora_options import is_adapter_name
    if lora is None:
        unused = sorted(k for k in whole if is_adapter_name(k))
        if unused:
            raise ValueError(f"{ckpt}: {len(unused)} tensors the export does not use ({', '.join(unused[:3])}"
                             f"{', ...' if len(unused) > 3 else ''}): LoRA adapters, but the saved metadata has "
                             "no `lora` entry to merge them with; export from the step as megarl saved it")
        return
    merged = {f"base_model.model.{n.removesuffix('.weight')}.lora_{w}.weight"
              for n in hf_names if n.endswith(".weight") and n.split(".")[-2] in lora.target_modules for w in "AB"}
    unused = sorted(set(adapters) - merged)
    if unused:
        raise ValueError(f"{ckpt}: {len(unused)} tensors the export does not use ({', '.join(unused[:3])}"
                         f"{', ...' if len(unused) > 3 else ''}): adapters outside the saved "
                         f"lora.target_modules {list(lora.target_modules)}")
    missing = sorted(merged - set(adapters))
    if missing:
        raise ValueError(f"{ckpt}: the saved lora.target_modules {list(lora.target_modules)} need "
                         f"{len(missing)} adapter tensors it does not hold ({', '.join(missing[:3])}"
                         f"{', ...' if len(missing) > 3 else ''})")


def _save_peft(out: str, adapters: dict, lora, dtype, overwrite: bool) -> None:
    import json

    from safetensors.torch import save

    from megarl.models.hf_checkpoint import check_target, write_new
    from megarl.models.lora_options import peft_config
    for name in check_target(out, overwrite):
        os.remove(os.path.join(out, name))
    opts = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "target_modules": lora.target_modules}
    write_new(out, "adapter_config.json", json.dumps(peft_config(opts, None), indent=2).encode())
    write_new(out, "adapter_model.safetensors", save({k: v.to(dtype).contiguous() for k, v in adapters.items()}))


def private_target(path: str, make: bool) -> None:
    """An export directory is checked as a run directory is: yours, and writable by you alone, so
    nobody else can plant links or swap files in it; every file goes in through that directory
    opened without following a link (hf_checkpoint.write_new), so a directory above it that others
    may write (a group's project space) cannot redirect the export, and is only noted. `make`:
    create it (mode 0755 whatever the umask); else check it if it is there."""
    from megarl.trainer.checkpoints.staging import open_to_others
    from megarl.trainer.checkpoints.verified_io import check_owner
    real = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    if make and not os.path.lexists(real):
        os.makedirs(os.path.dirname(real), exist_ok=True)
        os.mkdir(real, 0o755)
        os.chmod(real, 0o755)
    if not os.path.lexists(real):
        return
    st = os.lstat(real)
    why = ((stat.S_ISLNK(st.st_mode) and f"{real} is a symbolic link")
           or (not stat.S_ISDIR(st.st_mode) and f"{real} is not a directory")
           or ((bad := check_owner(st)) and f"{real} {bad}"))
    if why:
        raise ValueError(f"refused to export into {path}: {why}, so another user could plant links or files "
                         "where the export writes; export into a directory only you can write, then share it")
    if make and (note := open_to_others(real)):
        print(f"megatron_to_hf: note: {note}; the export's files are written inside {real} without following "
              "links, but whoever may write above it can move the finished directory", file=sys.stderr)


def sealed_step(ckpt: str, trust_unsealed: bool) -> str | None:
    """The step directory (links resolved) whose manifest vouches for `ckpt`, or None for a
    checkpoint the user trusts without one. torch's reader unpickles `.metadata`, so a checkpoint
    nothing vouches for is refused unless the user says in so many words that it is trusted."""
    from megarl.trainer.checkpoints.verified_io import MANIFEST
    real = os.path.realpath(ckpt)
    if os.path.lexists(os.path.join(real, MANIFEST)):
        raise ValueError(f"{ckpt} is a step directory; point --ckpt at one of its roles ({ckpt}/actor)")
    step = os.path.dirname(real)
    if os.path.lexists(os.path.join(step, MANIFEST)):
        return step
    if trust_unsealed:
        return None
    raise ValueError(f"{ckpt}: no {MANIFEST} in {step} vouches for its files, and torch runs the pickle in "
                     "its .metadata; export a role directory of a step megarl saved (global_step_N/actor), or "
                     "pass --trust-unsealed-checkpoint if you trust every file in it")


@contextlib.contextmanager
def sealed_source(ckpt: str, step: str | None):
    """A role directory of a step megarl saved (global_step_N/actor) is checked against the step's
    manifest first, as a resume checks it: a file changed since the save is refused before torch
    reads it (verified_io.Refused). Yields the directory to read: the checked step, held open so a
    rename above it changes nothing read (megarl/trainer/checkpoints/staging.py).
    `step` None: a checkpoint the user trusts, read where it is."""
    from megarl.trainer.checkpoints import staging, verified_io
    if step is None:
        yield ckpt
        return
    role = os.path.basename(os.path.realpath(ckpt))
    try:
        with staging.checked_step(step, [role], say=print) as (src, _):
            yield os.path.join(src, role)
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
    ap.add_argument("--trust-unsealed-checkpoint", action="store_true",
                    help="read a checkpoint no step manifest vouches for (e.g. hf_to_megatron.py's output): "
                         "torch unpickles its .metadata, so only one whose every file you trust")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the weight files already in --out / --peft-adapter (they are removed first)")
    a = ap.parse_args(argv)
    try:
        export(os.path.abspath(a.ckpt), os.path.abspath(a.out), a.dtype,
               os.path.abspath(a.peft_adapter) if a.peft_adapter else None,
               trust_unsealed=a.trust_unsealed_checkpoint, overwrite=a.overwrite)
    except ValueError as err:
        print(f"megatron_to_hf: {err}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
