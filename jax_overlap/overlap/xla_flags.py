"""Named XLA flag presets for overlapping communication with compute, applied safely.

A preset is chosen by the config key ``overlap.xla_preset`` and applied with
:func:`apply_preset` before JAX starts its backend (XLA reads ``XLA_FLAGS`` once,
when a client is created).

XLA aborts the whole process on a flag it does not know (``Unknown flags in
XLA_FLAGS: ...`` from parse_flags_from_env.cc), and flags come and go between
jaxlib releases, so every flag is checked against the installed XLA first:

1. Static check: the flag name must occur in every XLA library that will parse
   ``XLA_FLAGS`` -- jaxlib's (``libjax_common.so``; ``xla_extension.so`` in older
   jaxlibs) and any installed CUDA PJRT plugin (``xla_cuda_plugin.so``, which parses
   ``XLA_FLAGS`` again when it compiles) -- somewhere other than as a *reserved*
   field name of the ``DebugOptions`` descriptor. Removed flags stay in the library
   only that way (protobuf encodes a reserved name as byte ``R``, its length, the
   name), e.g. ``xla_gpu_enable_async_collectives`` and ``xla_gpu_graph_level`` in
   jaxlib 0.11.2/0.12 -- a plain substring search would keep them and crash.
2. Probe (``verify=True``, the default): a child Python process starts JAX on CPU
   with the surviving flags (and, when a CUDA plugin is installed, compiles a tiny
   program for a GPU without one), which is exactly where XLA would abort. Flags the
   child reports as unknown -- or that make it fail on their own -- are dropped.

Dropped flags are logged and returned by :func:`resolve_preset`. A flag may name an
older spelling as ``fallback``, used when the preferred one is unknown (XLA renamed
``xla_gpu_enable_pipelined_<collective>=true`` to ``xla_gpu_pipeline_<collective>=on``;
jaxlib 0.11.2 and 0.12 accept both, the old one as a deprecated alias).

Why these flags and not others: see ``docs/design/xla_notes.md`` for what was measured on
deviceless H100/H200 compiles. ``xla_gpu_collective_permute_decomposer_
threshold`` with ``xla_gpu_enable_pipelined_p2p`` overlaps a pipeline ring fully but
aborts the compiler on other loops, so it is deliberately absent.
"""

from __future__ import annotations

import importlib.util
import logging
import mmap
import os
import re
import subprocess
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from jax_overlap.hardware.gpu_plugins import plugin_libraries

CONFIG_KEY = "overlap.xla_preset"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class XlaFlag:
    """One XLA flag of a preset.

    Attributes:
      name: flag name without ``--``.
      value: value text as XLA_FLAGS takes it.
      why: what it is for (shown when it is dropped).
      fallback: older spelling to use when this one is unknown to the installed XLA.
      requires: names of flags that must also be applied for this one to be safe.
    """

    name: str
    value: str
    why: str
    fallback: XlaFlag | None = None
    requires: tuple[str, ...] = ()

    def render(self) -> str:
        """``--name=value``."""
        return f"--{self.name}={self.value}"


_MIB = 1 << 20

