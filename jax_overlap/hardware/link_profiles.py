"""Hardware profiles: the machine model of :mod:`jax_overlap.hardware.machine` as YAML files.

A profile (a :class:`~jax_overlap.hardware.machine.HardwareProfile`: chip FLOP rate,
links, and which link each mesh axis uses) is a YAML file under ``configs/hardware/``.
Every number is written as ``{value: ..., source: ...}`` so it is clear where it came
from (a spec sheet URL, an assumption, or ``measured here, <date>``);
:func:`load_profile` checks that each one is present. :func:`measure_local_profile`
measures this machine's matmul rate and 8-device psum bandwidth for
``configs/hardware/cpu_here.yaml``::

    python -m jax_overlap.hardware.link_profiles configs/hardware/cpu_here.yaml
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from jax_overlap.hardware.collective_cost import ring_factor, ring_steps
from jax_overlap.hardware.machine import AxisLink, HardwareProfile, Link

AXES: tuple[str, ...] = ("dp", "pp", "tp")
_PROFILE_DIRS = (
    Path(__file__).resolve().parents[2] / "configs" / "hardware",
    Path("configs") / "hardware",
)


class ProfileError(ValueError):
    """A hardware profile file is missing or malformed (message is one line)."""


def _resolve(name_or_path: str | os.PathLike) -> Path:
    """Path of a profile given as a path or as a name under ``configs/hardware``."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    name = p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml"
    for d in _PROFILE_DIRS:
        if (d / name).is_file():
            return d / name
    raise ProfileError(
        f"hardware profile {str(name_or_path)!r}: no such file (looked for {p} and "
        f"{name} in {', '.join(str(d) for d in _PROFILE_DIRS)})"
    )


def _get(doc: Mapping[str, Any], dotted: str, where: str) -> Any:
    node: Any = doc
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            raise ProfileError(f"hardware profile {where}: missing field '{dotted}'")
        node = node[key]
    return node


def _number(doc: Mapping[str, Any], dotted: str, where: str, sources: dict[str, str]) -> float:
    """A ``{value, source}`` number, recording its source."""
    entry = _get(doc, dotted, where)
    if not isinstance(entry, Mapping):
        raise ProfileError(
            f"hardware profile {where}: field '{dotted}' must be {{value: ..., source: ...}}"
        )
    value = _get(doc, f"{dotted}.value", where)
    sources[dotted] = str(_get(doc, f"{dotted}.source", where))
    try:
        # YAML 1.1 reads "312e12" (no dot, unsigned exponent) as a string.
        return float(value)
    except (TypeError, ValueError):
        raise ProfileError(
            f"hardware profile {where}: field '{dotted}.value' is not a number: {value!r}"
        ) from None


def profile_from_dict(doc: Mapping[str, Any], where: str = "<dict>") -> HardwareProfile:
    """Build a profile from its YAML document.

    Args:
      doc: the parsed YAML.
      where: file name for error messages.

    Returns:
      The :class:`HardwareProfile`.

    Raises:
      ProfileError: one line naming the missing or bad field.
    """
    if not isinstance(doc, Mapping):
        raise ProfileError(f"hardware profile {where}: expected a mapping at top level")
    sources: dict[str, str] = {}
    links_doc = _get(doc, "links", where)
    if not isinstance(links_doc, Mapping) or not links_doc:
        raise ProfileError(f"hardware profile {where}: field 'links' must name at least one link")
    links = {}
    for name in links_doc:
        eff = (
            _number(doc, f"links.{name}.efficiency", where, sources)
            if isinstance(links_doc[name], Mapping) and "efficiency" in links_doc[name]
            else 1.0
        )
        links[name] = Link(
            name=str(name),
            bandwidth_bytes_per_s=_number(
                doc, f"links.{name}.bandwidth_bytes_per_s", where, sources
            ),
            latency_s=_number(doc, f"links.{name}.latency_s", where, sources),
            efficiency=eff,
        )
    axes = {}
    for axis in AXES:
        link = str(_get(doc, f"axes.{axis}.link", where))
        if link not in links:
            raise ProfileError(
                f"hardware profile {where}: field 'axes.{axis}.link' names unknown link "
                f"{link!r} (links: {', '.join(links)})"
            )
        axes[axis] = AxisLink(link, bool(_get(doc, f"axes.{axis}.crosses_hosts", where)))
    if isinstance(doc.get("axes"), Mapping) and "dcn" in doc["axes"]:  # optional slow axis
        link = str(_get(doc, "axes.dcn.link", where))
        if link not in links:
            raise ProfileError(f"hardware profile {where}: field 'axes.dcn.link' names unknown "
                               f"link {link!r} (links: {', '.join(links)})")
        axes["dcn"] = AxisLink(link, True)
    sync = False
    if "synchronous_collectives" in doc:
        sync = bool(_get(doc, "synchronous_collectives.value", where))
        sources["synchronous_collectives"] = str(_get(doc, "synchronous_collectives.source", where))
    return HardwareProfile(
        name=str(_get(doc, "name", where)),
        description=str(doc.get("description", "")),
        chip=str(_get(doc, "chip.name", where)),
        chip_flops=_number(doc, "chip.flops", where, sources),
        memory_bytes=_number(doc, "chip.memory_bytes", where, sources),
        devices_per_host=int(_number(doc, "devices_per_host", where, sources)),
        hosts=int(_number(doc, "hosts", where, sources)),
        links=links,
        axes=axes,
        sources=sources,
        synchronous_collectives=sync,
    )


