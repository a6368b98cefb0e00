"""DataProto: the batch container every stage passes along."""
import numpy as np
import pytest
import torch

from megarl.protocol import DataProto


def make(n=4):
    return DataProto.from_dict({"x": torch.arange(n * 2).view(n, 2)}, {"p": [f"p{i}" for i in range(n)]}, {"t": 1.0})


def test_len_and_attribute_access():
    d = make()
    assert len(d) == 4 and len(d.batch) == 4  # verl's custom-rollout guide uses len(batch.batch) as the batch size
    assert list(d.p) == ["p0", "p1", "p2", "p3"]
    d.log_probs = torch.zeros(4, 3)
    d.responses = ["a", "b", "c", "d"]
    assert "log_probs" in d.batch and "responses" in d.non_tensor_batch
    with pytest.raises(ValueError, match="rows"):
        d.bad = torch.zeros(3, 1)
    with pytest.raises(AttributeError, match="no field"):
        d.nothing


def test_repeat_interleave_keeps_groups_adjacent():
    r = make(2).repeat(3)
    assert list(r.p) == ["p0"] * 3 + ["p1"] * 3
    assert r.x[:, 0].tolist() == [0, 0, 0, 2, 2, 2]
    t = make(2).repeat(2, interleave=False)
    assert list(t.p) == ["p0", "p1", "p0", "p1"]


def test_chunk_concat_roundtrip_and_errors():
    d = make(6)
    parts = d.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    back = DataProto.concat(parts)
    assert torch.equal(back.x, d.x) and list(back.p) == list(d.p)
    with pytest.raises(ValueError, match="equal chunks"):
        d.chunk(4)


def test_concat_pads_ragged_widths():
    a = DataProto.from_dict({"r": torch.ones(1, 2)})
    b = DataProto.from_dict({"r": torch.ones(1, 4)})
    c = DataProto.concat([a, b])
    assert c.r.shape == (2, 4) and c.r[0].tolist() == [1, 1, 0, 0]


def test_select_index_union_save(tmp_path):
    d = make()
    sub = d[np.array([True, False, True, False])]
    assert list(sub.p) == ["p0", "p2"]
    assert list(d[1:3].p) == ["p1", "p2"]
    other = DataProto.from_dict({"y": torch.ones(4)})
    d.union(other)
    assert "y" in d.batch
    path = tmp_path / "b.pt"
    d.save_to_disk(str(path))
    e = DataProto.load_from_disk(str(path))
    assert torch.equal(e.x, d.x) and list(e.p) == list(d.p) and e.meta_info == d.meta_info
    c = d.clone()
    c.x[0, 0] = 99
    assert d.x[0, 0] == 0
