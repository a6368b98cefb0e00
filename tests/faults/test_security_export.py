"""checkpoints_tools/megatron_to_hf.py against checkpoints and export directories crafted against it,
on a real LoRA actor checkpoint (megatron-core, one gloo rank) sealed as megarl seals a step:

  - a step without manifest.json, its `.metadata` a pickle that writes a marker file when loaded:
    refused in one line naming --trust-unsealed-checkpoint, the marker never written (with the
    flag, the control: the same file does run);
  - --ckpt a symlink to a sealed step's actor/ whose `.metadata` changed: the link is resolved and
    the step's manifest refuses the file; through a link to an intact step the export is the same;
  - the saved `lora` entry removed (adapters left in place), or with a rank of 0 or "4", an alpha
    that is text, unknown targets, targets that leave adapters out: one line naming the tensors or
    the field, exit 2, nothing written;
  - an --out holding an older sharded model: refused without --overwrite; with it the stale shards
    and index are gone and megarl's reader and transformers read the same new weights; megarl's
    reader refuses a directory holding both model.safetensors and an index;
  - a link planted where the export writes a file is replaced, its target untouched; an --out that
    others may write, or whose parent others may write, is refused before anything is read.

    python -m pytest -q tests/faults/test_security_export.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megarl.models.hf_checkpoint import HFCheckpoint, save_hf, weight_files
from megarl.models.tiny import make_tiny_hf
from megarl.trainer.checkpoints import verified_io
from tests.distributed import run_ranks
from tests.helpers.hostile import write_hostile

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "target_modules": "all-linear"}


def _save_lora_step(rank, world, model: str, role_dir: str) -> None:
    from megarl.models import lora
    from tests.helpers.megatron_roles import make_actor
    actor = make_actor(model, 2, lora=LORA)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():                 # B = 0 at the start would make the merge a no-op
        for adapter in lora.adapters(actor.engine.models):
            for p in adapter.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    actor.engine.save_checkpoint(role_dir)


def _run_exports(rank, world, cases: list) -> dict:
    """main(argv) for each case in this one process: (exit status or the exception, stderr lines)."""
    import contextlib
    import io

    from checkpoints_tools.megatron_to_hf import main
    out = {}
    for name, argv in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                status = main(argv)
            except BaseException as exc:  # noqa: BLE001  (the old code's tracebacks are the failure shown)
                status = f"{type(exc).__name__}: {exc}"
        out[name] = (status, err.getvalue().strip().splitlines())
    return out


def _step_copy(step: str, root, name: str) -> str:
    """The sealed step copied under a private run directory of its own."""
    run = root / name
    run.mkdir(mode=0o700)
    dst = str(run / os.path.basename(step))
    shutil.copytree(step, dst)
    return dst


def _edit_lora(step: str, edit) -> None:
    """Change the `lora` entry megarl saved in actor/common.pt, then re-seal the step to match."""
    path = os.path.join(step, "actor", "common.pt")
    common = torch.load(path, weights_only=False)        # our own file, written by the fixture
    converters = common["megarl"]["converters"]
    edit(converters)
    torch.save(common, path)
    verified_io.seal(step)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    os.chmod(root, 0o700)
    model = make_tiny_hf(str(root / "model"), "qwen2", seed=6, num_hidden_layers=2)
    run = root / "run"
    run.mkdir(mode=0o700)
    step = str(run / "global_step_1")
    run_ranks(1, _save_lora_step, (model, os.path.join(step, "actor")))
    verified_io.seal(step)
    return {"root": root, "model": model, "step": step}


@pytest.fixture(scope="module")
def exports(world):
    """Every crafted case, prepared here and exported in one rank process (megatron's reader needs
    a process group); markers are the files a hostile pickle would write."""
    root, step, cases, markers = world["root"], world["step"], [], {}
    out = lambda name: ["--out", str(root / "out" / name), "--dtype", "float32"]   # noqa: E731

    cases.append(("intact", ["--ckpt", os.path.join(step, "actor"), *out("intact"),
                             "--peft-adapter", str(root / "out" / "adapter")]))
    # 1. no manifest, a hostile .metadata: refused; trusted by name, it runs (the control).
    for name, flag in (("unsealed", []), ("unsealed-trusted", ["--trust-unsealed-checkpoint"])):
        copy = _step_copy(step, root, name)
        os.remove(os.path.join(copy, verified_io.MANIFEST))
        markers[name] = str(root / f"marker-{name}")
        write_hostile(os.path.join(copy, "actor", ".metadata"), markers[name])
        cases.append((name, ["--ckpt", os.path.join(copy, "actor"), *out(name), *flag]))
    # 2. --ckpt a link to actor/ of a sealed step: the step's manifest judges what is read.
    (root / "links").mkdir()
    for name, hostile in (("link", False), ("link-hostile", True)):
        copy = _step_copy(step, root, name)
        if hostile:
            markers[name] = str(root / f"marker-{name}")
            write_hostile(os.path.join(copy, "actor", ".metadata"), markers[name])
        os.symlink(os.path.join(copy, "actor"), root / "links" / name)
        cases.append((name, ["--ckpt", str(root / "links" / name), *out(name)]))
    # 3. the saved LoRA metadata changed (and re-sealed, as its owner could).
    lora_edits = {
        "no-lora-entry": lambda c: c.pop("lora"),
        "rank-0": lambda c: c["lora"].update(rank=0),
        "rank-text": lambda c: c["lora"].update(rank="4"),
        "alpha-text": lambda c: c["lora"].update(alpha="8"),
        "targets-unknown": lambda c: c["lora"].update(target_modules=["qkv"]),
        "targets-fewer": lambda c: c["lora"].update(target_modules=["q_proj", "v_proj"]),
    }
    for name, edit in lora_edits.items():
        copy = _step_copy(step, root, name)
        _edit_lora(copy, edit)
        cases.append((name, ["--ckpt", os.path.join(copy, "actor"), *out(name)]))
    # 4. --out holding an older sharded model (the base, in shards under an index).
    base = load_file(os.path.join(world["model"], "model.safetensors"))
    config = HFCheckpoint(world["model"]).config
    for name in ("stale", "stale-overwrite"):
        save_hf(str(root / "out" / name), base.items(), dict(config), max_shard_bytes=200_000)
    cases.append(("stale", ["--ckpt", os.path.join(step, "actor"), *out("stale")]))
    cases.append(("stale-overwrite", ["--ckpt", os.path.join(step, "actor"), *out("stale-overwrite"), "--overwrite"]))
    # 5. where the export writes: a planted link is replaced, never followed; an open directory refused.
    (root / "victim.txt").write_text("mine")
    (root / "out" / "planted").mkdir()
    os.symlink(root / "victim.txt", root / "out" / "planted" / "config.json")
    cases.append(("planted", ["--ckpt", os.path.join(step, "actor"), *out("planted")]))
    (root / "out" / "open").mkdir()
    os.chmod(root / "out" / "open", 0o777)            # a project space: any user may add entries above the export
    cases.append(("open-parent", ["--ckpt", os.path.join(step, "actor"), "--out", str(root / "out" / "open" / "hf")]))
    (root / "out" / "group-writable").mkdir()
    os.chmod(root / "out" / "group-writable", 0o770)  # the export directory itself: others could plant in it
    cases.append(("group-writable", ["--ckpt", os.path.join(step, "actor"), *out("group-writable")]))
    results = run_ranks(1, _run_exports, (cases,))[0]
    return {"results": results, "markers": markers, "out": root / "out", "base": base, "root": root}


def refusal(exports, name: str) -> str:
    """The case's one line: exit 2, the refusal the last line of stderr, no traceback, nothing written."""
    status, lines = exports["results"][name]
    assert status == 2, (name, status, lines[-20:])
    assert not any("Traceback" in line for line in lines), (name, lines)
    assert not os.path.exists(exports["out"] / name), name
    return lines[-1]


