"""The bucket layout as pure arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nxd_smp.core.layout import ALIGN, intersect, padded_numel, plan_buckets, shard_range


def test_padding_examples():
    assert padded_numel(0, 1) == ALIGN  # an empty bucket still has one unit per rank
    assert padded_numel(16, 1) == 16
    assert padded_numel(17, 1) == 32
    assert padded_numel(100, 3) == 144  # 3 * 16 * 3
    assert padded_numel(10, 64) == 64 * 16  # more ranks than elements: one unit each


def test_shard_ranges_tile_the_bucket():
    assert [shard_range(96, 3, r) for r in range(3)] == [(0, 32), (32, 64), (64, 96)]
    with pytest.raises(ValueError):
        shard_range(100, 3, 0)
    with pytest.raises(ValueError):
        shard_range(96, 3, 3)


def test_intersect():
    assert intersect((0, 10), (5, 20)) == (5, 10)
    assert intersect((0, 5), (5, 9)) is None


def test_buckets_split_at_the_cap_and_by_key():
    buckets = plan_buckets([10, 10, 10, 50, 5], ["a", "a", "b", "a", "a"], world_size=2, cap_numel=25)
    assert [(b.key, b.param_indices) for b in buckets] == [
        ("a", (0, 1)),
        ("a", (3,)),  # larger than the cap: alone
        ("a", (4,)),
        ("b", (2,)),
    ]
    assert buckets[0].offsets == (0, 10) and buckets[0].padded_numel == 32
    assert buckets[1].padded_numel == 64 and buckets[1].shard_numel == 32


def test_zero_dim_and_empty_parameters():
    (bucket,) = plan_buckets([1, 0, 3], [0, 0, 0], world_size=4, cap_numel=None)
    assert bucket.offsets == (0, 1, 1) and bucket.numel == 4 and bucket.padded_numel == 64


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        plan_buckets([1], [0, 1], 1, None)
    with pytest.raises(ValueError):
        plan_buckets([1], [0], 1, 0)
    with pytest.raises(ValueError):
        padded_numel(-1, 1)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=30),
    keys=st.data(),
    world_size=st.integers(1, 70),
    cap=st.one_of(st.none(), st.integers(1, 400)),
)
def test_layout_invariants(sizes, keys, world_size, cap):
    key_list = keys.draw(st.lists(st.sampled_from("xyz"), min_size=len(sizes), max_size=len(sizes)))
    buckets = plan_buckets(sizes, key_list, world_size, cap)
    seen = []
    for b in buckets:
        # one key per bucket, parameters in their original order
        assert all(key_list[i] == b.key for i in b.param_indices)
        assert list(b.param_indices) == sorted(b.param_indices)
        # contiguous, non-overlapping parameter ranges
        position = 0
        for i, index in enumerate(b.param_indices):
            assert b.param_range(i) == (position, position + sizes[index])
            position += sizes[index]
        assert b.numel == position
        # padding: a multiple of world_size * ALIGN, never less than the content
        assert b.padded_numel % (world_size * ALIGN) == 0
        assert position <= b.padded_numel < max(position, 1) + world_size * ALIGN
        # the cap holds unless a single parameter is larger than it
        if cap is not None and len(b.param_indices) > 1:
            assert position <= cap
        # shards tile the bucket exactly, each ALIGN-aligned
        ranges = [b.shard_range(r) for r in range(world_size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == b.padded_numel
        assert all(ranges[r][1] == ranges[r + 1][0] for r in range(world_size - 1))
        assert all(start % ALIGN == 0 for start, _ in ranges)
        seen.extend(b.param_indices)
    assert sorted(seen) == list(range(len(sizes)))  # every parameter exactly once
    # buckets of one key appear in the order of that key's parameters
    for key in "xyz":
        order = [i for b in buckets if b.key == key for i in b.param_indices]
        assert order == [i for i, k in enumerate(key_list) if k == key]


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 200), min_size=1, max_size=10), world_size=st.integers(1, 9))
def test_pieces_cover_every_parameter_once(sizes, world_size):
    (bucket,) = plan_buckets(sizes, [0] * len(sizes), world_size, None)
    covered = [[] for _ in sizes]
    for rank in range(world_size):
        start, end = bucket.shard_range(rank)
        for piece in bucket.pieces(rank):
            offset = bucket.offsets[piece.index]
            # the piece sits at the same flat position seen from the param and the shard
            assert offset + piece.param_start == start + piece.shard_start
            assert start <= start + piece.shard_start < start + piece.shard_start + piece.numel <= end
            covered[piece.index].append((piece.param_start, piece.param_end))
    for i, n in enumerate(sizes):
        ranges = sorted(covered[i])
        position = 0
        for lo, hi in ranges:
            assert lo == position and hi > lo
            position = hi
        assert position == n
