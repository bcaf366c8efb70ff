"""Compile a JAX program for N GPUs on a machine that has none.

With a CUDA PJRT plugin installed -- only the Python wheels, no CUDA libraries and
no driver -- and the JAX backend kept on CPU (``JAX_PLATFORMS=cpu``),
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...,
topology="1x1xN")`` returns compile-only GPU devices. A ``jax.sharding.Mesh`` built
on them lowers and compiles like a real one, and ``compiled.as_text()`` is the HLO
as XLA's GPU pipeline leaves it: fused, with async collective start/done pairs
placed by the latency-hiding scheduler. :mod:`jax_overlap.analysis.hlo_report` reads it.

Install: ``pip install "jax[cuda12-local]==<installed jax version>"`` -- that extra
pins ``jax-cuda12-plugin`` (and through it ``jax-cuda12-pjrt``, the PJRT plugin
library) to the same version as jax/jaxlib and pulls no CUDA libraries. The minimum
that works is ``jax-cuda12-pjrt`` alone (the compiler lives in its
``xla_cuda_plugin.so``); without ``jax-cuda12-plugin`` every process logs
"cuda_plugin_extension is not found." once. The versions this was checked with:
``docs/design/xla_notes.md``.

The plugin's XLA parses ``XLA_FLAGS`` when it compiles, so a flag it does not know
aborts the process there (see :mod:`jax_overlap.overlap.xla_flags`). Per-compile options can
be passed as ``compiler_options`` (XLA ``DebugOptions`` field names), e.g.
``{"xla_disable_hlo_passes": "collective-permute-motion"}``.

Topology strings are ``<slices>x<hosts>x<devices per host>``; ``1x2x8`` gives 16
devices on two hosts (``process_index`` 0 and 1), for programs whose data-parallel
axis crosses nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jax_overlap.analysis.hlo_report import HloReport, analyze_hlo
from jax_overlap.hardware.machine import LinkModel
from jax_overlap.analysis.xla_targets import get_target, target_config_text
from jax_overlap.hardware.gpu_plugins import (  # noqa: F401 (tests and callers ask here)
    INSTALL_HINT, plugin_available, plugin_libraries, unavailable_reason)


def topology_name(num_devices: int, num_hosts: int = 1) -> str:
    """Topology string for ``num_devices`` GPUs spread evenly over ``num_hosts`` hosts.

    Args:
      num_devices: total GPUs.
      num_hosts: hosts; must divide ``num_devices``.

    Returns:
      e.g. ``1x1x8`` or ``1x2x8``.

    Raises:
      ValueError: sizes that do not fit.
    """
    if num_devices < 1 or num_hosts < 1 or num_devices % num_hosts:
        raise ValueError(
            f"{num_devices} devices cannot be spread evenly over {num_hosts} hosts")
    return f"1x{num_hosts}x{num_devices // num_hosts}"


def gpu_topology_devices(target: str, num_devices: int, *, num_hosts: int = 1) -> list[Any]:
    """Compile-only devices of ``num_devices`` GPUs of a target model.

    Args:
      target: ``a100``, ``h100`` or ``h200`` (see :func:`targets.get_target`).
      num_devices: number of GPUs.
      num_hosts: hosts they are spread over.

    Returns:
      List of ``jax.Device`` (compile-only) to build a ``Mesh`` on.

    Raises:
      RuntimeError: no CUDA plugin installed.
      ValueError: unknown target or bad sizes.
    """
    get_target(target)
    name = topology_name(num_devices, num_hosts)
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=target_config_text(target), topology=name)
    return list(topology.devices)


def gpu_mesh(target: str, shape: Sequence[int], axis_names: Sequence[str], *,
             num_hosts: int = 1) -> Any:
    """A ``jax.sharding.Mesh`` of compile-only GPUs, devices in id order.

    Args:
      target: GPU target name.
      shape: mesh shape; its product is the number of GPUs.
      axis_names: one name per mesh dimension.
      num_hosts: hosts the GPUs are spread over (the outermost axis should span them).

    Returns:
      The mesh.
    """
    from jax.sharding import Mesh

    devices = gpu_topology_devices(target, int(np.prod(shape)), num_hosts=num_hosts)
    return Mesh(np.array(devices).reshape(tuple(shape)), tuple(axis_names))


def compile_lowered(lowered: Any, compiler_options: Mapping[str, Any] | None = None,
                    memory: dict | None = None) -> str:
    """Compile a ``jax.stages.Lowered`` and return the compiled HLO text.

    Args:
      lowered: result of ``jax.jit(f).lower(...)``.
      compiler_options: XLA ``DebugOptions`` overrides for this compile only.
      memory: when given, receives :func:`memory_of` the compiled program.

    Returns:
      ``compiled.as_text()``.
    """
    options = dict(compiler_options) if compiler_options else None
    compiled = lowered.compile(compiler_options=options)
    if memory is not None:
        memory.update(memory_of(compiled))
    return compiled.as_text()


def memory_of(compiled: Any) -> dict[str, int]:
    """What XLA allocates per device for a compiled program (``memory_analysis()``):
    arguments, outputs, temporaries, and the peak (arguments + outputs - donated aliases +
    temporaries, unless XLA reports its own peak). Empty where the backend does not say."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - optional on some backends
        return {}
    if stats is None:
        return {}
    out = {key: int(getattr(stats, f"{key}_size_in_bytes", 0) or 0)
           for key in ("argument", "output", "alias", "temp")}
    peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    out["peak"] = peak or out["argument"] + out["output"] - out["alias"] + out["temp"]
    return {f"{key}_bytes": value for key, value in out.items()}


def compile_for(target: str, num_devices: int, build: Callable[[list[Any]], Any], *,
                num_hosts: int = 1,
                compiler_options: Mapping[str, Any] | None = None,
                memory: dict | None = None) -> str:
    """Compile a program for ``num_devices`` GPUs of ``target`` and return its HLO
    (``memory``, when given, receives what XLA allocates per device: :func:`memory_of`).

    Args:
      target: ``a100``, ``h100`` or ``h200``.
      num_devices: number of GPUs.
      build: gets the compile-only devices, returns ``jax.jit(f).lower(...)`` of the
        program (build the mesh on the devices; pass ``jax.ShapeDtypeStruct`` inputs
        carrying ``NamedSharding`` so nothing is allocated).
      num_hosts: hosts the GPUs are spread over.
      compiler_options: XLA ``DebugOptions`` overrides for this compile only.

    Returns:
      Compiled, scheduled HLO text.
    """
    devices = gpu_topology_devices(target, num_devices, num_hosts=num_hosts)
    return compile_lowered(build(devices), compiler_options, memory)


def analyze_for(target: str, num_devices: int, build: Callable[[list[Any]], Any], *,
                num_hosts: int = 1, compiler_options: Mapping[str, Any] | None = None,
                link: LinkModel | None = None,
                branch_frequencies: Sequence[float] | None = None) -> HloReport:
    """:func:`compile_for` then :func:`hlo_report.analyze_hlo` with the target's chip.

    Args:
      target: GPU target name.
      num_devices: number of GPUs.
      build: as for :func:`compile_for`.
      num_hosts: hosts.
      compiler_options: per-compile XLA options.
      link: link model (default: the chip's NVLink).
      branch_frequencies: see `hlo_parse.execution_counts`.

    Returns:
      The :class:`HloReport`.
    """
    text = compile_for(target, num_devices, build, num_hosts=num_hosts,
                       compiler_options=compiler_options)
    return analyze_hlo(text, target=get_target(target).key, link=link,
                       branch_frequencies=branch_frequencies)

