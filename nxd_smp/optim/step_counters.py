"""Each parameter's own step counters, as torch.optim keeps them, in an optimizer that steps flat shards.

torch.optim keeps a ``step`` per parameter: a parameter frozen at step time gets no gradient and its
counter stands still, so when it is unfrozen Adam's bias correction starts where it stopped. The
inner optimizer here steps one flat shard per bucket, with one counter per shard. As long as every
managed parameter has stepped every time, those counters are every parameter's, and nothing more is
kept (the common case costs nothing).

Once a step runs with some managed parameters frozen, parameters that stepped together until then
no longer do. ``StepCounters`` follows this on the host, from the frozen sets alone:

* every managed parameter has a *history*, a number shared by the parameters that have stepped
  at exactly the same steps so far (so their counters are equal whatever the data: a step skipped
  on an fp16 overflow is skipped by all). A new frozen set splits each history in two, its frozen
  and its stepping parameters;
* each history keeps its counters (the inner optimizer's 0-dim state: Adam's ``step``), one set of
  tensors per history;
* for a step, this rank's shard of each bucket is cut into *runs*, the longest stretches of
  parameters of one history. ``InnerStep`` then hands the inner optimizer, instead of each shard,
  one view of it per run whose history steps now, with its history's counters and views of the
  bucket's moments as its state. torch.optim's own kernels then keep each run's counter, as they
  keep each of their own parameters': a run of frozen parameters is not in the step at all, exactly
  as torch skips a parameter without a gradient. The moments stay the bucket's flat tensors (the
  views write into them), so checkpoints, the state dict and the publication see one flat state.

A history none of whose parameters lies in this rank's shard is advanced by one per step taken
(not skipped), so every rank reports every parameter's counters alike.

On XLA a cut of the shard would depend on the rank, and so give every rank its own program. There
(``elementwise``) the shard is not cut: for the step, its counter is replaced by one value per element,
each its parameter's history's, gathered from the histories' counters with an index of the shard's
elements built once on the host per rank and uploaded as data (so the program is every rank's), and
torch's Adam/AdamW, which uses ``step`` only in elementwise arithmetic, corrects each element by its own
count. Frozen elements are put back after the step as on every path, and each history that steps now
advances by one. Where the inner optimizer cannot take such a counter (another class, or a kernel that
reads ``step`` on the host) the counters stay the bucket's (``enabled=False``), and a parameter unfrozen
after frozen steps is warned about once (docs/design.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import warnings

import torch

from ..core.layout import BucketLayout
from .state_fit import is_moment


@dataclass(frozen=True)
class Run:
    """Elements ``[start, end)`` of this rank's shard of a bucket, whose parameters share ``history``."""

    start: int
    end: int
    history: int


def counters_of(state: Mapping[str, Any]) -> dict[str, Any]:
    """The counters of an inner-state entry (every value but the moments): copies of its tensors."""
    return {key: value.detach().clone() if isinstance(value, torch.Tensor) else value
            for key, value in state.items() if not is_moment(key, value)}


