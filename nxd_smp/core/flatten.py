"""A bucket's flat, padded tensor, made from its parameters' tensors: the one flattener of every
source that builds a bucket (the gradient sources at step time, XLA's parameter shards, the masks of
frozen elements), on every backend.

Each parameter's tensor goes to its range of the bucket (``BucketLayout.param_range``), cast to the
bucket's dtype; a parameter without one, and the padding, are zeros. Into a buffer the caller holds
(eager devices: one copy per parameter), or as one concatenation (on XLA one concatenation beats slice
updates of a large buffer, which would each copy it; on eager devices it is one pass, as the copies into
a zeroed buffer were).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import BucketLayout


def flatten_bucket(layout: BucketLayout, parts: Sequence[torch.Tensor | None], dtype: torch.dtype,
                   device: torch.device, *, into: torch.Tensor | None = None) -> torch.Tensor:
    """Bucket ``layout``'s flat, padded tensor of ``dtype``: per parameter (in the bucket's order) its
    tensor in ``parts``, any shape of its element count, or None for zeros; the padding zeros. Written
    into ``into`` (a 1-D tensor of ``padded_numel`` elements, returned) where given, else one
    concatenation."""
    if into is not None:
        for i, part in enumerate(parts):
            start, end = layout.param_range(i)
            if part is None:
                into[start:end].zero_()
            else:
                into[start:end].copy_(part.reshape(-1))
        into[layout.numel:].zero_()
        return into
    flat = [torch.zeros(n, dtype=dtype, device=device) if part is None else part.reshape(-1).to(dtype)
            for part, n in zip(parts, layout.numels)]
    if layout.padded_numel > layout.numel:
        flat.append(torch.zeros(layout.padded_numel - layout.numel, dtype=dtype, device=device))
    return torch.cat(flat)