def test_an_unsealed_checkpoint_is_refused_unless_trusted_by_name(exports):
    line = refusal(exports, "unsealed")
    assert line.startswith("megatron_to_hf: ") and "no manifest.json" in line and "--trust-unsealed-checkpoint" \
        in line, line
    assert not os.path.exists(exports["markers"]["unsealed"]), "the hostile .metadata ran"
    # the control: the same file, trusted by the user, is unpickled by torch's reader
    assert os.path.exists(exports["markers"]["unsealed-trusted"]), exports["results"]["unsealed-trusted"]


def test_an_unsealed_checkpoint_is_one_line_at_the_command_line(world, tmp_path):
    copy = _step_copy(world["step"], tmp_path, "cli")
    os.remove(os.path.join(copy, verified_io.MANIFEST))
    marker = str(tmp_path / "marker")
    write_hostile(os.path.join(copy, "actor", ".metadata"), marker)
    got = subprocess.run([sys.executable, "checkpoints_tools/megatron_to_hf.py", "--ckpt", os.path.join(copy, "actor"),
                          "--out", str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert got.returncode == 2 and got.stderr.strip().splitlines() == [
        f"megatron_to_hf: {os.path.join(copy, 'actor')}: no manifest.json in {copy} vouches for its files, and torch "
        "runs the pickle in its .metadata; export a role directory of a step megarl saved (global_step_N/actor), or "
        "pass --trust-unsealed-checkpoint if you trust every file in it"], got.stderr[-3000:]
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "hf")


def test_a_link_to_a_sealed_step_is_judged_by_that_steps_manifest(exports):
    line = refusal(exports, "link-hostile")
    assert "refused " in line and "global_step_1: actor/.metadata " in line, line
    assert not os.path.exists(exports["markers"]["link-hostile"]), "the hostile .metadata ran"
    assert exports["results"]["link"][0] == 0, exports["results"]["link"]
    a, b = load_file(exports["out"] / "intact" / "model.safetensors"), load_file(exports["out"] / "link" /
                                                                                   "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_metadata_that_would_drop_or_break_the_merge_is_refused_naming_it(exports):
    assert exports["results"]["intact"][0] == 0, exports["results"]["intact"]
    merged = load_file(exports["out"] / "intact" / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (merged[q] - exports["base"][q].float()).abs().max() > 1e-2     # the adapters change the weights
    assert os.path.isfile(exports["out"] / "adapter" / "adapter_config.json")
    expect = {
        "no-lora-entry": "tensors the export does not use (decoder.layers.mlp.linear_fc1_lora.A_gate_proj, ",
        "rank-0": "saved LoRA metadata: lora.rank is 0 (int); a LoRA rank is a positive integer",
        "rank-text": "saved LoRA metadata: lora.rank is '4' (str); a LoRA rank is a positive integer",
        "alpha-text": "saved LoRA metadata: lora.alpha is '8' (str); lora_alpha is a finite number",
        "targets-unknown": "saved LoRA metadata: lora.target_modules: 'qkv' is not a linear megarl adapts",
        "targets-fewer": "tensors the export does not use (base_model.model.model.layers.0.mlp.down_proj.lora_A",
    }
    for name, text in expect.items():
        line = refusal(exports, name)
        assert line.startswith("megatron_to_hf: ") and text in line, (name, line)


def test_an_export_over_an_older_sharded_model_leaves_one_version(exports):
    line = refusal_kept(exports, "stale")
    assert "already holds model weights (model-00001-of-0000" in line and "--overwrite" in line, line
    status, lines = exports["results"]["stale-overwrite"]
    assert status == 0, lines[-20:]
    new = exports["out"] / "stale-overwrite"
    assert weight_files(str(new)) == ["model.safetensors"]
    ours = HFCheckpoint(str(new))
    fresh = load_file(exports["out"] / "intact" / "model.safetensors")
    assert sorted(ours.names()) == sorted(fresh) and all(torch.equal(ours.read_full(k), fresh[k]) for k in fresh)


def refusal_kept(exports, name: str) -> str:
    """A refused export into a directory that exists already: exit 2, one line, its files untouched."""
    status, lines = exports["results"][name]
    assert status == 2 and not any("Traceback" in line for line in lines), (name, status, lines[-20:])
    assert weight_files(str(exports["out"] / name))[-1] == "model.safetensors.index.json"
    return lines[-1]


def test_megarls_reader_refuses_a_directory_holding_both_forms(tmp_path):
    model = make_tiny_hf(str(tmp_path / "m"), "qwen2", seed=7, num_hidden_layers=1, tokenizer=False)
    tensors = load_file(os.path.join(model, "model.safetensors"))
    save_hf(str(tmp_path / "both"), tensors.items(), dict(HFCheckpoint(model).config), max_shard_bytes=100_000)
    shutil.copyfile(os.path.join(model, "model.safetensors"), tmp_path / "both" / "model.safetensors")
    with pytest.raises(ValueError, match=r"both: holds both model.safetensors and model.safetensors.index.json, two "
                                         r"versions of the weights \(transformers reads the first, the index names "
                                         r"others\); remove the stale one"):
        HFCheckpoint(str(tmp_path / "both")).names()


def test_an_export_writes_no_file_through_a_link_and_nothing_into_a_directory_others_can_write(exports):
    status, lines = exports["results"]["planted"]
    assert status == 0, lines[-20:]
    planted = exports["out"] / "planted" / "config.json"
    assert (exports["root"] / "victim.txt").read_text() == "mine"            # the link's target untouched
    assert not os.path.islink(planted) and json.loads(planted.read_text())["model_type"] == "qwen2"
    assert not [n for n in os.listdir(exports["out"] / "planted") if n.endswith(".tmp")]
    open_dir = exports["out"] / "open"
    status, lines = exports["results"]["open-parent"]            # written inside its own private directory
    assert status == 0, lines[-20:]
    assert any(line.startswith(f"megatron_to_hf: note: {open_dir} is writable by group and others") for line in lines)
    assert oct(os.stat(open_dir / "hf").st_mode & 0o777) == "0o755"
    assert json.loads((open_dir / "hf" / "config.json").read_text())["model_type"] == "qwen2"
    status, lines = exports["results"]["group-writable"]
    assert status == 2 and lines[-1] == (f"megatron_to_hf: refused to export into {exports['out']}/group-writable: "
                                         f"{exports['out']}/group-writable is writable by group (mode 770), so another "
                                         "user could plant links or files where the export writes; export into a "
                                         "directory only you can write, then share it"), lines[-20:]
    assert os.listdir(exports["out"] / "group-writable") == []


def test_a_file_is_never_written_through_a_directory_swapped_for_a_link(tmp_path):
    """write_new opens the export directory without following a link: a directory replaced by a
    link to another of the user's directories makes the write fail, the other directory untouched."""
    from megarl.models.hf_checkpoint import write_new
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "hf")
    with pytest.raises(OSError):
        write_new(str(tmp_path / "hf"), "config.json", b"{}")
    assert os.listdir(tmp_path / "elsewhere") == []
    (tmp_path / "real").mkdir()
    write_new(str(tmp_path / "real"), "config.json", b"{}")
    assert os.listdir(tmp_path / "real") == ["config.json"]
