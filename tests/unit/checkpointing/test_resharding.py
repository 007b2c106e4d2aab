"""Which saved pieces land where in a rank's new shards, as pure arithmetic: checked against
an element-by-element oracle (where each element of each parameter lives at the old and at
the new DP size) for random models, caps and sizes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nxd_smp.core.layout import param_pieces, plan_buckets, saved_pieces
from nxd_smp.optim.loading.staged import overlaps


def test_a_piece_straddling_a_boundary_is_copied_one_inside_is_read_whole():
    # one parameter of 40 elements; saved at DP 2 (pieces [0, 32), [32, 40)), loaded at DP 4
    (old,) = plan_buckets([40], [0], world_size=2, cap_numel=None)
    (new,) = plan_buckets([40], [0], world_size=4, cap_numel=None)
    saved = saved_pieces([old], 2, ["w"])["w"]
    assert saved == [(0, 32), (32, 40)]
    rank1 = new.pieces(1)  # elements [16, 32) of the parameter
    (part,) = overlaps(saved, rank1[0].param_start, rank1[0].param_end)
    assert (part.saved_start, part.src, part.dst, part.numel, part.whole) == (0, 16, 0, 16, False)
    rank2 = new.pieces(2)  # [32, 40), exactly the second saved piece
    (part,) = overlaps(saved, rank2[0].param_start, rank2[0].param_end)
    assert (part.saved_start, part.src, part.dst, part.numel, part.whole) == (32, 0, 0, 8, True)


def where(layouts, world, names):
    """Oracle: (name, element) -> (rank, bucket, position in the shard), element by element."""
    out = {}
    for rank in range(world):
        for b, layout in enumerate(layouts):
            start, end = layout.shard_range(rank)
            for i, index in enumerate(layout.param_indices):
                p_start, p_end = layout.param_range(i)
                for flat in range(max(start, p_start), min(end, p_end)):
                    out[(names[index], flat - p_start)] = (rank, b, flat - start)
    return out


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(0, 90), min_size=1, max_size=6),
    groups=st.data(),
    old_world=st.integers(1, 5),
    new_world=st.integers(1, 5),
    old_cap=st.sampled_from([None, 1, 40, 100]),
    new_cap=st.sampled_from([None, 1, 40, 100]),
)
def test_every_element_comes_from_where_it_was_saved(numels, groups, old_world, new_world, old_cap, new_cap):
    keys = groups.draw(st.lists(st.integers(0, 1), min_size=len(numels), max_size=len(numels)))
    names = [f"p{i}" for i in range(len(numels))]
    old = plan_buckets(numels, keys, old_world, old_cap)
    new = plan_buckets(numels, keys, new_world, new_cap)
    saved_at = where(old, old_world, names)
    lands_at = where(new, new_world, names)
    saved = saved_pieces(old, old_world, names)
    for name, ranges in saved.items():  # the saved pieces cut each parameter exactly once
        covered = [e for lo, hi in ranges for e in range(lo, hi)]
        assert covered == list(range(numels[names.index(name)]))
    filled = {}
    for rank in range(new_world):
        for name, (b, piece) in zip(names, param_pieces(new, rank)):
            if piece is None:
                continue
            for part in overlaps(saved[name], piece.param_start, piece.param_end):
                assert part.whole == (part.src == 0 and part.numel == part.saved_end - part.saved_start
                                      and piece.param_start <= part.saved_start and part.saved_end <= piece.param_end)
                for k in range(part.numel):
                    element = part.saved_start + part.src + k
                    assert (rank, b, piece.shard_start + part.dst + k) == lands_at[(name, element)]
                    assert saved_at[(name, element)][0] == _owner(saved[name], element, old, old_world, names, name)
                    filled[(name, element)] = filled.get((name, element), 0) + 1
    assert filled == {key: 1 for key in lands_at}  # every element read exactly once


def _owner(ranges, element, layouts, world, names, name):
    """The old rank whose saved piece holds ``element`` (the piece's position in rank order)."""
    for rank in range(world):
        for n, (_, piece) in zip(names, param_pieces(layouts, rank)):
            if n == name and piece is not None and piece.param_start <= element < piece.param_end:
                assert (piece.param_start, piece.param_end) in ranges
                return rank
    raise AssertionError(f"{name}[{element}] is in no saved piece")
