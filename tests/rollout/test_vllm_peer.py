"""The benchmark's vLLM peer where vllm is absent: reported and skipped. Where it imports, the
peer's tiny run is one of tests/rollout/vllm_checks.py's checks (one vLLM start-up for all)."""
import sys
import types

from benchmarks.vllm_peer import vllm_runner
from megarl.rollout.base import SamplingParams


def test_vllm_absent_is_reported_not_run(monkeypatch, capsys):
    for k, v in {"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        monkeypatch.setenv(k, v)                              # restored afterwards
    monkeypatch.setitem(sys.modules, "vllm", None)            # import vllm -> ImportError
    args = types.SimpleNamespace(device="cpu", threads=1)
    assert vllm_runner(args, [[1, 2, 3]], SamplingParams(n=2, max_tokens=4)) is None
    assert "vllm: not run (ModuleNotFoundError" in capsys.readouterr().out
