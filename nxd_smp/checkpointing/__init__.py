"""The parts behind ``nxd_smp.checkpoint``, the entry point users import. Every load, whatever its
format and entry point, runs one pipeline of four stages (``nxd_smp.optim.loading``); every file
operation goes through one room; every parse is charged to a budget as it goes.

* the formats (``pipeline``): each gives the pipeline's **read** a reader, registered here by the
  layer that knows it: ``smp_format`` for nxd_smp's own, NxD's by ``nxd_smp.interop``; each turns
  bytes into the neutral staged state (``optim.loading.staged``) that is then checked, agreed on and
  installed;
* saving (``save``): nxd_smp's format written by every rank and published by rank 0 (its versions and
  retention: ``versions``), now or in the background (``writer``);
* the bytes: ``files`` (the one filesystem room: directory descriptors, nothing followed below the
  root), ``storage`` (raw tensor bytes and their JSON index), ``reader`` (the one strict reader of
  pickled files: the zip and the entry points) and ``unpickler`` (its pickle machine), ``typed_json``
  (the one JSON parse), ``dcp_index`` (DCP's index), ``budget`` (what a parse may spend, linear in
  its input);
* ``tools`` (the offline tools: the same reader, no communication).

Nothing here imports interop; interop registers what it adds (``pipeline.register_format``).
"""
