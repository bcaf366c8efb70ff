"""jax_overlap: hybrid-parallel training with communication/computation overlap.

Importing the package changes one thing, before JAX starts: on a machine without a GPU (no
/dev/nvidia0...), `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`. The CUDA plugin (installed for the
deviceless GPU compile, analysis/deviceless.py) otherwise calls cuInit while checking CUDA
versions, fails, and logs "Jax plugin configuration error" with a traceback at every JAX
start: on the console, in notebooks and in a run's logs/error.log. Skipping that check
changes nothing else: the backend is the CPU and compile-only GPU topologies still work.
`scripts/jax_overlap_no_gpu.pth` (installed into the venv by `make setup`) does the same for
a bare `python -c "import jax"`.
"""

import glob as _glob
import os as _os

if not _glob.glob("/dev/nvidia[0-9]*"):
    _os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
