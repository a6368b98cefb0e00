"""Stand-ins for the two container forms launch/slurm/job.sh supports, for the local Slurm tests.

pyxis (a SPANK plugin needing enroot) and apptainer cannot run here. `srun` below takes pyxis's
options as pyxis declares and checks them (NVIDIA/pyxis args.c at 0619349c90000f8d69e45d43dd1ce96402345beb:
the option names, "argument required", a mount SRC:DST[:FLAGS] whose source is a path, tmpfs or
umount and whose target is a path), records them and runs the real srun with the task command
"inside the image". `apptainer` takes `exec [--nv] [--bind=SRC:DST] IMAGE CMD...` and refuses a
missing image file. Inside the image, python3 is this interpreter; on the host there is none:
`python`/`python3` in the host PATH record the call and fail, so a batch shell that ran Python
itself shows in host-python.log.
"""
from __future__ import annotations

import os
import stat
import sys

HOST_PYTHON = """#!/bin/sh
echo "$0 $*" >> {root}/host-python.log
echo "python3: not on this host" >&2
exit 127
"""

# The task command runs with the image's PATH (its python3), the host's bin directory dropped.
ENTER = """#!/usr/bin/env bash
echo "step=${{SLURM_STEP_ID:-?}} task=${{SLURM_PROCID:-?}} image=$1 cmd=${{*:2}}" >> {root}/container.log
PATH={root}/image-bin:$(tr ':' '\\n' <<<"$PATH" | grep -vxF {root}/host-bin | paste -sd:)
shift
exec "$@"
"""

SRUN = r"""#!/usr/bin/env bash
die() { echo "srun: error: pyxis: $*" >&2; exit 1; }
path_like() { [[ $1 == .* || $1 == /* ]]; }
args=() image="" seen=()
while (( $# )); do
    case $1 in
        --container-image=* | --container-mounts=* | --container-workdir=* | --container-name=* | \
        --container-save=* | --container-env=*) opt=${1%%=*} val=${1#*=} ;;
        --container-image | --container-mounts | --container-workdir | --container-name | --container-save | \
        --container-env) opt=$1 val=${2:-}; shift ;;
        --container-mount-home | --no-container-mount-home | --container-remap-root | --no-container-remap-root | \
        --container-entrypoint | --no-container-entrypoint | --container-entrypoint-log | --container-writable | \
        --container-readonly) seen+=("$1"); shift; continue ;;
        --container-* | --no-container-*) echo "srun: unrecognized option '$1'" >&2; exit 1 ;;
        -*) args+=("$1"); shift; continue ;;
        *) break ;;
    esac
    [[ -n $val ]] || die "$opt: argument required"
    if [[ $opt == --container-mounts ]]; then
        IFS=, read -ra entries <<<"$val"
        for entry in "${entries[@]}"; do
            IFS=: read -r src dst _ <<<"$entry"
            [[ -n $src ]] || die "--container-mounts: invalid format: $entry"
            path_like "$src" || [[ $src == tmpfs || $src == umount ]] ||
                die "mount source must be a relative path, an absolute path, \"tmpfs\" or \"umount\""
            path_like "${dst:-$src}" || die "mount target must be a relative path or an absolute path"
        done
    fi
    [[ $opt == --container-image ]] && image=$val
    seen+=("$opt=$val")
    shift
done
echo "srun ${seen[*]} -- $1" >> {root}/srun.log
if [[ -n $image ]]; then exec /usr/bin/srun "${args[@]}" {root}/enter "$image" "$@"; fi
exec /usr/bin/srun "${args[@]}" "$@"
"""

APPTAINER = r"""#!/usr/bin/env bash
[[ ${1:-} == exec ]] || { echo "apptainer: unknown command ${1:-}" >&2; exit 255; }
shift
while [[ ${1:-} == -* ]]; do
    case $1 in
        --nv | --bind=* | --cleanenv) shift ;;
        *) echo "Error: unknown flag: $1" >&2; exit 255 ;;
    esac
done
[[ -f ${1:-} ]] || { echo "FATAL: could not open image ${1:-}: failed to retrieve path for ${1:-}" >&2; exit 255; }
exec {root}/enter "$@"
"""


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def container_stand_ins(root: str) -> dict[str, str]:
    """Write the stand-ins under `root`; returns the job environment (PATH with the host's bin
    directory first, PYTHON=python3, so only the image has it) and the paths the tests read."""
    host, image = os.path.join(root, "host-bin"), os.path.join(root, "image-bin")
    os.makedirs(host, exist_ok=True)
    os.makedirs(image, exist_ok=True)
    for name in ("python", "python3"):
        _write(os.path.join(host, name), HOST_PYTHON.format(root=root))
    _write(os.path.join(host, "srun"), SRUN.replace("{root}", root))
    _write(os.path.join(root, "apptainer"), APPTAINER.replace("{root}", root))
    _write(os.path.join(root, "enter"), ENTER.format(root=root))
    os.symlink(sys.executable, os.path.join(image, "python3"))
    with open(os.path.join(root, "image.sif"), "wb") as f:
        f.write(b"stand-in image")
    return {"PATH": f"{host}:{os.environ['PATH']}", "PYTHON": "python3"}


def read_log(root: str, name: str) -> str:
    path = os.path.join(root, name)
    return open(path).read() if os.path.exists(path) else ""