_GPU_OVERLAP: tuple[XlaFlag, ...] = (
    # The scheduler that places async collective starts early and dones late around
    # independent work; without it nothing overlaps. On by default in current XLA,
    # pinned so a changed default cannot silently serialise communication.
    XlaFlag("xla_gpu_enable_latency_hiding_scheduler", "true",
            "schedule async collectives around independent compute"),
    # Collectives run on their own stream; highest priority keeps a long GEMM from
    # starving the NCCL kernels that share the SMs with it.
    XlaFlag("xla_gpu_enable_highest_priority_async_stream", "true",
            "give the collective stream priority over compute kernels"),
    # Collective pipeliner: move a loop iteration's all-gather (ZeRO/FSDP weight
    # gather in a scan over layers) into the previous iteration so it overlaps that
    # iteration's compute; likewise gradient reduce-scatters / all-reduces into the
    # next iteration.
    XlaFlag("xla_gpu_pipeline_all_gather", "on",
            "pipeline all-gathers across loop iterations",
            fallback=XlaFlag("xla_gpu_enable_pipelined_all_gather", "true",
                             "pipeline all-gathers (pre-rename spelling)")),
    XlaFlag("xla_gpu_pipeline_reduce_scatter", "on",
            "pipeline reduce-scatters across loop iterations",
            fallback=XlaFlag("xla_gpu_enable_pipelined_reduce_scatter", "true",
                             "pipeline reduce-scatters (pre-rename spelling)")),
    XlaFlag("xla_gpu_pipeline_all_reduce", "on",
            "pipeline all-reduces across loop iterations",
            fallback=XlaFlag("xla_gpu_enable_pipelined_all_reduce", "true",
                             "pipeline all-reduces (pre-rename spelling)")),
    # Combine per-layer collectives into buckets of at most 64 MiB: fewer NCCL
    # launches (tens of microseconds each), yet the first bucket can still start
    # long before the backward pass ends.
    XlaFlag("xla_gpu_all_reduce_combine_threshold_bytes", str(64 * _MIB),
            "bucket all-reduces up to 64 MiB"),
    XlaFlag("xla_gpu_all_gather_combine_threshold_bytes", str(64 * _MIB),
            "bucket all-gathers up to 64 MiB"),
    XlaFlag("xla_gpu_reduce_scatter_combine_threshold_bytes", str(64 * _MIB),
            "bucket reduce-scatters up to 64 MiB"),
    # CollectivePermuteMotion moves a pipeline loop's ppermute to the top of the next
    # iteration, where (after fusion) every matmul of the body waits for it; without
    # the pass the transfer overlaps independent matmuls (docs/design/xla_notes.md).
    XlaFlag("xla_disable_hlo_passes", "collective-permute-motion",
            "keep pipeline ppermutes where they can overlap independent matmuls"),
    # A bidirectional collective matmul keeps two ring transfers in flight at once, and so does
    # the pipeline's tick loop (activations down the +1 ring, gradients up the -1 ring); with
    # the default limit of one, the scheduler serialises them: only ~39% of TP bytes sit under
    # GEMMs (75% with two), and of the skewed pipeline loop's two permutes one runs
    # synchronously (both under the tick's GEMMs with two; deviceless 8 x H100, jaxlib 0.12).
    # FSDP's backward has four per block at tp = 1 (the next block's gathers and this block's
    # reduce-scatters, one each per gradient group): with two, the next block's gather was
    # pushed to the end of the block's backward. Llama-3-8B deviceless (jaxlib 0.12.0.1):
    # dp8 + FSDP 0.75 -> 0.98 of collective bytes under GEMMs, dp2 x tp4 0.990 -> 0.995.
    XlaFlag("xla_gpu_experimental_parallel_collective_overlap_limit", "4",
            "let up to four async collectives (ring directions, FSDP gathers and "
            "reduce-scatters) overlap the same GEMMs"),
)

# Tensor parallelism without a pipeline: the collective pipeliner, moving a layer loop's
# all-gathers / reduce-scatters across iterations, cloned whole forward layer loops into the
# microbatch loop (GPT-1.3B dp2 x tp4 deviceless for 8 x H100: 1.84x the model's GEMM FLOPs
# with them, 0.94x without), so this preset leaves those two out.
_PIPELINED_TP = ("xla_gpu_pipeline_all_gather", "xla_gpu_pipeline_reduce_scatter")

