"""A load's one pipeline, whatever its format and entry point: **read** -> **check** -> **agree** ->
**install**, over a neutral staged state.

* ``run``: the stages in order (``run``, what every entry point calls), and the readers that stage
  no files: the rank-local state dict (``read_rank_state``; ``load_rank_state``, which
  ``Zero1Optimizer.load_state_dict`` calls) and whole per-parameter state (``full_state``);
* ``staged``: the neutral staged state a reader produces, what a rank asks for, and the resharding
  arithmetic;
* ``check``: the one check of a staged state against the live objects;
* ``install``: the install as one transaction, through the optimizer's ``rank_state``.

The formats that read files sit above, in ``nxd_smp.checkpointing``; nothing here imports it.
"""
