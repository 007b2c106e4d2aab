"""Stand-in for ``neuronx_distributed/parallel_layers/parallel_state.py`` of neuronx-distributed
0.18.0 (Neuron SDK 2.29): the getters nxd_smp, NxD's trainer and optimum-neuron call, by NxD's
names, over NxD's rank layout (``tests.nxd_stand_in.layout``). By default initialised at world
size 1 (tensor, pipeline and context parallel sizes 1); ``configure`` sets another layout. NxD
cannot be installed here."""

from __future__ import annotations

from tests.nxd_stand_in import layout

_state: dict = {}


def configure(world: int, tp: int = 1, pp: int = 1, rank: int = 0, initialized: bool = True) -> None:
    """The layout the getters describe, as global rank ``rank`` sees it."""
    _state.update(world=world, rank=rank, initialized=initialized, tp=tp, pp=pp, groups=layout(world, tp, pp))


configure(1)


def _groups(kind: str) -> list[list[int]]:
    return [list(g) for g in _state["groups"][kind]]


def _index(kind: str) -> int:
    return next(g.index(_state["rank"]) for g in _state["groups"][kind] if _state["rank"] in g)


def model_parallel_is_initialized() -> bool:
    return _state["initialized"]


def is_global_rank_zero() -> bool:
    return _state["rank"] == 0


def get_tensor_model_parallel_size() -> int:
    return _state["tp"]


def get_pipeline_model_parallel_size() -> int:
    return _state["pp"]


def get_data_parallel_size() -> int:
    return _state["world"] // (_state["tp"] * _state["pp"])


def get_context_model_parallel_size() -> int:
    return 1


def get_expert_model_parallel_size() -> int:
    return 1


def get_data_parallel_replica_groups() -> list[list[int]]:
    return _groups("dp")


def get_zero1_sharding_groups() -> list[list[int]]:
    return _groups("dp")  # data x context parallel: context parallel size 1 here


def get_tensor_model_parallel_replica_groups() -> list[list[int]]:
    return _groups("tp")


def get_pipeline_model_parallel_replica_groups() -> list[list[int]]:
    return _groups("pp")


def get_context_model_parallel_replica_groups() -> list[list[int]]:
    return [[r] for r in range(_state["world"])]


def get_data_parallel_rank() -> int:
    return _index("dp")


def get_tensor_model_parallel_rank() -> int:
    return _index("tp")


def get_pipeline_model_parallel_rank() -> int:
    return _index("pp")