def load_profile(name_or_path: str | os.PathLike) -> HardwareProfile:
    """Load a hardware profile.

    Args:
      name_or_path: a YAML path, or a profile name such as ``h100_8x_nvlink`` looked up
        in ``configs/hardware/``.

    Returns:
      The :class:`HardwareProfile`.

    Raises:
      ProfileError: one line saying which file is missing or which field is absent/bad.
    """
    path = _resolve(name_or_path)
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ProfileError(f"hardware profile {path}: invalid YAML: {first}") from None
    return profile_from_dict(doc, str(path))


# ------------------------------------------------------------------ measuring here


@dataclass(frozen=True)
class LocalMeasurement:
    """What :func:`measure_local_profile` measured.

    Attributes:
      devices: devices used.
      matmul_flops: FLOP/s per device while all devices run matmuls at once.
      psum_latency_s: per ring hop, from a tiny psum.
      psum_bus_bandwidth: bytes/s such that the ring formula
        ``2(n-1)/n * bytes / bw + 2(n-1) * latency`` reproduces the large psum.
      date: ISO date of the measurement.
    """

    devices: int
    matmul_flops: float
    psum_latency_s: float
    psum_bus_bandwidth: float
    date: str


def _best_time(fn: Any, *args: Any, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls: the run least disturbed by other processes."""
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_local(
    matmul_n: int = 512, psum_bytes: int = 4 << 20, loop: int = 8, repeats: int = 7
) -> LocalMeasurement:
    """Measure this machine's per-device matmul rate and psum cost over all devices.

    Runs inside one jitted ``shard_map`` over every device, ``loop`` times in a
    ``fori_loop`` so dispatch overhead is amortised. Needs the devices to exist
    already: on CPU set ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
    before JAX starts (the ``__main__`` entry point does).

    Args:
      matmul_n: each device multiplies ``n x n`` float32 matrices.
      psum_bytes: float32 bytes per device in the large psum.
      loop: operations per timed call.
      repeats: timed calls; the fastest is used (least disturbed by other load).

    Returns:
      The :class:`LocalMeasurement`.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n_dev = jax.device_count()
    mesh = jax.make_mesh((n_dev,), ("d",))
    shard = NamedSharding(mesh, P("d"))
    repl = NamedSharding(mesh, P())

    def matmuls(x, w):
        # Rescale each product so repeated matmuls neither overflow nor denormalise.
        return jax.lax.fori_loop(0, loop, lambda _, y: (y @ w) * (1.0 / matmul_n), x)

    mm = jax.jit(jax.shard_map(matmuls, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))
    x = jax.device_put(jnp.ones((n_dev * matmul_n, matmul_n), jnp.float32), shard)
    w = jax.device_put(jnp.ones((matmul_n, matmul_n), jnp.float32), repl)
    t_mm = _best_time(mm, x, w, repeats=repeats) / loop
    flops = 2.0 * matmul_n**3 / t_mm

    def psums(y):
        return jax.lax.fori_loop(0, loop, lambda _, z: jax.lax.psum(z, "d") * (1.0 / n_dev), y)

    # check_vma=False: the loop carry is device-varying on entry and replicated after the
    # psum; the collective itself is what is being timed.
    ps = jax.jit(
        jax.shard_map(psums, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False)
    )
    tiny = jax.device_put(jnp.ones((n_dev,), jnp.float32), shard)
    elems = psum_bytes // 4
    big = jax.device_put(jnp.ones((n_dev * elems,), jnp.float32), shard)
    t_tiny = _best_time(ps, tiny, repeats=repeats) / loop
    t_big = _best_time(ps, big, repeats=repeats) / loop
    hops = ring_steps("all-reduce", n_dev)[0] if n_dev > 1 else 1
    ring_bytes = ring_factor("all-reduce", n_dev) * psum_bytes if n_dev > 1 else psum_bytes
    return LocalMeasurement(
        devices=n_dev,
        matmul_flops=flops,
        psum_latency_s=t_tiny / hops,
        psum_bus_bandwidth=ring_bytes / max(t_big - t_tiny, 1e-12),
        date=datetime.date.today().isoformat(),
    )


def local_profile_dict(m: LocalMeasurement) -> dict[str, Any]:
    """The YAML document of a profile for this machine built from a measurement."""
    note = f"measured here, {m.date} (jax_overlap.hardware.link_profiles.measure_local)"
    import platform

    return {
        "name": "cpu_here",
        "description": (
            f"This development machine: {m.devices} forced XLA CPU devices sharing "
            f"{os.cpu_count()} cores; every axis is in-process shared memory."
        ),
        "chip": {
            "name": (
                f"XLA CPU device on {platform.machine()} "
                f"({os.cpu_count()} cores shared by {m.devices} devices)"
            ),
            "flops": {
                "value": float(f"{m.matmul_flops:.4g}"),
                "source": (
                    f"{note}: float32 matmul FLOP/s per device with all {m.devices} devices busy"
                ),
            },
            "memory_bytes": {
                "value": float(_host_memory_bytes()),
                "source": f"{note}: host RAM (os.sysconf), shared by all devices",
            },
        },
        "devices_per_host": {
            "value": m.devices,
            "source": f"{note}: --xla_force_host_platform_device_count",
        },
        "hosts": {"value": 1, "source": "single process on this machine"},
        "links": {
            "shared_memory": {
                "bandwidth_bytes_per_s": {
                    "value": float(f"{m.psum_bus_bandwidth:.4g}"),
                    "source": f"{note}: {m.devices}-device psum, ring-equivalent bus bandwidth",
                },
                "latency_s": {
                    "value": float(f"{m.psum_latency_s:.4g}"),
                    "source": f"{note}: tiny psum time / 2(n-1) ring hops",
                },
                "efficiency": {
                    "value": 1.0,
                    "source": "measured bandwidth is already achieved bandwidth",
                },
            }
        },
        "axes": {axis: {"link": "shared_memory", "crosses_hosts": False} for axis in AXES},
        "synchronous_collectives": {
            "value": True,
            "source": (
                "XLA CPU runs each collective inline on the op thread (a rendezvous of all "
                "devices), as traces here show: communication never overlaps compute"
            ),
        },
    }


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def measure_local_profile(path: str | os.PathLike | None = None, **kwargs: Any) -> HardwareProfile:
    """Measure this machine and return (optionally write) its hardware profile.

    Args:
      path: where to write the YAML (e.g. ``configs/hardware/cpu_here.yaml``); None
        writes nothing.
      **kwargs: passed to :func:`measure_local`.

    Returns:
      The measured :class:`HardwareProfile`.
    """
    doc = local_profile_dict(measure_local(**kwargs))
    if path is not None:
        header = (
            "# Written by `python -m jax_overlap.hardware.link_profiles <this file>`;\n"
            "# rerun it to re-measure this machine.\n"
        )
        Path(path).write_text(header + yaml.safe_dump(doc, sort_keys=False, width=100))
    return profile_from_dict(doc, str(path) if path else "<measured>")


def main(argv: list[str] | None = None) -> int:
    """Entry point: measure 8 CPU devices and write the profile to ``argv[0]``."""
    argv = sys.argv[1:] if argv is None else argv
    out = argv[0] if argv else "configs/hardware/cpu_here.yaml"
    # Devices must exist before JAX initialises its backend.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    profile = measure_local_profile(out)
    link = profile.link("dp")
    print(
        f"{out}: {profile.chip_flops / 1e9:.2f} GFLOP/s per device, psum bus bandwidth "
        f"{link.bandwidth_bytes_per_s / 1e9:.3f} GB/s, hop latency {link.latency_s * 1e6:.1f} us"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
