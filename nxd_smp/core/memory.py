"""Where the buffers of the CPU optimizer step start in memory.

The step streams five shard-sized buffers at once: the fp32 master, Adam's two moments,
the fp32 gradient and the bf16 parameters. Large allocations are separate ``mmap``s
that all start at the same offset within a page, so two of them can end up a large
power of two apart (measured: 256 MiB) depending on what was allocated and freed in
between; streams that read and write at such a distance conflict in the CPU's caches
and the one-pass update ran 1.4x slower (20 ms instead of 14 ms for 21M parameters on
the reference machine) for no reason visible in the code. Starting each stream at its
own offset within the page keeps any two of them off that pattern, whatever the
allocator did.

``staggered_empty`` allocates so; ``is_staggered`` says whether a tensor already starts
where its stream should. Only CPU tensors are placed; other devices get plain
allocations. ``plain_alias`` gives a compiled kernel the same memory as a tensor with no
view history, so every call looks alike to its guards.
"""

from __future__ import annotations

import torch

_PAGE = 4096

#: Byte offset within a page at which each stream of the step starts.
STREAMS = {"master": 0, "param": 512, "exp_avg": 1024, "exp_avg_sq": 2048, "grad": 3072}


def _offset(stream: str) -> int:
    try:
        return STREAMS[stream]
    except KeyError:
        raise ValueError(f"unknown stream {stream!r}; one of {sorted(STREAMS)}") from None


def is_staggered(tensor: torch.Tensor, stream: str) -> bool:
    """Whether ``tensor`` starts at ``stream``'s offset within a page (always True off CPU)."""
    return tensor.device.type != "cpu" or tensor.data_ptr() % _PAGE == _offset(stream)


def staggered_empty(numel: int, dtype: torch.dtype, device: torch.device | str, stream: str) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``numel`` elements; on CPU its data start at
    ``stream``'s offset within a page.

    The tensor has a storage of its own (a slice of an allocation at most one page
    larger, which it keeps alive) and a storage offset of 0, so it saves, copies and
    compiles like any freshly allocated tensor."""
    device = torch.device(device)
    want = _offset(stream)
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    base = torch.empty(numel + _PAGE // itemsize, dtype=dtype)
    shift = (want - base.data_ptr()) % _PAGE
    if shift % itemsize:
        shift = 0  # an allocator that does not align to the element size: leave it be
    storage = base.untyped_storage()[shift : shift + numel * itemsize]
    return torch.empty(0, dtype=dtype).set_(storage)


def plain_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory as the contiguous ``tensor``, with a storage of its
    own, a storage offset of 0 and no base: writes through either are seen by both.

    ``torch.compile`` guards on whether an input is a view and on its storage offset
    (0, 1 or more): shards of one flat buffer, loaded states and fresh ones would each
    compile anew until the recompile limit turns compiling off. Through plain aliases
    they all look alike."""
    if not tensor.is_contiguous():
        raise ValueError("plain_alias needs a contiguous tensor")
    if tensor._base is None and tensor.storage_offset() == 0:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    storage = tensor.untyped_storage()[start : start + tensor.numel() * tensor.element_size()]
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, 0, tensor.shape, tensor.stride())