class StepCounters:
    """The step histories of the managed parameters and their counters (see the module's text).

    Args:
        layouts: the buckets; their parameter indices number the managed parameters.
        rank: this rank in the data-parallel group (its shard's pieces).
        bucket_state: the inner optimizer's state of bucket ``b``'s shard (the counters every history
            starts from when the first frozen set splits them).
        enabled: keep per-parameter counters; False keeps the buckets' (and warns once).
        elementwise: the step takes one counter per element of the shard (``element_counter``) instead
            of one view of it per run (``runs``): where the cut would depend on the rank (XLA).
    """

    def __init__(self, layouts: Sequence[BucketLayout], rank: int,
                 bucket_state: Callable[[int], Mapping[str, Any]], *, enabled: bool, elementwise: bool = False):
        self._layouts = list(layouts)
        self._rank = rank
        self._bucket_state = bucket_state
        self.enabled = enabled
        self.elementwise = elementwise
        self._element_index: dict[int, torch.Tensor] = {}  # bucket -> its shard's parameter per element
        self._history: list[int] | None = None  # per managed parameter; None: all stepped alike so far
        # history -> its counters (absent: no state yet, a class that makes it at the first step)
        self._counters: dict[int, dict[str, Any]] = {}
        self._runs: list[list[Run]] = []
        self._frozen: frozenset[int] = frozenset()
        self._frozen_histories: set[int] = set()
        self._warned = False

    @property
    def split(self) -> bool:
        """Whether the parameters' histories have parted (the step then goes run by run)."""
        return self._history is not None

    def runs(self, b: int) -> list[Run]:
        """Bucket ``b``'s runs in this rank's shard (only while ``split``)."""
        return self._runs[b]

    def steps_now(self, history: int) -> bool:
        """Whether the parameters of ``history`` step now (none of them frozen)."""
        return history not in self._frozen_histories

    def counters(self, history: int) -> dict[str, Any] | None:
        """``history``'s counters (the live tensors), None where it has none yet."""
        return self._counters.get(history)

    def param_counters(self, index: int) -> dict[str, Any] | None:
        """The counters of managed parameter ``index`` (live tensors), None where they are its bucket's."""
        if self._history is None:
            return None
        return self._counters.get(self._history[index])

    def tensors(self) -> list[torch.Tensor]:
        """Every counter tensor the histories hold (a skipped step puts them back too)."""
        return [v for counters in self._counters.values() for v in counters.values() if isinstance(v, torch.Tensor)]

    def element_counter(self, b: int, key: str, device: torch.device) -> torch.Tensor | None:
        """Counter ``key`` of every element of this rank's shard of bucket ``b`` on ``device`` (the
        shard's): its parameter's history's, the padding's 0 (only while ``split`` and ``elementwise``).
        The counters go to ``device`` as one small vector (data: counters kept on the host are uploaded,
        not baked into the program) and are gathered there. None where a history has no tensor ``key``."""
        layout = self._layouts[b]
        values = [self._counters.get(self._history[i], {}).get(key) for i in layout.param_indices]
        if not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in values):
            return None
        values.append(torch.zeros_like(values[0]))  # (the padding's)
        return torch.stack(values).to(device).index_select(0, self._index_of(b, device))

    def _index_of(self, b: int, device: torch.device) -> torch.Tensor:
        """Each element of this rank's shard of bucket ``b``: the position of its parameter in the bucket
        (the padding: one past the last). Built once on the host and uploaded: data, not the program."""
        index = self._element_index.get(b)
        if index is None:
            layout = self._layouts[b]
            host = torch.full((layout.shard_numel,), len(layout.param_indices), dtype=torch.int32)
            for piece in layout.pieces(self._rank):
                host[piece.shard_start:piece.shard_start + piece.numel] = piece.index
            index = self._element_index[b] = host.to(device)
        return index

    # ------------------------------------------------------------------ following the frozen sets
    def track(self, frozen: Sequence[int]) -> None:
        """This step's frozen managed parameters (indices): a new frozen set splits every history into
        its frozen and its stepping part, each part with a copy of the counters."""
        frozen = frozenset(frozen)
        if frozen == self._frozen:
            return
        unfrozen, self._frozen = self._frozen - frozen, frozen
        if not self.enabled:
            if unfrozen and not self._warned and any("step" in self._bucket_state(b) for b in range(len(self._layouts))):
                self._warned = True
                warnings.warn(
                    "nxd_smp: parameters frozen for some steps train again; on an XLA device this inner optimizer "
                    "(not torch.optim.Adam or AdamW in their default kernel, without foreach, fused or "
                    "differentiable) keeps one step counter per bucket, which went on while they were frozen (torch.optim's stands still), so "
                    "its bias correction differs from torch's for them. Use torch.optim.Adam or AdamW with their "
                    "default kernel, unfreeze before the first step, or train on CPU/CUDA, where every class "
                    "keeps a counter per parameter.", stacklevel=5)
            return
        if self._history is None:
            if not frozen:
                return
            start = next((counters_of(state) for b in range(len(self._layouts))
                          if (state := self._bucket_state(b))), None)
            self._history = [0] * sum(len(layout.param_indices) for layout in self._layouts)
            self._counters = {} if start is None else {0: start}  # (a state without counters is started too)
        parts: dict[tuple[int, bool], int] = {}
        history = [parts.setdefault((h, i in frozen), len(parts)) for i, h in enumerate(self._history)]
        halves = Counter(old for old, _ in parts)  # (a history that does not part keeps its tensors)
        self._counters = {new: self._counters[old] if halves[old] == 1 else counters_of(self._counters[old])
                          for (old, _), new in parts.items() if old in self._counters}
        self._set(history)
        self._frozen_histories = {h for (_, is_frozen), h in parts.items() if is_frozen}

    def _set(self, history: list[int]) -> None:
        self._history = history
        self._runs = [] if self.elementwise else [self._cut(layout) for layout in self._layouts]

    def _cut(self, layout: BucketLayout) -> list[Run]:
        """This rank's shard of ``layout`` as runs of one history each (the padding with the last)."""
        runs: list[Run] = []
        for piece in layout.pieces(self._rank):
            h = self._history[layout.param_indices[piece.index]]
            if runs and runs[-1].history == h:
                runs[-1] = Run(runs[-1].start, piece.shard_start + piece.numel, h)
            else:
                runs.append(Run(runs[-1].end if runs else 0, piece.shard_start + piece.numel, h))
        if runs:
            runs[-1] = Run(runs[-1].start, layout.shard_numel, runs[-1].history)
        return runs

    # ------------------------------------------------------------------ after a step
    def record(self, history: int, counters: Mapping[str, Any]) -> None:
        """The counters a run of ``history`` came out of the step with (its history's from now)."""
        kept = self._counters.get(history)
        if kept is None:
            self._counters[history] = counters_of(counters)
            return
        for key, value in counters.items():
            old = kept.get(key)
            if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape == value.shape:
                old.copy_(value)
            else:
                kept[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value

    def advance_elsewhere(self, local: set[int], found_inf: torch.Tensor | None) -> None:
        """Advance by one step (none where ``found_inf``) the ``step`` of each history that stepped now
        but has no run in this rank's shard (``local``: the histories that do; elementwise: none)."""
        for h, counters in self._counters.items():
            step = counters.get("step")
            if h in local or not isinstance(step, torch.Tensor) or not self.steps_now(h):
                continue
            step.add_(1 if found_inf is None else (~found_inf).to(step.device, step.dtype))

    # ------------------------------------------------------------------ a load
    def load(self, per_param: Sequence[Mapping[str, Any] | None]) -> None:
        """Counters of each managed parameter from a checked state (None: its bucket's). Parameters with
        equal counters share a history; where every parameter's are equal, the buckets' are theirs."""
        self._frozen, self._frozen_histories = frozenset(), set()
        if not self.enabled:
            return
        keys = [None if c is None else tuple(sorted((k, _value(v)) for k, v in c.items())) for c in per_param]
        if len({k for k in keys if k is not None}) <= 1:
            self._history, self._counters, self._runs = None, {}, []
            return
        ids: dict[Any, int] = {}
        history = [ids.setdefault(k, len(ids)) for k in keys]
        self._counters = {}
        for i, h in enumerate(history):
            if per_param[i] is not None and h not in self._counters:
                self._counters[h] = self._placed(counters_of(per_param[i]))
        self._set(history)

    def _placed(self, counters: dict[str, Any]) -> dict[str, Any]:
        """Loaded ``counters`` on the device and in the dtype of the buckets' counters of the same key
        (a capturable or fused kernel keeps ``step`` on the parameters' device; a checkpoint holds it
        on the CPU)."""
        for key, value in counters.items():
            like = next((state[key] for b in range(len(self._layouts))
                         if isinstance((state := self._bucket_state(b)).get(key), torch.Tensor)), None)
            if isinstance(value, torch.Tensor) and like is not None:
                counters[key] = value.to(device=like.device, dtype=like.dtype)
        return counters

    def snapshot(self) -> Callable[[], None]:
        """The call that puts the histories and counters back as they are now (a refused load's undo)."""
        kept = (self._history, {h: counters_of(c) for h, c in self._counters.items()}, self._runs, self._frozen,
                self._frozen_histories)

        def restore() -> None:
            self._history, self._counters, self._runs, self._frozen, self._frozen_histories = kept

        return restore


def _value(value: Any) -> Any:
    """A counter's value on the host (a load compares them; it may read the device)."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