PRESETS: Mapping[str, tuple[XlaFlag, ...]] = {
    "none": (),
    "gpu_overlap": _GPU_OVERLAP,
    "gpu_overlap_tp": tuple(f for f in _GPU_OVERLAP if f.name not in _PIPELINED_TP),
    "gpu_overlap_aggressive": _GPU_OVERLAP + (
        # Unroll while loops by two so each copy's collectives overlap the other
        # copy's compute: measured 0.48 -> 1.0 of pipeline-ring bytes under a GEMM.
        # Costs compile time and keeps two iterations' buffers alive.
        XlaFlag("xla_gpu_enable_while_loop_double_buffering", "true",
                "unroll loops by two so iterations overlap each other's collectives",
                requires=("xla_disable_hlo_passes",)),
    ),
}

# Flags whose value is a comma-separated list: merged with a value already in
# XLA_FLAGS instead of being skipped.
_LIST_FLAGS = frozenset({"xla_disable_hlo_passes"})


def preset_names() -> tuple[str, ...]:
    """Valid preset names."""
    return tuple(PRESETS)


def get_preset(name: str) -> tuple[XlaFlag, ...]:
    """The flags of a preset.

    Args:
      name: preset name.

    Returns:
      Its flags, in the order they are applied.

    Raises:
      ValueError: unknown name; names ``overlap.xla_preset`` and the valid names.
    """
    if name not in PRESETS:
        raise ValueError(
            f"{CONFIG_KEY}: unknown XLA flag preset {name!r}; valid presets: "
            + ", ".join(preset_names()))
    return PRESETS[name]


# ----------------------------------------------------------------------------- static check


def xla_libraries() -> list[Path]:
    """The shared libraries whose XLA parses ``XLA_FLAGS`` in this environment.

    jaxlib's XLA library (the ``.so`` files over 50 MB in the jaxlib package:
    ``libjax_common.so``, or ``xla_extension.so`` in older jaxlibs) and the library
    of every installed CUDA PJRT plugin.
    """
    libs: list[Path] = []
    spec = importlib.util.find_spec("jaxlib")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            for path in sorted(Path(location).glob("*.so")):
                if path.stat().st_size > 50 * _MIB:
                    libs.append(path)
    return libs + plugin_libraries()


@lru_cache(maxsize=64)
def _live_names_in(path: str, size: int, mtime: float, names: frozenset[str]) -> frozenset[str]:
    """Names occurring in a library other than as a reserved descriptor name.

    ``size`` and ``mtime`` only key the cache (a reinstalled jaxlib is rescanned).
    """
    del size, mtime
    encoded = sorted((n.encode() for n in names), key=len, reverse=True)
    pattern = re.compile(b"|".join(re.escape(n) for n in encoded))
    live: set[str] = set()
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for match in pattern.finditer(mm):
            name, start = match.group(), match.start()
            reserved = start >= 2 and mm[start - 2] == 0x52 and mm[start - 1] == len(name)
            if not reserved:
                live.add(name.decode())
    return frozenset(live)


def _preset_flag_names() -> frozenset[str]:
    """Every flag name the presets may apply, fallbacks included."""
    names = set()
    for flags in PRESETS.values():
        for flag in flags:
            names.add(flag.name)
            if flag.fallback:
                names.add(flag.fallback.name)
    return frozenset(names)


def statically_known(names: Sequence[str], libraries: Sequence[Path] | None = None) -> set[str]:
    """The names every XLA library here registers (see the module docstring).

    One pass over each library finds all preset flag names plus ``names``; the result
    is cached per library file, so later calls cost nothing.

    Args:
      names: flag names without ``--``.
      libraries: libraries to check (default: :func:`xla_libraries`).

    Returns:
      The subset known to all of them (all names if no library was found, since then
      there is nothing to check against; the probe still runs).
    """
    if not names:
        return set()
    libraries = xla_libraries() if libraries is None else list(libraries)
    lookup = _preset_flag_names() | frozenset(names)
    known = set(names)
    for lib in libraries:
        stat = lib.stat()
        known &= _live_names_in(str(lib), stat.st_size, stat.st_mtime, lookup)
    return known


# ----------------------------------------------------------------------------- probe

