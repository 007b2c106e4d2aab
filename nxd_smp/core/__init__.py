"""The bottom layer: what every other part may use and nothing here may know about them.

* ``errors``: ``ConfigError`` and ``CheckpointError``, defined once;
* ``environment``: every environment variable nxd_smp reads or sets, and what the XLA runtime did;
* ``layout``: buckets, padding and shard ranges as pure arithmetic;
* ``memory``: where the CPU step's buffers start within a page, and plain aliases for compiled
  kernels;
* ``progress``: progress shown on long work (checkpoint saves and loads).

Nothing here holds state or imports from another part of nxd_smp.
"""
