"""verl's reward_kwargs spellings of DAPO's overlong penalty, from the command line to the scores, against
verl 0.9.1's own DAPORewardManager (verl/workers/reward_manager/dapo.py) as the oracle.

    pip install --no-deps verl==0.9.1
    python -m pytest -q tests/test_config_reward_kwargs.py

verl's package __init__ needs tensordict and ray, which its --no-deps install lacks; the manager itself needs
torch, its registry and its scorers. Its DataProto is only an annotation there, so `_Batch` below carries the
fields the manager reads (batch, non_tensor_batch, len, item access), built from megarl's own batch.
"""
import importlib
import importlib.machinery
import os
import sys
import types

import pytest
import torch

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.reward.manager import build_reward_manager
from tests.helpers.reward import rollout_batch, tokenizer

REASON = "the oracle is verl 0.9.1's DAPO reward manager: pip install --no-deps verl==0.9.1"

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)
'''
BUFFER = {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True}
BUDGET = 8                      # rollout_batch's width: a response of 8 tokens is at the length limit
# (response, truth): 2, 6 and 8 tokens with EOS; the last two inside the buffer, the last at the limit
ROWS = [("1", "1"), ("12345", "12345"), ("1234567", "1234567"), ("1234567", "0")]


class _Batch:
    """The fields verl's DAPORewardManager reads of its DataProto (and of a DataProtoItem)."""

    def __init__(self, batch, non_tensor_batch):
        self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch, {}

    def __len__(self):
        return len(self.batch["responses"])

    def __getitem__(self, i):
        return _Batch({k: v[i] for k, v in self.batch.items()}, {k: v[i] for k, v in self.non_tensor_batch.items()})


def _verl_dapo_manager():
    spec = importlib.machinery.PathFinder.find_spec("verl")
    if spec is None:                             # sys.path only, never a stand-in module
        pytest.skip(REASON)
    root = os.path.dirname(spec.origin)
    names = ("verl", "verl.protocol", "verl.utils", "verl.workers", "verl.workers.reward_manager")
    saved = {k: sys.modules.get(k) for k in (*names, "verl.workers.reward_manager.dapo",
                                             "verl.workers.reward_manager.registry",
                                             "verl.workers.reward_manager.abstract")}
    try:
        for name in names:
            stub = types.ModuleType(name)
            if name != "verl.protocol":
                stub.__path__ = [os.path.join(root, *name.split(".")[1:])]
            stub.DataProto = _Batch
            sys.modules[name] = stub
        registry = importlib.import_module("verl.workers.reward_manager.registry")
        sys.modules["verl.workers.reward_manager"].register = registry.register
        return importlib.import_module("verl.workers.reward_manager.dapo").DAPORewardManager
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def _verl_scores(batch, compute_score):
    """verl's DAPO manager on megarl's batch: prompts left-padded, responses right-padded, one mask."""
    tok = tokenizer()
    prompts = [list(p) for p in batch.non_tensor_batch["prompt_token_ids"]]
    width = max(map(len, prompts))
    prompt_ids = torch.full((len(batch), width), tok.pad_token_id)
    prompt_mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, width - len(p):] = torch.tensor(p)
        prompt_mask[i, width - len(p):] = 1
    data = _Batch({"prompts": prompt_ids, "responses": batch.batch["responses"],
                   "attention_mask": torch.cat([prompt_mask, batch.batch["response_mask"]], dim=1)},
                  {k: batch.non_tensor_batch[k] for k in ("data_source", "reward_model", "extra_info")})
    manager = _verl_dapo_manager()(tok, num_examine=0, compute_score=compute_score, max_resp_len=BUDGET,
                                   overlong_buffer_cfg=types.SimpleNamespace(**BUFFER))
    return manager(data, return_dict=True)["reward_tensor"]


def _overrides(prefix: str) -> list[str]:
    return [f"+{prefix}.overlong_buffer_cfg.{k}={v}" for k, v in BUFFER.items()] + [
        f"+{prefix}.max_resp_len={BUDGET}", f"data.max_response_length={BUDGET}"]


@pytest.mark.parametrize("prefix", ["reward_model.reward_kwargs", "reward.reward_kwargs"])
def test_verl_reward_kwargs_overlong_penalty_matches_verls_dapo_manager(prefix, tmp_path):
    """32 of verl's scripts write +reward_model.reward_kwargs.*; verl 0.9.1's DAPO manager reads
    reward.reward_kwargs. A response at the length limit scores verl's -penalty_factor, not 0."""
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    cfg = load_config(None, [*_overrides(prefix), f"custom_reward_function.path={path}"])
    batch = rollout_batch(*zip(*ROWS))
    ours = build_reward_manager(cfg, tokenizer())(batch).token_level_scores
    namespace: dict = {}
    exec(REWARD, namespace)
    theirs = _verl_scores(batch, namespace["compute_score"])
    assert torch.equal(ours, theirs), (ours, theirs)
    assert ours.sum(-1).tolist() == [1.0, 0.5, 0.0, -1.0]     # at the limit: the score minus penalty_factor


def test_reward_kwargs_and_megarls_spelling_must_agree():
    cfg = load_config(None, [*_overrides("reward_model.reward_kwargs"), "algorithm.overlong_buffer.len=4"])
    assert (cfg.algorithm.overlong_buffer.enable, cfg.algorithm.overlong_buffer.len) == (True, 4)
    with pytest.raises(ConfigError) as err:
        load_config(None, [*_overrides("reward_model.reward_kwargs"), "algorithm.overlong_buffer.len=32"])
    assert err.value.key == "reward_model.reward_kwargs.overlong_buffer_cfg.len"


def test_max_resp_len_other_than_the_budget_is_one_line():
    """verl's penalty counts from max_resp_len, megarl's from data.max_response_length: they must agree."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["reward.reward_kwargs.max_resp_len=16", "data.max_response_length=8"])
    assert str(err.value).startswith("reward.reward_kwargs.max_resp_len: 16 is not data.max_response_length=8")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [["reward_model.reward_manager_kwargs={max_resp_len: 8}"],
                                       ["+reward_model.reward_kwargs.scale=2"],
                                       ["reward_model.reward_manager=batch",
                                        "reward_model.reward_manager_kwargs={a: 1}"]])
def test_manager_kwargs_that_nothing_reads_are_refused(overrides):
    """The naive and batch managers take no arguments: a key given to them is one line, never a silent no-op."""
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == "reward_model.reward_manager_kwargs" and "would do nothing" in str(err.value)


def test_manager_kwargs_reach_a_manager_class(tmp_path):
    """verl's other reward_kwargs are its manager class's constructor arguments, as in older verl."""
    path = tmp_path / "manager.py"
    path.write_text("class Manager:\n    def __init__(self, tokenizer, scale=1.0):\n        self.scale = scale\n"
                    "    def __call__(self, data):\n        return [self.scale] * len(data)\n")
    cfg = load_config(None, [f"reward_model.reward_manager={path}:Manager", "+reward_model.reward_kwargs.scale=2.5"])
    assert dict(cfg.reward_model.reward_manager_kwargs) == {"scale": 2.5}
    scorer = build_reward_manager(cfg, tokenizer()).scorer
    assert scorer.instance.scale == 2.5
