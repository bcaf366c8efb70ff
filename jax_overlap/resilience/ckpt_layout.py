"""The checkpoint's layout: params in logical layer order, and whether a checkpoint fits this run.

Whatever the pipeline schedule does to the order of the stacked blocks at run time, a
checkpoint stores them in the logical order, so any mesh and schedule can restore it;
`to_checkpoint` and `from_checkpoint` are the only places where the two layouts differ.
`checkpoint_mismatch` compares the committed markers (`read_markers`) with the restore target
before the checkpointer looks for the newest good step, so a run started with another
model, optimizer or guard layout is reported as such instead of quarantining every checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional

import jax
import numpy as np


def to_checkpoint(loop: Any, perm: Optional[np.ndarray], shardings: Any) -> Any:
    """The tree to save (a `LoopState`): blocks in logical order, so any mesh and schedule can
    restore it.

    This and `from_checkpoint` are the only places where the runtime layout and the
    checkpoint layout differ.
    """
    if perm is None:
        return loop
    from jax_overlap.pipeline import layout

    return jax.jit(lambda t: layout.to_logical(t, perm), out_shardings=shardings)(loop)


def from_checkpoint(tree: Any, perm: Optional[np.ndarray], shardings: Any) -> Any:
    """Inverse of `to_checkpoint`: a restored tree in this run's (staged) layout."""
    if perm is None:
        return tree
    from jax_overlap.pipeline import layout

    return jax.jit(lambda t: layout.to_staged(t, perm), out_shardings=shardings)(tree)


def checkpoint_target(abstract: Any, perm: Optional[np.ndarray]) -> Any:
    """The checkpoint's shapes of a run's (staged) abstract state: `abstract` itself, except
    that uneven pipeline stages pad the staged blocks (`pipeline.layout`), which the
    checkpoint drops. Such a leaf's layer axis stays split over its mesh axes where the
    logical layer count divides evenly, and is replicated otherwise.

    Args:
      abstract: ShapeDtypeStructs with shardings (`abstract_loop_state`).
      perm: the plan's `layer_perm` (-1 marks padding); None is the identity.

    Returns:
      The restore target / save layout of a checkpoint.
    """
    if perm is None or (np.asarray(perm) >= 0).all():
        return abstract
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.pipeline.layout import BLOCKS

    layers = int((np.asarray(perm) >= 0).sum())

    def fix(path, a):
        if not any(getattr(k, "key", None) == BLOCKS for k in path) or not a.shape:
            return a
        sharding = a.sharding
        if isinstance(sharding, NamedSharding) and len(sharding.spec):
            spec = list(sharding.spec)
            axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
            size = int(np.prod([sharding.mesh.shape[x] for x in axes if x is not None]))
            if layers % size:
                sharding = NamedSharding(sharding.mesh, P(None, *spec[1:]))
        return jax.ShapeDtypeStruct((layers, *a.shape[1:]), a.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(fix, abstract)


def checkpoint_mismatch(markers: Iterable[tuple[int, dict]], abstract: Any) -> Optional[str]:
    """Why no committed checkpoint can restore into `abstract`, or None if one may.

    Compares leaf names, shapes and dtypes with the `checksums` table of each commit marker
    (global shapes, so a different mesh still matches). Used before `latest_good`, which would
    otherwise treat a run started with another model or optimizer as "every checkpoint is
    corrupt" and quarantine them all.

    Args:
      markers: (step, parsed COMMITTED marker) pairs, newest first; unparsable ones left out.
      abstract: the restore target.

    Returns:
      None when some marker matches or there is none; else a one-line description of how the
      newest marker differs.
    """
    expected = {jax.tree_util.keystr(path): (list(leaf.shape), str(leaf.dtype))
                for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    first = None
    for step, marker in markers:
        table = marker.get("checksums") if isinstance(marker, dict) else None
        if not isinstance(table, dict):
            continue
        saved = {name: (list(e.get("shape", [])), str(e.get("dtype"))) for name, e in table.items()}
        if saved == expected:
            return None
        if first is None:
            first = (step, saved)
    if first is None:
        return None
    step, saved = first
    extra, missing = sorted(set(saved) - set(expected)), sorted(set(expected) - set(saved))
    if extra or missing:
        what = (f"it has {extra[0]} which this run lacks" if extra
                else f"it lacks {missing[0]} which this run has")
    else:
        name = next(n for n in sorted(expected) if saved[n] != expected[n])
        what = (f"{name} is {saved[name][1]}{saved[name][0]} there, "
                f"{expected[name][1]}{expected[name][0]} here")
    return f"checkpoint step {step} was saved with a different model/optimizer/guard layout: {what}"


def read_markers(ckpt_dir: str, steps: Iterable[int]) -> list[tuple[int, dict]]:
    """(step, marker) for every given step whose COMMITTED marker parses, newest first."""
    from jax_overlap.resilience.checkpoint import MARKER_NAME

    out = []
    for step in sorted(steps, reverse=True):
        try:
            with open(os.path.join(ckpt_dir, str(step), MARKER_NAME), encoding="utf-8") as f:
                out.append((step, json.load(f)))
        except (OSError, ValueError):
            continue  # latest_good reports unreadable markers itself
    return out
