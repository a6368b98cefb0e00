"""Console noise the user cannot act on, filtered once before megatron is imported.

    quiet_known_noise(cpu=True)     # megarl-train does this unless --verbose (or MEGARL_VERBOSE=1)

Each entry is a warning about the environment that changes nothing the user can fix from
megarl: optional NVIDIA kernels missing on CPU, a GPU-only tuning hint on CPU, a megatron-internal
deprecation megarl itself triggers. Warnings about the user's data, config or run are never listed.
"""
from __future__ import annotations

import os
import warnings

VERBOSE_ENV = "MEGARL_VERBOSE"
# (message regex, category, only on CPU, why it is noise)
KNOWN_NOISE = (
    (r"Transformer Engine and Apex are not installed", UserWarning, False,
     "megatron falls back to torch kernels; optional NVIDIA packages, per module, per rank"),
    (r"Apex is not installed", UserWarning, False, "megatron uses torch's norm; optional NVIDIA package"),
    (r"full scope is deprecated", UserWarning, False,
     "megatron's own default for cuda_graph_scope, not set by the user"),
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning, False,
     "megatron's sequence-parallel gathers call torch's older collective names; megarl's own use the new ones"),
    (r"`load_state_dict` is deprecated and will be removed in future versions", FutureWarning, False,
     "megatron-core 0.16's checkpoint reader calls torch's older name on every resume; nothing the user sets"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning, False,
     "megatron-core 0.16 reads its checkpoints through torch's ShardedTensor on every resume"),
    (r".*it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
     UserWarning, True, "a CUDA stream setting; meaningless on CPU (on GPUs it is shown)"),
)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def quiet_known_noise(cpu: bool) -> int:
    """Install the filters (unless verbose); returns how many were installed."""
    if verbose():
        return 0
    n = 0
    for message, category, cpu_only, _why in KNOWN_NOISE:
        if cpu_only and not cpu:
            continue
        warnings.filterwarnings("ignore", message=message, category=category)
        n += 1
    return n
