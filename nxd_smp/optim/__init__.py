"""The optimizer's parts, each one job of ``Zero1Optimizer`` (``nxd_smp.zero1_optimizer``):

* ``precision``: the precision plan, every dtype and the rounding, decided once;
* ``topology``: every group the step communicates over and this rank's place in them;
* ``masters``: this rank's master shards; ``rounding``: stochastic rounding and remainders;
* ``inner_step``: the inner optimizer's step and the publication into the parameters;
  ``compiled_adamw``: its one-pass compiled Adam/AdamW on CPU;
* ``norm``: the global gradient norm and the clip coefficient; ``loss_scaler``: fp16's scaling;
* ``param_groups``: the groups given, the inner optimizer's class and kernel options;
* ``state_fit``: the one check that a saved state fits the optimizer; ``rank_state``: the
  rank-local state dict and the one install of a state;
* ``loading``: a load's one pipeline (read -> check -> agree -> install) over a neutral staged state.

Nothing here imports checkpointing or interop.
"""
