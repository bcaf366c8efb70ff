"""Quiet on a machine without a GPU (issue 28): the CUDA plugin's failed version check
("Jax plugin configuration error" + a traceback) never reaches stderr, and the deviceless
GPU compile, which needs that plugin, still works."""

import glob
import os
import subprocess
import sys
import sysconfig

import pytest
from helpers import REPO

pytestmark = pytest.mark.skipif(bool(glob.glob("/dev/nvidia[0-9]*")),
                                reason="a machine without a GPU")
PTH = os.path.join(REPO, "scripts", "jax_overlap_no_gpu.pth")


def run_python(code: str, tmp_path) -> subprocess.CompletedProcess:
    """`python -c code` as a user starts it: no JAX_PLATFORMS, no forced devices, no
    jax_overlap environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = REPO
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_without_the_fix_jax_is_noisy_here(tmp_path):
    """What the fix silences (when the CUDA plugin is installed, as the dev extra does)."""
    pytest.importorskip("jax_plugins.xla_cuda12")
    proc = run_python("import jax; jax.devices()", tmp_path)
    if proc.stderr == "":  # the venv already has the .pth: run without site's .pth files
        proc = subprocess.run([sys.executable, "-S", "-c", "import sys; sys.path += "
                               f"{[sysconfig.get_paths()['purelib']]!r}; import jax; "
                               "jax.devices()"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300,
                              env={k: v for k, v in os.environ.items()
                                   if not k.startswith(("JAX_", "XLA_"))})
    assert "Jax plugin configuration error" in proc.stderr


def test_importing_jax_overlap_first_is_quiet(tmp_path):
    proc = run_python("import jax_overlap, jax; print(jax.devices())", tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert "CpuDevice" in proc.stdout


def test_bare_import_jax_with_the_venv_pth_is_quiet(tmp_path):
    """The .pth `make setup` installs into the venv's site-packages, applied as site does."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "jax_overlap_no_gpu.pth").write_text(open(PTH).read())
    proc = run_python(f"import site; site.addsitedir({str(site)!r}); import jax; "
                      f"print(jax.devices())", tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]


def test_deviceless_gpu_compile_still_works(tmp_path):
    pytest.importorskip("jax_plugins.xla_cuda12")
    code = ("import jax_overlap, jax, jax.numpy as jnp, numpy as np\n"
            "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
            "from jax_overlap.analysis import deviceless\n"
            "mesh = Mesh(np.array(deviceless.gpu_topology_devices('h100', 2)), ('x',))\n"
            "f = jax.jit(lambda a: (a @ a.T).sum(), in_shardings=NamedSharding(mesh, P('x')))\n"
            "text = f.lower(jax.ShapeDtypeStruct((64, 64), jnp.float32)).compile().as_text()\n"
            "print('all-reduce' in text, jax.devices()[0].platform)\n")
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "cpu"]
