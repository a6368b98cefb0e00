"""Files that run a shell command when unpickled: the attack the checkpoint readers are drilled on.

    write_hostile(path, marker)     # loading `path` with an unpickler that allows calls touches `marker`
"""
from __future__ import annotations

import os
import pickle
import shlex

import torch


class Hostile:
    """Unpickling this runs `touch marker`: the marker's existence is the proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def write_hostile(path: str, marker: str, step: int = 2) -> None:
    """The same kind of file as the original: a torch zip for .pt files (a step's trainer state
    around it), a bare pickle otherwise (megatron's .metadata)."""
    if path.endswith(".pt"):
        torch.save({"step": step, "x": Hostile(marker)}, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(Hostile(marker), f)
    os.chmod(path, 0o600)
