"""XLA flag presets: every preset starts JAX cleanly; unknown flags never reach XLA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_overlap.overlap import xla_flags
from jax_overlap.overlap.xla_flags import XlaFlag

ROOT = Path(__file__).resolve().parents[1]
INVENTED = "xla_jax_overlap_invented_flag"

# Starts the backend (where jaxlib's XLA parses XLA_FLAGS) and, with a CUDA plugin
# installed, compiles for a GPU (where the plugin's XLA parses them again).
START_JAX = """
import sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp
print(len(jax.devices()))
from jax_overlap.analysis import deviceless
if deviceless.plugin_available():
    devices = deviceless.gpu_topology_devices("h100", 1)
    arg = jax.ShapeDtypeStruct((8,), jnp.float32,
                               sharding=jax.sharding.SingleDeviceSharding(devices[0]))
    jax.jit(jnp.sin).lower(arg).compile()
print("started")
"""


def _start_jax(xla_flags_value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags_value)
    return subprocess.run([sys.executable, "-c", START_JAX, str(ROOT)], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("preset", xla_flags.preset_names())
def test_each_preset_starts_jax_cleanly(preset):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    applied = xla_flags.apply_preset(preset, env)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", *applied]
    if preset != "none":
        assert "--xla_gpu_enable_latency_hiding_scheduler=true" in applied
        assert "--xla_disable_hlo_passes=collective-permute-motion" in applied
    proc = _start_jax(env["XLA_FLAGS"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["2", "started"]


def test_unknown_preset_names_config_key_and_choices():
    with pytest.raises(ValueError) as err:
        xla_flags.apply_preset("fast", {})
    message = str(err.value)
    assert "overlap.xla_preset" in message
    for name in ("none", "gpu_overlap", "gpu_overlap_aggressive"):
        assert name in message


def test_invented_flag_is_dropped_not_passed(monkeypatch):
    monkeypatch.setitem(xla_flags.PRESETS, "test", (
        XlaFlag(INVENTED, "1", "does not exist"),
        XlaFlag("xla_gpu_enable_latency_hiding_scheduler", "true", "exists"),
    ))
    env = {}
    resolution = xla_flags.resolve_preset("test", env, verify=False)
    assert "library scan" in resolution.dropped[INVENTED]
    assert resolution.applied == ("--xla_gpu_enable_latency_hiding_scheduler=true",)
    applied = xla_flags.apply_preset("test", env)
    assert INVENTED not in env["XLA_FLAGS"]
    assert applied == ["--xla_gpu_enable_latency_hiding_scheduler=true"]


def test_probe_drops_what_the_library_scan_misses(monkeypatch):
    # If the scan were fooled, starting XLA in a child process still catches it.
    monkeypatch.setattr(xla_flags, "statically_known", lambda names, libraries=None: set(names))
    monkeypatch.setitem(xla_flags.PRESETS, "test", (
        XlaFlag(INVENTED, "1", "does not exist"),
        XlaFlag("xla_gpu_enable_highest_priority_async_stream", "true", "exists"),
    ))
    resolution = xla_flags.resolve_preset("test", {})
    assert "probe" in resolution.dropped[INVENTED]
    assert resolution.applied == ("--xla_gpu_enable_highest_priority_async_stream=true",)


def test_removed_flags_left_as_reserved_names_are_not_known():
    # jaxlib 0.11/0.12 keep these only as reserved DebugOptions field names; XLA
    # aborts on them, so a plain substring search of the library would be wrong.
    known = xla_flags.statically_known(
        ["xla_gpu_graph_level", "xla_gpu_enable_async_collectives",
         "xla_gpu_enable_latency_hiding_scheduler", INVENTED])
    assert known == {"xla_gpu_enable_latency_hiding_scheduler"}
    assert not xla_flags.probe_flags(["--xla_gpu_graph_level=0"]).ok


def test_fallback_and_requirements(monkeypatch):
    monkeypatch.setitem(xla_flags.PRESETS, "test", (
        XlaFlag(INVENTED, "on", "renamed flag",
                fallback=XlaFlag("xla_gpu_enable_pipelined_all_gather", "true", "old name")),
        XlaFlag("xla_gpu_enable_while_loop_double_buffering", "true", "needs the other",
                requires=(INVENTED,)),
    ))
    resolution = xla_flags.resolve_preset("test", {}, verify=False)
    assert resolution.applied == ("--xla_gpu_enable_pipelined_all_gather=true",)
    assert "needs" in resolution.dropped["xla_gpu_enable_while_loop_double_buffering"]


def test_user_flags_win_and_list_flags_merge():
    env = {"XLA_FLAGS": "--xla_gpu_all_reduce_combine_threshold_bytes=1024 "
                        "--xla_disable_hlo_passes=some-pass"}
    xla_flags.apply_preset("gpu_overlap", env, verify=False)
    flags = env["XLA_FLAGS"].split()
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=1024" in flags
    assert not any(f.startswith("--xla_gpu_all_reduce_combine_threshold_bytes=6") for f in flags)
    assert "--xla_disable_hlo_passes=some-pass,collective-permute-motion" in flags
    # Applying twice adds nothing.
    before = env["XLA_FLAGS"]
    assert xla_flags.apply_preset("gpu_overlap", env, verify=False) == []
    assert env["XLA_FLAGS"] == before
