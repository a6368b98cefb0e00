"""A checkpoint's stream state is checked field by field before a resume trains on it: a damaged or
crafted one is refused in one line naming the field (megarl/rollout/partial_state.py,
megarl/trainer/stream/buffer.py's check_saved_stream). A real resume of a half-generated batch:
tests/test_async_pieces.py::test_rollout_stream_resumes_a_batch_half_generated.

    python -m pytest -q tests/test_stream_state.py
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

from megarl.config import ConfigError
from megarl.protocol import DataProto
from megarl.rollout.base import SamplingParams
from megarl.rollout.partial import ChunkedGeneration
from megarl.trainer.stream.buffer import check_saved_stream

PROMPTS = [[5, 17, 42], [3, 9]]
SAMPLING = SamplingParams(n=2, max_tokens=4, seed=1)
STEP = 3            # the saved step: tokens were sampled by versions 0..3


def saved() -> dict:
    """A generation as ChunkedGeneration.state_dict() saves it, two chunks in: finished and running."""
    gen = ChunkedGeneration(PROMPTS, SAMPLING, chunk_tokens=2)
    state = gen.state_dict()
    rows = [([7, 2], [-0.1, -0.2], [2, 3], "stop"), ([7, 7, 8, 1], [-0.5, -0.1, -0.3, -0.2], [1, 1, 2, 3], "length"),
            ([4], [-1.5], [3], None), ([], [], [], None)]
    for s, (tokens, lps, versions, finish) in zip(state["seqs"], rows):
        s.update(tokens=tokens, log_probs=lps, versions=versions, finish=finish)
    state["chunks_done"] = 2
    return state


def load(state) -> ChunkedGeneration:
    gen = ChunkedGeneration(PROMPTS, SAMPLING, chunk_tokens=2)
    gen.load_state_dict(state, STEP, "the batch 5's gens[0]")
    return gen


def test_a_saved_generation_loads_and_continues():
    gen = load(saved())
    assert gen.chunks_done == 2 and gen.left() == [0, 2] and gen.seqs[0].finish == "stop"
    assert gen.state_dict() == saved()                      # what loads is what was saved


BAD = [  # (where in the state, the change, the words of the refusal)
    ("seqs[1].finish", lambda s: s["seqs"][1].update(finish="cut"), "is 'cut', not one of stop, length, abort"),
    ("seqs[2].finish", lambda s: s["seqs"][2].update(finish="paused"), "is 'paused', not one of"),
    ("chunks_done", lambda s: s.update(chunks_done=-1), "is -1, outside 0..inf"),
    ("chunks_done", lambda s: s.update(chunks_done=1.5), "is 1.5 (float), not a whole number"),
    ("seqs", lambda s: s["seqs"].pop(), "holds 3 sequences, this generation 4 (2 prompts x 2)"),
    ("seqs[0].log_probs", lambda s: s["seqs"][0]["log_probs"].pop(), "holds 1 values for 2 tokens"),
    ("seqs[1].log_probs[2]", lambda s: s["seqs"][1]["log_probs"].__setitem__(2, float("nan")), "is nan, not a finite"),
    ("seqs[0].versions", lambda s: s["seqs"][0]["versions"].append(3), "holds 3 values for 2 tokens"),
    ("seqs[0].versions[1]", lambda s: s["seqs"][0]["versions"].__setitem__(1, STEP + 1), "is 4, outside 0..3"),
    ("seqs[0].versions[0]", lambda s: s["seqs"][0]["versions"].__setitem__(0, -1), "is -1, outside 0..3"),
    ("seqs[1].versions[1]", lambda s: s["seqs"][1]["versions"].__setitem__(1, 0), "is 0, older than the token before"),
    ("seqs[2].tokens[0]", lambda s: s["seqs"][2]["tokens"].__setitem__(0, -4), "is -4, outside 0..inf"),
    ("seqs[2].tokens", lambda s: s["seqs"][2].update(tokens="abc"), "is a str, not a list"),
    ("seqs[1].tokens", lambda s: s["seqs"][1].update(tokens=[1] * 5, log_probs=[-0.1] * 5, versions=[1] * 5),
     "holds 5 tokens, more than the 4"),
    ("seqs[2].finish", lambda s: s["seqs"][2].update(tokens=[1] * 4, log_probs=[-0.1] * 4, versions=[1] * 4),
     "is null (unfinished) at the full 4 tokens"),
    ("seqs[3].prompt", lambda s: s["seqs"][3].update(prompt=[5, 17, 42]), "is not the prompt of this batch's row"),
    ("seqs[0]", lambda s: s["seqs"].__setitem__(0, [1, 2]), "is a list, not a dict"),
]


@pytest.mark.parametrize("field,change,words", BAD, ids=[f"{b[0]}:{b[2][:24]}" for b in BAD])
def test_each_field_of_a_saved_generation_is_checked(field, change, words):
    state = copy.deepcopy(saved())
    change(state)
    with pytest.raises(ConfigError) as err:
        load(state)
    line = str(err.value)
    assert "\n" not in line and line.startswith("trainer.resume_mode: the checkpoint's stream state: ")
    assert f"the batch 5's gens[0].{field} {words}" in line, line
    assert "trainer.resume_mode=disable" in line


def test_numpy_numbers_are_numbers():
    state = saved()
    state["seqs"][1]["tokens"] = list(np.array([7, 7, 8, 1]))
    state["seqs"][1]["log_probs"] = list(np.array([-0.5, -0.1, -0.3, -0.2], dtype=np.float32))
    load(state)


def batch_state(**change) -> dict:
    prompts = DataProto.from_dict(non_tensors={"x": np.array([0, 1], dtype=object)})
    return {"t": 5, "prompts": prompts, "loader": {}, "version": 2, "chunks": 1, "in_tail": False,
            "gens": [saved()], "taken": [1], **change}


def check(partial, next_t=6, handed=4, ahead=0, groups=False):
    check_saved_stream(partial, ahead, handed, next_t, STEP, total=8, groups=groups)


def test_the_buffer_in_flight_loads():
    check([batch_state()])
    check([batch_state(t=6), batch_state(t=5)], next_t=7)
    check(batch_state(), next_t=None)        # the older form: one batch, numbered after the rest
    check([], next_t=5)
    # handoff=finished_groups: a batch outlives the step that took its first groups
    check([batch_state(t=3), batch_state(t=5)], next_t=6, handed=4, groups=True)
    with pytest.raises(ConfigError, match=r"buffer_partial\[0\].t is 0, outside 1..8"):
        check([batch_state(t=0)], next_t=6, handed=4, groups=True)
    with pytest.raises(ConfigError, match=r"buffer_next_t is 4, outside 5..9"):
        check([batch_state(t=3)], next_t=4, handed=4, groups=True)


BUFFER = [  # (partial, next_t, where, words)
    ([batch_state(chunks=-2)], 6, "buffer_partial[0].chunks", "is -2, outside 0..inf"),
    ([batch_state(version=STEP + 1)], 6, "buffer_partial[0].version", "is 4, outside -1..3"),
    ([batch_state(t=4)], 6, "buffer_partial[0].t", "is 4, outside 5..8"),
    ([batch_state(t=9)], 10, "buffer_partial[0].t", "is 9, outside 5..8"),
    ([batch_state(), batch_state()], 7, "buffer_partial[1].t", "is 5, a batch number given twice"),
    ([batch_state(in_tail="yes")], 6, "buffer_partial[0].in_tail", "is 'yes', not true or false"),
    ([batch_state(taken=[2])], 6, "buffer_partial[0].taken[0]", "is 2, outside 0..1"),
    ([batch_state(taken=[1, 1])], 6, "buffer_partial[0].taken", "names a prompt group twice"),
    ([batch_state(prompts=[[1]])], 6, "buffer_partial[0].prompts", "is a list, not a batch of prompts"),
    ([batch_state(gens={"0": {}})], 6, "buffer_partial[0].gens", "is a dict, not a list"),
    ([batch_state()], 5, "buffer_next_t", "is 5, outside 6..9"),
    ([batch_state()], 10, "buffer_next_t", "is 10, outside 6..9"),
    ([batch_state(t=7)], 7, "buffer_next_t", "is 7, outside 8..9"),
    ([batch_state()], "6", "buffer_next_t", "is '6' (str), not a whole number"),
]


@pytest.mark.parametrize("partial,next_t,where,words", BUFFER, ids=[f"{b[2]}:{b[3][:20]}" for b in BUFFER])
def test_each_field_of_the_saved_buffer_is_checked(partial, next_t, where, words):
    with pytest.raises(ConfigError) as err:
        check(partial, next_t)
    assert "\n" not in str(err.value) and f"stream state: {where} {words}" in str(err.value), str(err.value)
