"""The tuner on hosts joined by a slow link: flat vs hierarchical vs one step late vs
Streaming DiLoCo, simulated per layout, and the search over them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax_overlap import config as configlib
from jax_overlap.analysis import plan_shape
from jax_overlap.analysis import plan_costs
from jax_overlap.analysis.simulate import simulate
from jax_overlap.analysis.tune.candidates import Candidate, apply_candidate, plan_of
from jax_overlap.analysis.tune.predict import (
    FLOP_EFFICIENCY,
    TABLE_ROWS,
    Prediction,
    memory_budget,
    rank,
    significant,
    sim_plan,
)
from jax_overlap.config import Config, ConfigError
from jax_overlap.hardware.link_profiles import load_profile
from jax_overlap.hardware.machine import HardwareProfile

SLOW_MODES: tuple[str, ...] = ("flat", "hierarchical", "delay1", "diloco")


def _without_dcn(cfg: Config, dp: int, batch_share: int = 1) -> Config:
    """`cfg` on a mesh without dcn: mesh.dp = dp, 1/batch_share of the batch (the same work
    per device), no delay / DiLoCo."""
    return dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, dcn=1, dp=dp),
        train=dataclasses.replace(cfg.train, global_batch=cfg.train.global_batch // batch_share),
        overlap=dataclasses.replace(cfg.overlap, dcn_delay=0),
        diloco=dataclasses.replace(cfg.diloco, inner_steps=0))


def slow_axis_modes(cfg: Config, hw: HardwareProfile,
                    efficiency: float = FLOP_EFFICIENCY, fast: Any = None,
                    dilocos: Sequence[Any] | None = None) -> list[dict[str, Any]]:
    """Simulated step time and exposed slow-axis communication of `cfg`'s mesh (dcn > 1) in
    each way of crossing dcn (`SLOW_MODES`), on a profile with a 'dcn' axis link.

    flat: one dp axis of dcn x dp ranks whose all-reduce runs on the slow link (the
      simulator's bucketed dp stream on it). hierarchical: the fast step (dp inside a host)
      plus what the dcn all-reduce of 1/dp of every bucket, simulated as a bucket stream on
      the slow link beside the same compute, leaves exposed. delay1: the fast step, with the whole dcn
      all-reduce (1/dp of the gradient) hidden under the next step: exposed only where it is
      longer. diloco: the fast step; one fragment's outer gradient (1/F of the parameters,
      1/dp per device, in diloco.outer_dtype) crosses every H/F steps under tau + 1 steps.

    Every mode's step is at least the fast step (the same compute, more communication):
    the tuner's search (`slow_link_search`) relies on it to prune.

    Args:
      fast: the simulator's result for one host's share (`_without_dcn(cfg, dp, dcn)`),
        when the caller has it already.
      dilocos: the `DilocoPlan`s to give a diloco row each (default: the config's, else
        H = 8, 2 fragments, tau = 1, bf16).

    Returns:
      One row per mode: {"mode", "step_time_s", "exposed_dcn_s", "dcn_bytes_per_step",
      "fast_step_time_s"}; the flat row also has its simulated "memory_bytes", "ccor",
      "bubble_rate" and "exposed_comm_s", the diloco rows their "diloco" settings.
    """
    from jax_overlap.analysis.simulate import all_reduce_time

    if "dcn" not in hw.axes:
        raise ConfigError([f"--hardware {hw.name}: the profile has no 'dcn' axis link (see "
                           f"configs/hardware/h100_2x8_100g.yaml)"])
    plan = plan_of(cfg)
    dcn, dp = plan.dcn, plan.dp
    slow = hw.link("dcn")
    fast_cfg = _without_dcn(cfg, dp, dcn)  # one host's share of the step
    fast_plan = plan_of(fast_cfg)
    if fast is None:
        fast = simulate(sim_plan(fast_cfg, fast_plan), plan_costs.flop_costs(fast_cfg, fast_plan, hw, efficiency), hw)
    t_fast = fast.step_time_s
    buckets, issue = plan_shape.grad_buckets(fast_cfg, fast_plan)
    grad = float(sum(buckets))
    rows = []
    # flat: every dp byte on the slow link
    flat_cfg = _without_dcn(cfg, dcn * dp)
    flat_plan = plan_of(flat_cfg)
    flat_hw = hw.with_link("dp", slow)
    r = simulate(sim_plan(flat_cfg, flat_plan), plan_costs.flop_costs(flat_cfg, flat_plan, flat_hw,
                                                             efficiency),
                 flat_hw)
    rows.append({"mode": "flat", "step_time_s": r.step_time_s,
                 "exposed_dcn_s": max(0.0, r.step_time_s - t_fast),
                 "dcn_bytes_per_step": 2 * (dcn * dp - 1) / (dcn * dp) * grad,
                 "memory_bytes": r.peak_memory_bytes + plan_shape.transient_bytes(flat_cfg,
                                                                                flat_plan),
                 "ccor": r.ccor, "bubble_rate": r.bubble_rate,
                 "exposed_comm_s": r.exposed_comm_s, "hidden_comm": _hidden(r)})
    # hierarchical: a second bucket stream of 1/dp of each bucket over dcn
    slow_plan = dataclasses.replace(sim_plan(fast_cfg, fast_plan), dp=dcn,
                                    grad_buckets=tuple(b / dp for b in buckets))
    slow_hw = hw.with_link("dp", slow)
    r = simulate(slow_plan, plan_costs.flop_costs(fast_cfg, fast_plan, slow_hw, efficiency), slow_hw)
    # What the slow stream leaves exposed comes on top of the fast step (its fast reduce-
    # scatter / all-gather are in the fast step already): conservative, they do not overlap.
    t_hier = t_fast + r.exposed_comm_s
    per_step = 2 * (dcn - 1) / dcn * grad / dp
    rows.append({"mode": "hierarchical", "step_time_s": t_hier,
                 "exposed_dcn_s": t_hier - t_fast, "dcn_bytes_per_step": per_step})
    t_all = all_reduce_time(grad / dp, dcn, slow)
    rows.append({"mode": "delay1", "step_time_s": max(t_fast, t_all),
                 "exposed_dcn_s": max(0.0, t_all - t_fast), "dcn_bytes_per_step": per_step})
    if dilocos is None:
        dilocos = [plan.diloco or dataclasses.replace(_default_diloco(), outer_dtype="bf16")]
    for d in dilocos:
        # outer-gradient bytes per gradient byte (the buckets are in overlap.grad_comm_dtype)
        size = ({"fp32": 4, "bf16": 2, "int8": 1}[d.outer_dtype]
                / (2 if fast_plan.overlap.grad_comm_dtype == "bf16" else 4))
        frag = grad * size / d.fragments / dp
        t_frag = all_reduce_time(frag, dcn, slow)
        exposed = max(0.0, t_frag - (d.delay + 1) * t_fast) / d.period
        rows.append({"mode": "diloco", "step_time_s": t_fast + exposed,
                     "exposed_dcn_s": exposed,
                     "dcn_bytes_per_step": 2 * (dcn - 1) / dcn * frag / d.period,
                     "diloco": dataclasses.asdict(d)})
    for row in rows:
        row["fast_step_time_s"] = t_fast
    return rows


# DiLoCo settings the tuner's search tries (H, fragments, tau, outer dtype): the one the
# convergence bench measures, and a sparser one with int8 outer gradients.
DILOCO_SETTINGS: tuple[tuple[int, int, int, str], ...] = ((8, 2, 1, "bf16"), (32, 4, 1, "int8"))


def _hidden(r) -> float:
    """overlap / comm of a simulator result."""
    m = r.metrics
    return m.overlap_s / m.comm_s if m.comm_s > 0 else 0.0


def slow_link_profile(hw: HardwareProfile, devices: int) -> bool:
    """Whether `devices` fill the profile's hosts joined by a slow 'dcn' link: then the
    tuner's search lays dp across the hosts (flat, or mesh.dcn = hosts)."""
    return ("dcn" in hw.axes and hw.hosts > 1
            and devices == hw.hosts * hw.devices_per_host)


