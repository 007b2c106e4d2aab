"""Test-session settings that must exist before any test module imports a library."""

import os

# transformers imports torch_xla when it is installed, unless told not to; the XLA tests
# run torch_xla in child processes of their own, and this process stays free of it.
os.environ.setdefault("USE_TORCH_XLA", "0")
