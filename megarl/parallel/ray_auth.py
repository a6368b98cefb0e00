"""Ray's token authentication for a Ray that megarl starts (the reward and tool pools).

    warning = ray_token_auth()      # before ray.init(); None, or one line saying auth stays off
    ray.init(..., _temp_dir=private_temp_dir())     # Ray's sessions in a directory only this user enters

Read from Ray 2.60's own source (ray/_private/authentication/authentication_token_setup.py,
ray/_private/worker.py): RAY_AUTH_MODE=token makes every Ray server demand a token, taken from
RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token. See docs/security.md.
"""
from __future__ import annotations

import os
import secrets
import stat
import tempfile


def ray_token_auth() -> str | None:
    """Turn on Ray's token authentication for a Ray this process starts: RAY_AUTH_MODE=token and,
    unless a token is configured (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), a
    random one for this run in RAY_AUTH_TOKEN, which Ray's own processes inherit. Ray's servers
    listen on every interface (Ray 2.60 has no option to bind them to loopback), so the token is
    what keeps others out. Returns a warning line when authentication stays off, else None."""
    import ray  # optional dependency: only runs that use Ray call this
    env = os.environ
    mode = env.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        return (f"megarl: RAY_AUTH_MODE={mode}: the Ray pool accepts anyone who can reach this machine's Ray ports "
                "(they run code as you); unset it to use a token (docs/security.md)")
    try:
        from ray._private.authentication import authentication_token_setup as setup  # optional (Ray), as above
        from ray._raylet import AuthenticationTokenLoader  # optional (Ray), as above
    except ImportError:
        return (f"megarl: Ray {ray.__version__} has no token authentication: the Ray pool accepts anyone who can "
                "reach this machine's Ray ports; install a Ray that has it or firewall them (docs/security.md)")
    if env.get("RAY_ADDRESS"):
        return None          # joining a running cluster: its own authentication settings apply
    if not (env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH")
            or os.path.isfile(os.path.expanduser("~/.ray/auth_token"))):
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    # What ray.init does for a new local cluster (ray/_private/authentication/authentication_token_setup.py),
    # done here so the token above is the one used and no file is written to ~/.ray.
    setup._enable_token_auth()
    AuthenticationTokenLoader.instance().reset_cache()
    return None


def private_temp_dir() -> str:
    """The root of Ray's session directories for a Ray megarl starts: <private>/ray, where <private> is
    /tmp/megarl-ray-<uid>, mode 0700. Ray's default, /tmp/ray, is world-writable, and its session_*
    directories (sockets, the workers' logs) readable by every user; Ray makes whatever root it is
    given mode 0777 too, so the 0700 is on the directory above it. A <private> that exists but is not
    this user's own 0700 directory (another user made it first, or a link) is passed over for a fresh one."""
    base = os.path.join(tempfile.gettempdir(), f"megarl-ray-{os.getuid()}")
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(base)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) != 0o700:
        base = tempfile.mkdtemp(prefix="megarl-ray-")     # 0700 by construction
    return os.path.join(base, "ray")
