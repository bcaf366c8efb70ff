"""Which CUDA PJRT plugins this environment has installed: the libraries a deviceless GPU
compile (`analysis/deviceless.py`) loads and the XLA flag check (`overlap/xla_flags.py`)
scans. Pure file-system look-ups; imports no JAX."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PLUGIN_MODULES: tuple[str, ...] = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
INSTALL_HINT = 'pip install "jax[cuda12-local]==<installed jax version>"'


def _plugin_library(module: str) -> Path | None:
    """Path of a plugin's PJRT shared library, or None when not installed."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        for candidate in sorted(Path(location).glob("*.so")):
            return candidate
    return None


def plugin_libraries() -> list[Path]:
    """PJRT GPU plugin libraries installed in this environment."""
    return [lib for lib in (_plugin_library(m) for m in PLUGIN_MODULES) if lib is not None]


def plugin_available() -> bool:
    """Whether a CUDA PJRT plugin is installed (so deviceless GPU compiles work)."""
    return bool(plugin_libraries())


def unavailable_reason() -> str | None:
    """Why deviceless GPU compiles cannot run here, or None when they can."""
    if plugin_available():
        return None
    return f"no CUDA PJRT plugin (jax-cuda12-pjrt) installed; {INSTALL_HINT}"
