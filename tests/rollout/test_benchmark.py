"""The throughput benchmark runs end to end (tiny settings here; the figures in the README come
from its defaults) and prints both engines' tokens/s and the ratio; its quickstart shape prints
seconds per generate."""
from benchmarks.rollout_throughput import main


def test_benchmark_prints_both_figures_and_the_ratio(tmp_path, capsys):
    med = main(["--model-dir", str(tmp_path / "toy"), "--vocab-size", "600", "--layers", "2", "--hidden", "64",
                "--prompts", "3", "--n", "2", "--max-tokens", "8", "--repeats", "1", "--threads", "1",
                "--shortest", "4", "--longest", "12", "--no-vllm"])
    out = capsys.readouterr().out
    assert set(med) == {"native", "hf", "hf-plain"} and all(v > 0 for v in med.values())
    assert "native" in out and "tokens/s" in out and "ratio native / hf " in out and "per CPU-second" in out


def test_benchmark_quickstart_shape(tmp_path, capsys):
    med = main(["--shape", "quickstart", "--model-dir", str(tmp_path / "qs"), "--repeats", "1", "--threads", "1",
                "--sleep-cycle"])
    out = capsys.readouterr().out
    assert set(med) == {"native", "hf"} and all(v > 0 for v in med.values())
    assert "0.40M params" in out and "256 rows" in out and "s per generate" in out and "weight sync" in out
