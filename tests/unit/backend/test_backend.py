"""The backend room: the group forms it turns into one another (pure arithmetic), the host
coordination of replica threads, and that no other module decides eager-versus-XLA."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from nxd_smp.backend.base import replica_partition
from nxd_smp.backend.base import check_replica_groups, is_replica_groups
from nxd_smp.backend.coordination import ThreadCoordinator
from nxd_smp.core.errors import CoordinationError

PACKAGE = Path(__file__).resolve().parents[3] / "nxd_smp"


@pytest.mark.parametrize(
    "ranks, world, expected",
    [
        ([0, 1, 2, 3], 4, [[0, 1, 2, 3]]),
        ([0], 1, [[0]]),
        ([2, 3], 4, [[0, 1], [2, 3]]),  # a data-parallel block (NxD with pipeline stages)
        ([1, 3], 4, [[0, 2], [1, 3]]),  # a strided slice (NxD's data parallel beside tensor parallel)
        ([3, 1], 4, [[0, 2], [1, 3]]),
        ([5], 8, [[0], [1], [2], [3], [4], [5], [6], [7]]),
        ([4, 5, 6, 7], 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ([1, 5], 8, [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ],
)
def test_a_process_groups_ranks_complete_into_the_partition_it_belongs_to(ranks, world, expected):
    assert replica_partition(ranks, world) == expected
    assert sorted(ranks) in expected
    assert sorted(r for g in expected for r in g) == list(range(world))


@pytest.mark.parametrize("ranks, world", [([0, 1, 2], 4), ([1, 2], 4), ([0, 3], 4), ([0, 0], 2), ([4], 4), ([], 2)])
def test_ranks_that_fit_no_partition_are_refused_with_the_fix(ranks, world):
    with pytest.raises(ValueError, match="replica groups|equal groups"):
        replica_partition(ranks, world)


def test_replica_groups_must_split_the_world():
    assert is_replica_groups([[0, 1], [2, 3]]) and not is_replica_groups([[0, True]]) and not is_replica_groups([])
    assert check_replica_groups(([0, 2], [1, 3]), 4) == [[0, 2], [1, 3]]
    for bad in ([[0, 1]], [[0, 1], [1, 2]], [[0], [1, 2, 3]]):
        with pytest.raises(ValueError, match="replica groups"):
            check_replica_groups(bad, 4)


def test_replica_threads_coordinate_without_a_process_group():
    ranks, results, errors = (4, 6, 5), {}, []

    def replica(rank: int) -> None:
        try:
            c = ThreadCoordinator(ranks, rank)
            gathered = c.all_gather({"rank": rank, "files": [rank] * rank})
            chosen = c.broadcast(f"version-{rank}")  # rank 0's value everywhere
            c.barrier()
            results[rank] = (gathered, chosen)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    for rank in range(3):
        gathered, chosen = results[rank]
        assert gathered == [{"rank": r, "files": [r] * r} for r in range(3)] and chosen == "version-0"


def test_a_replica_that_never_arrives_is_an_error_not_a_hang():
    with pytest.raises(CoordinationError, match="did not call it"):
        ThreadCoordinator((0, 1), 0, timeout=0.5).barrier()


def test_payloads_travel_as_json_under_every_coordinator():
    with pytest.raises(TypeError):
        ThreadCoordinator((9,), 0).all_gather({"not": object()})


# Kernel choices inside the eager path (a CPU or CUDA kernel, host memory) may stay next to
# their kernels; the eager-versus-XLA decision may not leave the backend.
_DEVICE_DECISION = re.compile(r"""(==|!=)\s*["']xla["']|["']xla["']\s*(==|!=)|\bin\s*\(\s*["']cpu["']\s*,\s*["']cuda["']\s*\)|is_xla|_views\b""")


def test_no_module_outside_the_backend_decides_eager_versus_xla():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "backend":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _DEVICE_DECISION.search(line):
                found.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not found, "device decisions outside nxd_smp/backend:\n" + "\n".join(found)
