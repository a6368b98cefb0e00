"""Generation dumps and verl's metric names, against verl 0.9.1's own functions (its source, compiled
one function at a time: tests/helpers/verl_source.py):

- trainer.rollout_data_dir / validation_data_dir files byte for byte as verl's _write_generations,
  with the reward's extra info as verl's reward loop records it (a dict's keys, a number as acc);
- log_val_generations' pick as verl's _maybe_log_val_generations;
- val-core / val-aux metrics as verl's process_validation_metrics + _val_metrics_update, one source too;
- global_seqlen/* as verl's log_seqlen_unbalance, response/aborted_ratio as its compute_data_metrics.

    pip install --no-deps verl==0.9.1
    python -m pytest -q tests/test_generations.py
"""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.reward.manager import build_reward_manager
from megarl.trainer.metrics.generations import decode, dump_validation, pick_for_log, write_jsonl
from megarl.trainer.metrics.logger import MetricsLogger
from megarl.trainer.metrics.step import seqlen_balance, verl_step_metrics
from megarl.trainer.metrics.validation import verl_val_metrics
from tests.helpers.reward import rollout_batch, tokenizer
from tests.helpers.verl_source import verl_function

TRAINER = "trainer/ppo/ray_trainer.py"
METRICS = "trainer/ppo/metric_utils.py"

DICT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = solution_str.strip() == ground_truth
    return {"score": 2.0 * right - 1.0, "acc": right, "pred": solution_str.strip(), "index": extra_info["index"]}
