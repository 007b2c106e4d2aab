"""The parts behind ``nxd_smp.checkpoint``, the entry point users import:

* what a checkpoint is: ``format`` (files, keys, records), ``storage`` (raw tensor bytes and their
  index), ``dcp_index`` (the one DCP index reader), ``resharding`` (which pieces a rank reads);
* writing: ``save``, ``writer`` (asynchronous saves), ``publish`` (the ranks' write-and-publish
  and the atomic moves), ``links`` (versions and retention), ``outputs`` (exports);
* reading: ``load``, ``paths`` (the one safe open), ``reader`` (the strict pickled-file reader),
  ``values`` (what a read value must be), ``formats`` (other tools' folders, registered);
* ``tools`` (the offline tools) and ``progress`` (phases logged, a bar on long work).

Nothing here imports interop; interop registers what it adds (``formats.register_format``).
"""
