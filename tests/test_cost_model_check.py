"""gpu_check's cost-model section (benchmarks/cost_model_check.py): its fit, its verdict, and its
dry run on CPU through the real built-in engine.

    python -m pytest -q tests/test_cost_model_check.py
"""
import json

import numpy as np
import pytest

from benchmarks import cost_model_check as cmc
from benchmarks import gpu_check
from megarl.rollout.config import CostModelConfig

ROWS = (1, 8, 32, 128, 256)
TOKENS = (64, 256, 1024, 4096, 8192)


def synthetic(a: float, b: float, d: float, c: float, noise: float, seed: int = 0) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    decode = [{"rows": r, "step_s": (a + b * r) * (1 + noise * rng.standard_normal())} for r in ROWS]
    prefill = [{"tokens": t, "call_s": (d + c * t) * (1 + noise * rng.standard_normal())} for t in TOKENS]
    return decode, prefill


def test_the_fit_recovers_known_terms_from_noisy_points():
    a, b, d, c = 0.7e-3, 3e-6, 2e-3, 11e-6
    decode, prefill = synthetic(a, b, d, c, noise=0.005)
    got = cmc.judge(decode, prefill)["fit"]
    assert got["decode_s"] == pytest.approx(a, rel=0.05)
    assert got["decode_row_s"] == pytest.approx(b, rel=0.10)
    assert got["prefill_pass_s"] == pytest.approx(d, rel=0.10)
    assert got["prefill_token_s"] == pytest.approx(c, rel=0.05)
    # exact points give the terms exactly; a flat line gives slope 0
    assert cmc.fit([1, 2, 4], [3.0, 5.0, 9.0]) == pytest.approx((1.0, 2.0))
    assert cmc.fit([1, 8, 256], [0.46e-3] * 3)[1] == pytest.approx(0.0, abs=1e-15)


def test_a_fit_needs_two_x_values():
    with pytest.raises(ValueError, match="two x values"):
        cmc.fit([8, 8], [1.0, 2.0])


def test_each_point_is_put_beside_the_defaults_prediction():
    cfg = CostModelConfig()
    decode, prefill = synthetic(cfg.decode_s, cfg.decode_row_s, 0.0, cfg.prefill_token_s, noise=0.0)
    r = cmc.judge(decode, prefill)
    assert [p["model_s"] for p in r["decode"]] == pytest.approx([cfg.decode_s] * len(ROWS))
    assert [p["model_s"] for p in r["prefill"]] == pytest.approx([cfg.prefill_token_s * t for t in TOKENS])
    assert [p["ratio"] for p in r["decode"] + r["prefill"]] == pytest.approx([1.0] * (len(ROWS) + len(TOKENS)))
    assert r["defaults"] == {"decode_s": cfg.decode_s, "decode_row_s": cfg.decode_row_s,
                             "prefill_token_s": cfg.prefill_token_s, "scale": 1.0}
    # another model's terms give its own predictions
    other = CostModelConfig(decode_s=1e-3, decode_row_s=1e-5, prefill_token_s=1e-6, scale=2.0)
    r2 = cmc.judge(decode, prefill, other)
    assert r2["decode"][-1]["model_s"] == pytest.approx(2.0 * (1e-3 + 1e-5 * 256))
    assert r2["prefill"][0]["model_s"] == pytest.approx(2.0 * 1e-6 * 64)


def test_the_verdict_flips_when_a_point_is_far_from_the_model():
    cfg = CostModelConfig()
    near, near_p = synthetic(cfg.decode_s * 1.5, 0.0, 0.0, cfg.prefill_token_s * 0.6, noise=0.0)
    r = cmc.judge(near, near_p)
    assert r["within_limit"] and "within 2x of this device at every point" in r["verdict"]
    # decode steps 3x slower than the model: every decode point is named
    far = [{**p, "step_s": p["step_s"] * 2} for p in near]
    r = cmc.judge(far, near_p)
    assert not r["within_limit"] and "NOT within 2x" in r["verdict"]
    assert all(f"decode {n} rows 3.00x" in r["verdict"] for n in ROWS) and "prefill" not in r["verdict"]
    # one prefill point too fast (a launch-free pass would be far below the per-token charge)
    fast = [dict(p) for p in near_p]
    fast[0]["call_s"] = cfg.prefill_token_s * 64 / 4
    r = cmc.judge(near, fast)
    assert not r["within_limit"] and "prefill 64 tokens 0.25x" in r["verdict"] and "decode" not in r["verdict"]


def test_dry_run_on_cpu_measures_the_real_engine(tmp_path):
    r = cmc.run("cpu", True, str(tmp_path))
    json.dumps(r)                                 # gpu_check writes it to gpu_check.json
    assert r["label"] == cmc.DRY_LABEL and r["device_name"] == "cpu" and r["dry"]
    assert [p["rows"] for p in r["decode"]] == list(cmc.DRY["rows"])
    # every row ran to max_tokens: the engine's own decode-step count is `steps` per call
    assert all(p["decode_steps"] == cmc.DRY["steps"] for p in r["decode"])
    assert [p["tokens"] for p in r["prefill"]] == [k * cmc.DRY["prefill_prompt"] for k in cmc.DRY["prefill_prompts"]]
    assert all(p["passes"] == 1 and p["call_s"] > 0 for p in r["prefill"])
    assert set(r["fit"]) == {"decode_s", "decode_row_s", "prefill_pass_s", "prefill_token_s"}
    assert (r["fit"]["decode_s"], r["fit"]["decode_row_s"]) == pytest.approx(
        cmc.fit([p["rows"] for p in r["decode"]], [p["step_s"] for p in r["decode"]]))
    assert r["verdict"] == cmc.judge(r["decode"], r["prefill"])["verdict"]
    lines = cmc.rows(r)
    assert lines[0].startswith(f"| cost model vs this device ({cmc.DRY_LABEL}) | ")
    assert any(line.startswith("| cost model: fitted terms vs defaults | decode ") for line in lines)


def test_gpu_check_markdown_shows_the_section():
    cfg = CostModelConfig()
    decode, prefill = synthetic(cfg.decode_s * 5, 0.0, 0.0, cfg.prefill_token_s, noise=0.0)
    result = {**cmc.judge(decode, prefill), "label": "measured on NVIDIA H100 80GB HBM3"}
    for p in result["decode"] + result["prefill"]:
        p.update(captured_in_timed=0, passes=1)
    rep = {"date": "now", "device": {"name": "gpu", "count": 1}, "versions": {}, "dry_run": False,
           "sections": [{"name": "cost_model", "ok": True, "result": result}]}
    md = gpu_check.markdown(rep)
    assert "| cost model vs this device (measured on NVIDIA H100 80GB HBM3) | the defaults are NOT within 2x" in md
    assert "| cost model: decode step vs rows | 1 rows 2.3 ms (model 0.46 ms, 5.00x)" in md
    assert "| cost model: prefill call vs tokens | 64 tokens 1.02 ms (model 1.02 ms, 1.00x, 1 pass)" in md