def _slow_candidates(cand: Candidate, hosts: int) -> list[Candidate]:
    """The dcn = hosts versions of a flat candidate: hierarchical, one step late, DiLoCo."""
    base = dataclasses.replace(cand, dcn=hosts, dp=cand.dp // hosts)
    modes = ["hierarchical", "delay1"] + [
        "diloco:" + ",".join(str(x) for x in d) for d in DILOCO_SETTINGS]
    return [dataclasses.replace(base, slow=m) for m in modes]


def _slow_state_bytes(cfg: Config, cand: Candidate) -> float:
    """Per-device bytes the slow axis adds to the train state: the in-flight gradient
    (delay 1), or the local copy and outer momentum (DiLoCo), fp32."""
    plan = plan_of(cfg)
    elems = plan_shape.stage_param_elements(cfg, plan)
    if cand.slow == "delay1":
        split = plan.dp if (plan.overlap.zero1 or plan.overlap.fsdp) else 1
        return 4.0 * elems / split
    if cand.stale:
        return 8.0 * elems / (plan.dp if plan.overlap.fsdp else 1)
    return 0.0


def slow_link_search(candidates: Sequence[tuple[Candidate, Config]], hw: HardwareProfile,
                     efficiency: float = FLOP_EFFICIENCY, keep: int = TABLE_ROWS
                     ) -> tuple[list[Prediction], int]:
    """The search on a profile of hosts joined by a slow link: every flat layout (dp over
    all hosts, its reduction on the slow link) and its dcn = hosts versions (hierarchical,
    one step late, DiLoCo settings of `DILOCO_SETTINGS`).

    Each layout's host share (dp / hosts, 1 / hosts of the batch) is simulated first: every
    way of crossing hosts is at least that fast step. Layouts are then simulated in full in
    the order of their fast step, until the next fast step is slower than the `keep`-th
    fitting plan found: no layout left can rank above it, so the leading `keep` plans are
    exact.

    Returns:
      (the predictions of the layouts simulated in full, how many layouts were pruned).
    """
    hosts = hw.hosts
    shares = []
    for c, conf in candidates:
        if c.dp % hosts:
            continue  # tp / pp would span the hosts, which the profile does not describe
        fast_cfg = _without_dcn(conf, c.dp // hosts, hosts)
        try:
            configlib.validate(fast_cfg)
        except ConfigError:
            continue
        fast_plan = plan_of(fast_cfg)
        r = simulate(sim_plan(fast_cfg, fast_plan), plan_costs.flop_costs(fast_cfg, fast_plan, hw, efficiency), hw)
        shares.append((r.step_time_s, c.key(), c, conf, fast_cfg, fast_plan, r))
    shares.sort(key=lambda x: (x[0], x[1]))
    out: list[Prediction] = []
    fitting: list[float] = []
    done = 0
    for t_fast, _, c, conf, fast_cfg, fast_plan, r in shares:
        if len(fitting) >= keep and significant(t_fast) > significant(sorted(fitting)[keep - 1]):
            break
        done += 1
        split_cfgs = []
        for sc in _slow_candidates(c, hosts):
            try:
                split_cfgs.append((sc, apply_candidate(conf, sc)))
            except ConfigError:
                continue
        if not split_cfgs:
            continue
        dilocos = [plan_of(k).diloco for sc, k in split_cfgs if sc.slow.startswith("diloco")]
        rows = slow_axis_modes(split_cfgs[0][1], hw, efficiency, fast=r, dilocos=dilocos)
        flat = rows[0]
        by_mode = {"hierarchical": rows[1], "delay1": rows[2]}
        by_mode.update({sc.slow: row for (sc, _), row in zip(
            [x for x in split_cfgs if x[0].slow.startswith("diloco")], rows[3:])})
        fast_memory = r.peak_memory_bytes + plan_shape.transient_bytes(fast_cfg, fast_plan)
        entries = [(c, conf, flat["step_time_s"], flat["memory_bytes"], flat["ccor"],
                    flat["hidden_comm"], flat["bubble_rate"], flat["exposed_comm_s"])]
        for sc, k in split_cfgs:
            row = by_mode[sc.slow]
            entries.append((sc, k, row["step_time_s"], fast_memory + _slow_state_bytes(k, sc),
                            r.ccor, _hidden(r), r.bubble_rate,
                            r.exposed_comm_s + row["exposed_dcn_s"]))
        for cand, k, step, memory, ccor, hidden, bubble, exposed in entries:
            fits = memory <= memory_budget(hw)
            out.append(Prediction(candidate=cand, config=k, step_time_s=step, simulated_s=step,
                                  optimizer_s=0.0, ccor=ccor, hidden_comm=hidden,
                                  bubble_rate=bubble, exposed_comm_s=exposed,
                                  memory_bytes=memory, fits=fits))
            if fits:
                fitting.append(step)
    return rank(out), len(shares) - done


def slow_axis_search(cfg: Config, hardware: str):
    """For a profile with several hosts and a 'dcn' link: the slow-axis modes of `cfg` with
    its dp split as mesh.dcn = hosts x dp / hosts, and the config to write (dcn set when
    the hierarchical reduction wins). ([], None, cfg) otherwise."""
    hw = load_profile(hardware)
    if "dcn" not in hw.axes or hw.hosts < 2 or cfg.mesh.dcn > 1 or cfg.mesh.dp % hw.hosts:
        if "dcn" in hw.axes and cfg.mesh.dcn > 1:
            rows = slow_axis_modes(cfg, hw)
            return rows, best_slow_mode(rows), cfg
        return [], None, cfg
    split = dataclasses.replace(cfg, mesh=dataclasses.replace(
        cfg.mesh, dcn=hw.hosts, dp=cfg.mesh.dp // hw.hosts))
    try:
        configlib.validate(split)
    except ConfigError:
        return [], None, cfg
    rows = slow_axis_modes(split, hw)
    best = best_slow_mode(rows)
    return rows, best, split if best["mode"] == "hierarchical" else cfg


def _default_diloco():
    from jax_overlap.plan import DilocoPlan

    return DilocoPlan(inner_steps=8, fragments=2, delay=1)


def best_slow_mode(rows: Sequence[dict[str, Any]], exact: bool = True) -> dict[str, Any]:
    """The fastest mode; `exact` keeps to the ones that train like one device (flat,
    hierarchical) -- delay and DiLoCo change the optimisation and are opt-in."""
    pool = [r for r in rows if not exact or r["mode"] in ("flat", "hierarchical")]
    return min(pool, key=lambda r: (significant(r["step_time_s"]), SLOW_MODES.index(r["mode"])))


def format_slow_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'mode':14s} {'step ms':>10s} {'exposed dcn ms':>15s} {'dcn MB/step':>12s}"]
    for r in rows:
        lines.append(f"{r['mode']:14s} {r['step_time_s'] * 1e3:10.1f} "
                     f"{r['exposed_dcn_s'] * 1e3:15.1f} {r['dcn_bytes_per_step'] / 1e6:12.1f}")
    return "\n".join(lines)