_PROBE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import jax
jax.devices()  # jaxlib's XLA parses XLA_FLAGS when the CPU client starts
print("JAXLIB_OK", flush=True)
from jax_overlap.analysis import deviceless
if deviceless.plugin_available():
    import jax.numpy as jnp
    devices = deviceless.gpu_topology_devices("h100", 1)
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    arg = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)
    jax.jit(jnp.sin).lower(arg).compile()  # the plugin's XLA parses XLA_FLAGS here
    print("PLUGIN_OK", flush=True)
"""

_UNKNOWN_RE = re.compile(r"Unknown flags? in XLA_FLAGS:\s*(.*)")


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of starting JAX with some XLA flags in a child process.

    Attributes:
      ok: the child started (and compiled for a GPU, if a plugin is installed).
      unknown: flag names XLA reported as unknown.
      detail: last lines of the child's stderr when it failed.
    """

    ok: bool
    unknown: frozenset[str] = frozenset()
    detail: str = ""


def probe_flags(flags: Sequence[str], *, python: str = sys.executable,
                timeout_s: float = 300.0) -> ProbeResult:
    """Start JAX on CPU in a child process with ``XLA_FLAGS`` set to ``flags``.

    Args:
      flags: ``--name=value`` strings.
      python: interpreter of the environment to check.
      timeout_s: give up after this long (counts as a failure).

    Returns:
      :class:`ProbeResult`.
    """
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(__file__).resolve().parents[1])
    try:
        proc = subprocess.run([python, "-c", _PROBE, root], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return ProbeResult(False, detail=f"probe timed out after {timeout_s:.0f} s")
    if proc.returncode == 0:
        return ProbeResult(True)
    unknown: set[str] = set()
    for line in proc.stderr.splitlines():
        match = _UNKNOWN_RE.search(line)
        if match:
            unknown |= {tok.lstrip("-").split("=", 1)[0] for tok in match.group(1).split()
                        if tok.startswith("--")}
    tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
    return ProbeResult(False, frozenset(unknown), tail)


# ----------------------------------------------------------------------------- resolve


@dataclass(frozen=True)
class PresetResolution:
    """What :func:`resolve_preset` decided.

    Attributes:
      preset: preset name.
      applied: ``--name=value`` strings to append to ``XLA_FLAGS``.
      dropped: flag name -> why it is not applied.
      merged: list-valued flags merged into a value already in ``XLA_FLAGS``.
    """

    preset: str
    applied: tuple[str, ...]
    dropped: Mapping[str, str] = field(default_factory=dict)
    merged: Mapping[str, str] = field(default_factory=dict)


def _existing_flags(xla_flags: str) -> dict[str, str]:
    """``name -> value`` of the flags already in an XLA_FLAGS string."""
    out: dict[str, str] = {}
    for token in xla_flags.split():
        if token.startswith("--"):
            name, _, value = token[2:].partition("=")
            out[name] = value
    return out


def _verify(candidates: list[XlaFlag], dropped: dict[str, str]) -> list[XlaFlag]:
    """Drop the candidates a child process reports unknown or that make it fail."""
    for _ in range(4):
        result = probe_flags([f.render() for f in candidates])
        if result.ok:
            return candidates
        if not result.unknown:
            break
        for flag in candidates:
            if flag.name in result.unknown:
                dropped[flag.name] = "unknown to this XLA (probe)"
        candidates = [f for f in candidates if f.name not in result.unknown]
        if not candidates:
            return []
    # The child failed without naming unknown flags (e.g. a value XLA rejects): keep
    # only the flags that start cleanly on their own, and only if they do together.
    kept = []
    for flag in candidates:
        alone = probe_flags([flag.render()])
        if alone.ok:
            kept.append(flag)
        else:
            dropped[flag.name] = f"XLA fails to start with it: {alone.detail[-300:]}"
    if kept and not probe_flags([f.render() for f in kept]).ok:
        for flag in kept:
            dropped[flag.name] = "the preset's flags fail together (probe)"
        return []
    return kept


def resolve_preset(name: str, environ: Mapping[str, str] = os.environ, *,
                   verify: bool = True) -> PresetResolution:
    """Decide which of a preset's flags to add to ``environ["XLA_FLAGS"]``.

    Args:
      name: preset name (``overlap.xla_preset``).
      environ: environment whose ``XLA_FLAGS`` the flags would join.
      verify: also start JAX in a child process with them (see module docstring).

    Returns:
      :class:`PresetResolution`.

    Raises:
      ValueError: unknown preset name.
    """
    flags = get_preset(name)
    existing = _existing_flags(environ.get("XLA_FLAGS", ""))
    names = [f.name for f in flags] + [f.fallback.name for f in flags if f.fallback]
    known = statically_known(names)
    dropped: dict[str, str] = {}
    merged: dict[str, str] = {}
    chosen: list[XlaFlag] = []
    for flag in flags:
        pick = flag if flag.name in known else (
            flag.fallback if flag.fallback and flag.fallback.name in known else None)
        if pick is None:
            dropped[flag.name] = "not registered by this XLA (library scan)"
            continue
        if pick.name in existing:
            if existing[pick.name] == pick.value:
                continue  # already applied, e.g. by an earlier call
            if pick.name in _LIST_FLAGS:
                merged[pick.name] = pick.value
            else:
                dropped[pick.name] = f"already set in XLA_FLAGS (={existing[pick.name]})"
            continue
        if pick is not flag:
            pick = XlaFlag(pick.name, pick.value, pick.why, requires=flag.requires)
        chosen.append(pick)
    if verify and chosen:
        chosen = _verify(chosen, dropped)
    present = {f.name for f in chosen} | set(merged) | set(existing)
    safe = []
    for flag in chosen:
        missing = [r for r in flag.requires if r not in present]
        if missing:
            dropped[flag.name] = f"needs {', '.join(missing)}, which is not applied"
        else:
            safe.append(flag)
    return PresetResolution(name, tuple(f.render() for f in safe), dropped, merged)


def _merge_list_flags(xla_flags: str, merged: Mapping[str, str]) -> str:
    """Append values to list-valued flags already present in an XLA_FLAGS string."""
    tokens = xla_flags.split()
    for i, token in enumerate(tokens):
        name, _, value = token.lstrip("-").partition("=")
        if token.startswith("--") and name in merged:
            parts = [v for v in value.split(",") if v]
            for extra in merged[name].split(","):
                if extra not in parts:
                    parts.append(extra)
            tokens[i] = f"--{name}={','.join(parts)}"
    return " ".join(tokens)


def apply_preset(name: str, environ: MutableMapping[str, str] = os.environ, *,
                 verify: bool = True) -> list[str]:
    """Append a preset's flags to ``environ["XLA_FLAGS"]``; call before JAX starts.

    Flags this XLA does not know are dropped (never passed, so start-up cannot
    abort) and logged; flags the user already set in ``XLA_FLAGS`` keep the user's
    value (list-valued ones such as ``xla_disable_hlo_passes`` get ours appended).

    Args:
      name: preset name, from the config key ``overlap.xla_preset``.
      environ: environment to modify (default ``os.environ``).
      verify: check the flags in a child process first (about a second or two).

    Returns:
      The ``--name=value`` strings appended.

    Raises:
      ValueError: unknown preset name (the message names ``overlap.xla_preset`` and
        lists the valid presets).
    """
    resolution = resolve_preset(name, environ, verify=verify)
    for flag_name, reason in resolution.dropped.items():
        log.warning("XLA preset %s: dropped --%s: %s", name, flag_name, reason)
    current = _merge_list_flags(environ.get("XLA_FLAGS", ""), resolution.merged)
    environ["XLA_FLAGS"] = " ".join([current, *resolution.applied]).strip()
    return list(resolution.applied)