'''


def scored(tmp_path, responses, truths, reward=None):
    overrides = []
    if reward is not None:
        path = tmp_path / "reward.py"
        path.write_text(reward)
        overrides.append(f"custom_reward_function.path={path}")
    batch = rollout_batch(responses, truths)
    result = build_reward_manager(load_config(None, overrides), tokenizer())(batch)
    result.apply(batch)
    return batch, result


def verl_dump(batch, extra, directory, step):
    """What verl's _log_rollout_data passes to _write_generations for this batch."""
    tok = tokenizer()
    nt = batch.non_tensor_batch
    inputs = tok.batch_decode([list(p) for p in nt["prompt_token_ids"]], skip_special_tokens=True)
    outputs = tok.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    gts = [row.get("ground_truth") for row in nt["reward_model"]]
    scores = batch.batch["token_level_scores"].sum(-1).cpu().tolist()
    write = verl_function(TRAINER, "_write_generations", cls="RayPPOTrainer")
    write(inputs, outputs, gts, scores, extra, str(directory), step)
    return (directory / f"{step}.jsonl").read_text()


def test_rollout_dump_is_verls_file_with_a_dict_rewards_every_key(tmp_path):
    batch, _ = scored(tmp_path, ["12", "13", "7", ""], ["12", "12", "7", "3"], DICT_REWARD)
    path = write_jsonl(str(tmp_path / "megarl"), 3, decode(batch, tokenizer()))
    # verl's reward loop keeps every key the function returned, score included
    returned = [{"score": 1.0, "acc": True, "pred": "12", "index": 0}, {"score": -1.0, "acc": False, "pred": "13",
                                                                        "index": 1},
                {"score": 1.0, "acc": True, "pred": "7", "index": 2}, {"score": -1.0, "acc": False, "pred": "",
                                                                       "index": 3}]
    extra = {k: [r[k] for r in returned] for k in returned[0]}
    assert open(path).read() == verl_dump(batch, extra, tmp_path / "verl", 3)
    first = json.loads(open(path).readline())
    assert first == {"input": "1+1=", "output": "12", "gts": "12", "score": 1.0, "step": 3, "acc": True,
                     "pred": "12", "index": 0}


def test_a_number_reward_is_recorded_as_acc(tmp_path):
    number = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
             "    return float(solution_str.strip() == ground_truth)\n"
    batch, result = scored(tmp_path, ["2", "3"], ["2", "2"], number)
    assert result.reward_extra_info == {"acc": [1.0, 0.0]}
    path = write_jsonl(str(tmp_path / "megarl"), 1, decode(batch, tokenizer()))
    assert open(path).read() == verl_dump(batch, {"acc": [1.0, 0.0]}, tmp_path / "verl", 1)


def test_rows_kept_or_dropped_keep_their_own_extra_info(tmp_path):
    batch, _ = scored(tmp_path, ["12", "13", "7", ""], ["12", "12", "7", "3"], DICT_REWARD)
    kept = batch[np.array([3, 0])]                # DAPO's dynamic sampling selects and concatenates rows
    assert decode(kept, tokenizer()).extra["index"] == [3, 0]


def test_val_generations_pick_is_verls(tmp_path):
    inputs = [f"prompt {i % 7}" for i in range(20)]
    outputs, scores = [f"out {i}" for i in range(20)], [float(i) for i in range(20)]
    logged = []
    me = SimpleNamespace(config=SimpleNamespace(trainer=SimpleNamespace(log_val_generations=5, logger=["wandb"])),
                         global_steps=4,
                         validation_generations_logger=SimpleNamespace(log=lambda _, s, step: logged.append(s)))
    verl_function(TRAINER, "_maybe_log_val_generations", cls="RayPPOTrainer")(me, inputs, outputs, scores)
    from megarl.trainer.metrics.generations import Generations
    gen = Generations(inputs, outputs, [None] * 20, scores, {})
    assert pick_for_log(gen, 5) == logged[0]
    # validation hands them to the logger, and the directory gets <step>.jsonl
    cfg = SimpleNamespace(validation_data_dir=str(tmp_path / "val"), log_val_generations=5)
    picked = dump_validation(cfg, 4, gen)
    assert (tmp_path / "val" / "4.jsonl").is_file()
    log = MetricsLogger(str(tmp_path / "run"), ["console"], "p", "e")
    log.log_generations(4, picked["_val_generations"])
    rows = [json.loads(line) for line in open(tmp_path / "run" / "val_generations.jsonl")]
    assert [(r["input"], r["output"], r["score"]) for r in rows] == logged[0] and rows[0]["step"] == 4
    # a run resumed from step 4's checkpoint logs steps 5.. again: the lines of 6 and 8 go, 4's stay
    for step in (6, 8):
        log.log(step, {"val/accuracy": 0.5}, print_line=False)
        log.log_generations(step, picked["_val_generations"])
    with open(tmp_path / "run" / "val_generations.jsonl", "a") as f:
        f.write('{"step": 8, "input": "cut sho')                 # a kill in the middle of a write
    MetricsLogger(str(tmp_path / "run"), ["console"], "p", "e").truncate_after(4)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "val_generations.jsonl")]
    assert {r["step"] for r in rows} == {4} and len(rows) == len(logged[0])


def verl_val_oracle():
    bootstrap = verl_function(METRICS, "bootstrap_metric")
    majority = verl_function(METRICS, "calc_maj_val")
    process = verl_function(METRICS, "process_validation_metrics",
                            namespace={"bootstrap_metric": bootstrap, "calc_maj_val": majority})
    update = verl_function(TRAINER, "_val_metrics_update", cls="RayPPOTrainer",
                           namespace={"process_validation_metrics": process})
    return lambda sources, uids, infos: update(None, np.array(sources), uids, infos, [])


@pytest.mark.parametrize("sources", [["math_dapo"] * 24, ["math_dapo"] * 12 + ["openai/gsm8k"] * 12])
def test_val_core_and_aux_metrics_are_verls(sources):
    rng = np.random.RandomState(0)
    uids = [f"p{i // 6}" for i in range(24)]                     # 4 prompts x 6 responses
    scores = rng.choice([-1.0, 1.0], 24).tolist()
    extra = {"score": scores, "acc": [s > 0 for s in scores], "pred": rng.choice(["7", "8", "9"], 24).tolist(),
             "length_bonus": rng.rand(24).tolist()}
    want = verl_val_oracle()(sources, uids, {"reward": scores, **extra})
    got = verl_val_metrics(sources, uids, scores, extra)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    assert "val-core/math_dapo/acc/mean@6" in got and "val-core/math_dapo/acc/maj@6/mean" in got
    assert "val-aux/math_dapo/length_bonus/best@4/mean" in got


def test_a_number_reward_makes_acc_the_core_variable():
    sources, uids, scores = ["s"] * 4, ["a", "a", "b", "b"], [1.0, 0.0, 0.0, 0.0]
    want = verl_val_oracle()(sources, uids, {"reward": scores, "acc": scores})
    got = verl_val_metrics(sources, uids, scores, {"acc": scores})
    assert got == pytest.approx(want) and got["val-core/s/acc/mean@2"] == 0.25


def test_global_seqlen_and_aborted_ratio_are_verls():
    seqlens = [5, 9, 2, 7, 3, 8, 4, 6]
    partitions = [[0, 1, 2, 3], [4, 5, 6, 7]]                # megarl's data-parallel split: contiguous
    want = verl_function("utils/seqlen_balancing.py", "log_seqlen_unbalance")(seqlens, partitions, "global_seqlen")
    assert seqlen_balance(seqlens, 2) == want
    batch = rollout_batch(["12", "13", "7", "1"], ["12"] * 4)
    batch.batch["response_lens"] = torch.tensor([3, 0, 2, 0])
    batch.batch["prompt_lens"] = torch.tensor([4, 4, 4, 4])
    batch.meta_info["epoch"] = 2
    out = verl_step_metrics(5, batch, 2)
    assert out["response/aborted_ratio"] == 0.5 and out["training/global_step"] == 5 and out["training/epoch"] == 2
    assert out["global_seqlen/min"] == (2 + 4) + (0 + 4) and out["global_seqlen/max"] == (3 + 4) + (0 + 4)


def test_dump_keys_are_accepted_and_checked():
    cfg = load_config(None, ["trainer.rollout_data_dir=dumps/train", "trainer.validation_data_dir=dumps/val",
                             "trainer.log_val_generations=3"])
    assert (cfg.trainer.rollout_data_dir, cfg.trainer.log_val_generations) == ("dumps/train", 3)
    with pytest.raises(ConfigError, match="log_val_generations"):
        load_config(None, ["trainer.log_val_generations=-1"])
