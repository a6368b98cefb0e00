"""The benchmark's vLLM peer: absent vllm is reported and skipped; where vllm imports (its own
venv, see benchmarks/rollout_throughput.py), a tiny run passes the peer's check (n rows per
prompt, stop ids, log-probs equal to transformers') and prints its tokens/s. The vllm run goes
in a subprocess: in-process vLLM patches torch.set_num_threads for the whole process."""
import importlib.util
import os
import subprocess
import sys
import types

import pytest

from benchmarks.rollout_throughput import vllm_runner
from megarl.rollout.base import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_vllm_absent_is_reported_not_run(monkeypatch, capsys):
    for k, v in {"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        monkeypatch.setenv(k, v)                              # restored afterwards
    monkeypatch.setitem(sys.modules, "vllm", None)            # import vllm -> ImportError
    args = types.SimpleNamespace(vllm_mp=False, device="cpu", threads=1)
    assert vllm_runner(args, [[1, 2, 3]], SamplingParams(n=2, max_tokens=4)) is None
    assert "vllm: not run (ModuleNotFoundError" in capsys.readouterr().out


def _vllm_imports() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, timeout=300,
                           env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    return probe.returncode == 0


def test_vllm_peer_tiny_run(tmp_path):
    if not _vllm_imports():
        pytest.skip("vllm does not import here (see benchmarks/rollout_throughput.py for its venv)")
    cmd = [sys.executable, "benchmarks/rollout_throughput.py", "--model-dir", str(tmp_path / "toy"),
           "--vocab-size", "600", "--layers", "2", "--hidden", "128", "--heads", "2", "--kv-heads", "1",
           "--intermediate", "256", "--prompts", "3", "--n", "2", "--max-tokens", "8", "--repeats", "1",
           "--threads", "1", "--shortest", "4", "--longest", "12", "--enforce-eager", "--no-plain"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "vllm check: 6 rows (expected 3 x n=2 = 6)" in out and "0 with a stop id inside" in out
    diff = float(out.split("max |diff| ")[1].split(",")[0])
    assert diff < 1e-3, out
    assert "ratio native / vllm" in out
