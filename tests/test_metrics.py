import json

from megarl.trainer.metrics.logger import MetricsLogger, progress_line, read_metrics


def test_progress_line_and_jsonl(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path), ["console"], "p", "e", total_steps=10)
    rec = log.log(3, {"critic/score/mean": 0.5, "actor/entropy": 1.25, "response_length/mean": 7.0,
                      "perf/throughput": 123.4, "timing_s/gen": 1.5, "timing_s/update_actor": 2.0,
                      "timing_s/step": 4.0, "actor/pg_loss": float("nan")})
    out = capsys.readouterr().out.strip()
    assert out.startswith("step 3/10 | reward 0.500") and "gen 1.5s" in out and "tok/s 123" in out
    rows = read_metrics(str(tmp_path))
    assert rows[0]["step"] == 3 and rows[0]["actor/pg_loss"] == "nan"
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["critic/score/mean"] == 0.5
    assert rec["step"] == 3


def test_disabled_rank_writes_nothing(tmp_path):
    log = MetricsLogger(str(tmp_path / "x"), ["console"], "p", "e", enabled=False)
    log.log(1, {"a": 1})
    assert not (tmp_path / "x").exists()
    assert progress_line(1, None, {}) == "step 1"
    assert progress_line(2, 5, {"critic/score/mean": "nan"}) == "step 2/5 | reward nan"
