"""The launcher side: what runs before any rank starts, without torch.

    preflight.py, preflight_data.py, preflight_run.py, diskspace.py   the checks (`megarl-train --check`)
    vars.py      `python -m megarl.launcher.vars`: the checks, then the variables launch/*.sh export
    check.py     `MEGARL_ENTRY=megarl.launcher.check`: a small real distributed job for launch tests
    output.py    the launcher's copy of its ranks' output; logs.py: warnings filtered unless --verbose
    failure.py   `python -m megarl.launcher.failure`: the rank a failed Slurm job names in its last line
"""
