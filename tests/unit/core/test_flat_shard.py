"""``FlatShard``: a rank's flat range of a parameter as the boxes torch's distributed checkpoint plans.

The oracle of ``boxes`` is the row-major numbering itself: the elements the boxes select, read box by
box, are exactly ``start..end-1`` in order (so they tile the range, never overlap, and each is contiguous),
and there are at most 2N-1 of them.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxd_smp.core.flat_shard import FlatShard, boxes


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    return shape, start, draw(st.integers(start, n))


@settings(max_examples=400, deadline=None)
@given(shape_and_range())
def test_the_boxes_select_exactly_the_range_in_order(case):
    shape, start, end = case
    numbering = torch.arange(math.prod(shape)).view(shape)
    found = []
    for offsets, sizes in boxes(shape, start, end):
        found += numbering[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1).tolist()
    assert found == list(range(start, end))
    assert len(boxes(shape, start, end)) <= max(1, 2 * len(shape) - 1)


def test_a_flat_shard_describes_its_boxes_at_its_global_offset_and_hands_out_views():
    local = torch.arange(5.0)
    shard = FlatShard(local, 3, (4, 3), (8, 3), (4, 0))  # elements 3..7 of rows 4..7 of an 8x3 tensor
    assert shard.shape == (8, 3)
    chunks = shard.__create_chunk_list__()
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [((5, 0), (1, 3)), ((6, 0), (1, 2))]

    class Index:
        fqn, offset = "w", torch.Size((6, 0))

    view = shard.__get_tensor_shard__(Index())
    view.fill_(-1.0)  # (dcp.load writes into it in place)
    assert local.tolist() == [0.0, 1.0, 2.0, -1.0, -1.0]


def test_it_pickles_as_its_range_and_copies_as_itself_and_refuses_arithmetic():
    shard = FlatShard(torch.arange(4.0), 2, (2, 3))
    buffer = io.BytesIO()
    torch.save({"exp_avg": shard}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["exp_avg"]
    assert type(loaded) is torch.Tensor and loaded.tolist() == [0.0, 1.0, 2.0, 3.0]
    twin = copy.deepcopy(shard)
    assert isinstance(twin, FlatShard) and (twin.start, twin.local_shape) == (2, (2, 3))
    assert twin.local.data_ptr() != shard.local.data_ptr()
    with pytest.raises(TypeError, match="FlatShard"):
        torch.zeros(2, 3).copy_(shard)
    with pytest.raises(ValueError, match="does not lie"):
        FlatShard(torch.zeros(5), 3, (2, 3))
