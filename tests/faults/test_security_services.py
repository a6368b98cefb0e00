"""Who can talk to a run: the Ray pool requires a token; megarl's own key-value stores listen on
loopback; the built-in calculator cannot be made to compute for long; small holes are closed.

Ray 2.60 cannot bind its servers to loopback (they listen on every interface), so the check is
that a client without the run's token is refused by the GCS while one with it gets in. The
stores are checked with `ss`: what the socket is bound to, not what we asked for.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from megarl.config import ConfigError


def listening_on(pid: int) -> list[str]:
    """Local addresses of the TCP sockets `pid` listens on (ss -ltnp)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if re.search(rf"pid={pid},", line)]


GCS_CLIENT = textwrap.dedent("""
    import sys
    from ray._raylet import GcsClient
    try:
        GcsClient(address=sys.argv[1]).internal_kv_get(b"x", None)
        print("CONNECTED")
    except Exception as err:
        print("REFUSED", type(err).__name__)
""")


@pytest.mark.timeout(300)
def test_the_ray_pool_requires_its_token(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": os.getcwd()}
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        env.pop(key, None)
    pool = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys, ray
        from megarl.parallel.actor_pool import ensure_ray
        ensure_ray(1)
        session = ray._private.worker._global_node.get_session_dir_path()   # where Ray put this run's files
        print(ray.get_runtime_context().gcs_address, os.environ["RAY_AUTH_TOKEN"], session, flush=True)
        sys.stdin.read()
    """)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "pool.err", "w"), text=True)
    try:
        line = pool.stdout.readline()
        assert line, (tmp_path / "pool.err").read_text()[-3000:]
        gcs, token, session = line.split()
        assert len(token) == 64
        assert not (home / ".ray").exists()                  # the run's token lives in its processes only
        # Ray's sessions (sockets, worker logs) sit in a directory only this user can enter, not /tmp/ray
        from megarl.parallel.ray_auth import private_temp_dir
        root = private_temp_dir()
        assert os.path.dirname(session) == root and os.path.isdir(session), (session, root)
        private = os.path.dirname(root)                   # Ray makes its root 0777; the one above is 0700
        assert os.stat(private).st_mode & 0o777 == 0o700 and os.stat(private).st_uid == os.getuid()

        def client(**extra):
            out = subprocess.run([sys.executable, "-c", GCS_CLIENT, gcs], capture_output=True, text=True, timeout=60,
                                 env={**env, "HOME": str(tmp_path), **extra})
            return out.stdout.strip()
        assert client(RAY_AUTH_MODE="disabled") == "REFUSED AuthenticationError"
        assert client(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64) == "REFUSED AuthenticationError"
        assert client(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token) == "CONNECTED"     # the control
    finally:
        pool.stdin.close()
        pool.wait(timeout=60)


def test_rays_private_directory_is_not_taken_from_another_user(tmp_path, monkeypatch):
    """A /tmp/megarl-ray-<uid> that is not this user's 0700 directory (made first by someone else, left
    open, or a link) is passed over for a fresh private one."""
    from megarl.parallel.ray_auth import private_temp_dir
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)           # tempfile reads TMPDIR again
    first = os.path.dirname(private_temp_dir())
    assert first == str(tmp_path / f"megarl-ray-{os.getuid()}") and os.stat(first).st_mode & 0o777 == 0o700
    os.chmod(first, 0o777)                                    # left open: not used
    other = os.path.dirname(private_temp_dir())
    assert other != first and os.stat(other).st_mode & 0o777 == 0o700
    os.rmdir(first)
    os.symlink(str(tmp_path), first)                          # a link: not followed
    assert os.path.dirname(private_temp_dir()) not in (first, str(tmp_path))


def test_megarl_stores_listen_on_loopback_only():
    import datetime

    import torch.distributed as dist

    from megarl.parallel.loopback import job_store, listening_store
    plain = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    ours = listening_store("127.0.0.1")
    addresses = listening_on(os.getpid())
    assert f"127.0.0.1:{ours.port}" in addresses
    # torch's own server ignores the host it is given: the reason megarl binds the socket itself.
    assert f"*:{plain.port}" in addresses or f"0.0.0.0:{plain.port}" in addresses, addresses
    client = dist.TCPStore("127.0.0.1", ours.port, None, False, timeout=datetime.timedelta(seconds=10))
    client.set("megarl/async/update/3", "1")
    assert ours.check(["megarl/async/update/3"])
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "1"}
    assert job_store(datetime.timedelta(seconds=10), env) is not None
    assert job_store(datetime.timedelta(seconds=10), {**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}) is None
    assert job_store(datetime.timedelta(seconds=10), {**env, "MASTER_ADDR": "10.1.2.3"}) is None


def test_the_calculator_refuses_a_power_tower_at_once():
    from megarl.rollout.multiturn.builtins import calculate
    from megarl.rollout.multiturn.executor import ToolExecutor
    from megarl.rollout.multiturn.parser import ToolCall
    from megarl.rollout.multiturn.tools import Tool
    tower = "(((9**64)**64)**64)**64"                     # 23 characters; 38.9 s of GIL before
    assert len(tower) == 23
    for expression in (tower, "9**64**64", "(10**300)*(10**300)", "((2**64)**16)*((2**64)**16)", "1e308**2"):
        start = time.perf_counter()
        with pytest.raises(ValueError):
            calculate(expression)
        assert time.perf_counter() - start < 0.05, expression
    assert calculate("(3 + 4) * 2") == 14 and calculate("2**64") == 18446744073709551616
    # Through the executor, with the same per-call limit a user's tool gets: an answer, at once.
    tool = Tool("calculate", "", {"type": "object", "properties": {"expression": {"type": "string"}},
                                  "required": ["expression"]}, implementation="builtin:calculate", fn=calculate,
                timeout_s=2.0)
    ex = ToolExecutor({"calculate": tool}, timeout_s=2.0, workers=2)
    start = time.perf_counter()
    [result] = ex.run([ToolCall("calculate", {"expression": tower}, None)])
    assert time.perf_counter() - start < 0.5 and result.status == "error" and "digits" in result.text, result


def test_the_run_dir_lock_refuses_a_symlink(tmp_path):
    from megarl.parallel.lifecycle import LOCK_NAME, RunDirLock
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    os.symlink(target, run_dir / LOCK_NAME)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        RunDirLock(str(run_dir)).acquire()
    assert target.read_text() == "keep me\n"                 # not followed, not truncated
    fresh = tmp_path / "fresh" / "run"
    lock = RunDirLock(str(fresh)).acquire()                  # creates the run directory 0700
    assert oct(os.stat(fresh).st_mode & 0o777) == "0o700"
    assert oct(os.stat(fresh / LOCK_NAME).st_mode & 0o777) == "0o600"
    lock.release()


@pytest.mark.timeout(240)
def test_a_print_in_a_reward_file_cannot_steer_the_launch(tmp_path, addition_model_dir):
    """launch/common.sh must not `eval` the preflight's stdout: a reward file printing shell code would
    run it. The model is a built one, so the preflight imports and calls the reward on a real row."""
    marker = tmp_path / "marker"
    reward = tmp_path / "reward.py"
    reward.write_text(textwrap.dedent(f"""
        print("MEGARL_NPROC_PER_NODE=7; touch {marker}")
        print("$(touch {marker})")
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 0.0
    """))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable, "MEGARL_ENTRY": "megarl.launcher.check"}
    out = subprocess.run(["bash", "launch/torchrun.sh", "configs/quickstart.yaml",
                          f"trainer.default_local_dir={run_dir}", f"actor_rollout_ref.model.path={addition_model_dir}",
                          "trainer.total_training_steps=1", f"custom_reward_function.path={reward}",
                          "custom_reward_function.name=compute_score",
                          "algorithm.filter_groups.enable=false"],   # the reward gives a number, no 'acc'
                         env=env, capture_output=True, text=True, timeout=200)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert not marker.exists()
    assert "MEGARL_NPROC_PER_NODE=7; touch" in text                       # the print reached the terminal
    assert "2 ranks of megarl.launcher.check" in text, text[-2000:]   # and changed nothing
    assert oct(os.stat(run_dir).st_mode & 0o777) == "0o700"
