"""docs/extending.md's examples run as printed: each ```python block in one fresh interpreter (so
the names they register do not leak into other tests), in the page's order.

    python -m pytest -q tests/test_docs_extending.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = open(os.path.join(ROOT, "docs", "extending.md")).read()
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE, re.S)
SECTIONS = re.findall(r"^## (.+)$", PAGE, re.M)


def test_the_page_has_one_example_per_extension():
    assert SECTIONS == ["A policy loss", "A rollout engine", "A weight-sync transport", "A model family",
                        "A model converter"]
    assert len(BLOCKS) == len(SECTIONS)


def test_every_example_runs_as_printed():
    program = "\n".join(f"# -- {title}\n{block}\nprint('ran:', {title!r})" for title, block in zip(SECTIONS, BLOCKS))
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line for line in out.stdout.splitlines() if line.startswith("ran:")] == [f"ran: {s}" for s in SECTIONS]


# Each example with an option, as a module `megarl-train --check` imports by model.external_lib: a
# misspelled name and a misspelled option key are each one line naming what is known.
CHECKS = {
    "A policy loss": [
        (["actor_rollout_ref.actor.policy_loss.loss_mode=clipped_is_dmo"],
         "actor_rollout_ref.actor.policy_loss.loss_mode: unknown policy loss 'clipped_is_dmo'; did you mean "
         "'clipped_is_demo'?"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=clipped_is_demo",
          "actor_rollout_ref.actor.policy_loss.weight_cp=2"],
         "actor_rollout_ref.actor.policy_loss.weight_cp: unknown key; did you mean 'weight_cap'? policy loss "
         "'clipped_is_demo' reads weight_cap")],
    "A weight-sync transport": [
        (["actor_rollout_ref.rollout.checkpoint_engine.backend=nothing_dmo"],
         "actor_rollout_ref.rollout.checkpoint_engine.backend: unknown transport 'nothing_dmo'; registered: "
         "colocated, disk, distributed, nothing_demo"),
        (["actor_rollout_ref.rollout.checkpoint_engine.backend=nothing_demo",
          "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.nothing_demo.report_evry=2"],
         "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.nothing_demo.report_evry: unknown key; did you "
         "mean 'report_every'? transport 'nothing_demo' reads report_every")],
    "A model converter": [
        (["actor_rollout_ref.model.converters=[freeze_dmo]"],
         "actor_rollout_ref.model.converters: unknown model converter 'freeze_dmo'; did you mean 'freeze_demo'?"),
        (["actor_rollout_ref.model.converters={freeze_demo: {mach: proj}}"],
         "actor_rollout_ref.model.converters.freeze_demo.mach: unknown key; did you mean 'match'? model converter "
         "'freeze_demo' reads match")],
}


def test_check_names_a_misspelled_name_or_option_key_in_one_line(tmp_path):
    runs = []
    for title, cases in CHECKS.items():
        module = f"extending_{SECTIONS.index(title)}"
        (tmp_path / f"{module}.py").write_text(BLOCKS[SECTIONS.index(title)])
        for overrides, expected in cases:
            cmd = [sys.executable, "-m", "megarl.train", "--check", *overrides,
                   f"actor_rollout_ref.model.external_lib={module}"]
            runs.append((expected, subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                    text=True, env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"})))
    for expected, proc in runs:
        out, _ = proc.communicate(timeout=300)
        errors = [line for line in out.splitlines() if line.startswith("megarl: config error: ")]
        assert proc.returncode != 0 and len(errors) == 1, out[-2000:]
        assert errors[0].startswith(f"megarl: config error: {expected}"), errors[0]


def test_the_family_example_runs_its_code_hooks():
    """The family example's hook reaches both sides: megatron's layer spec (asserted in the block)
    and the built-in engine, which holds the checkpoint's k_scale where native_qk reads it."""
    block = BLOCKS[SECTIONS.index("A model family")]
    assert "(FamilyHooks)" in block and "hooks=" in block
    check = ("from megarl.models.hf_checkpoint import HFCheckpoint\n"
             "for n in range(2):\n"
             "    want = HFCheckpoint(path).read_full(f'model.layers.{n}.self_attn.k_scale.weight')\n"
             "    assert torch.equal(engine.model.blocks[n].extra['self_attn_k_scale_weight'], want)\n"
             "    assert not torch.equal(want, torch.ones_like(want))\n")
    out = subprocess.run([sys.executable, "-c", block + check], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
