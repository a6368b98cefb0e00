"""metrics.jsonl lines that are valid JSON but not megarl's records (a "step" edited to text, a
float, a bool): a resume drops each with one line naming the file and line number, and readers skip
them, instead of every resume stopping on a TypeError comparing "note" with a step."""
import io
import json

from megarl.trainer.metrics.logger import MetricsLogger, read_metrics


def test_a_record_whose_step_is_not_a_whole_number_is_dropped_with_its_line_number(tmp_path):
    lines = [{"step": 1, "a": 1.0}, {"step": "note", "text": "lr changed here"}, {"step": 2, "a": 2.0},
             {"step": 1.5}, {"step": True}, {"no_step": 1}, {"step": 3, "a": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = io.StringIO()
    log = MetricsLogger(str(tmp_path), [], "p", "e", stream=out)

    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]
    log.truncate_after(2)

    notices = out.getvalue().splitlines()
    path = str(tmp_path / "metrics.jsonl")
    assert [n.split(":")[0] for n in notices] == ["megarl"] * 4, notices
    assert [f"line {k} of {path}" in n for k, n in zip((2, 4, 5, 6), notices)] == [True] * 4, notices
    assert "'note'" in notices[0] and "not a whole number" in notices[0]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert log.has_step(2) and not log.has_step(3)
