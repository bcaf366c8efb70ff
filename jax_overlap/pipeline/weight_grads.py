"""A block's backward split in two: B (input gradients) and W (only the weight-gradient GEMMs).

Zero-bubble schedules assume W costs about what the weight-gradient matmuls cost. A plain
`jax.vjp` cannot give that: the gradient of an early layer's weights needs the output gradient
at that layer, which only a backward through the later layers produces. So B keeps, for every
weight matmul, its output gradient, and W multiplies it with the matmul's input.

`split_block` reads any block's jaxpr (the bring-your-own contract's `block(p, x)`) once:

* a *weight matmul* is a `dot_general` one of whose operands depends on the parameters only
  (through casts, reshapes, transposes) and the other on the activation;
* `forward(p, x, z)` evaluates the block with `+ z[k]` on the k-th weight matmul's output (a
  zero addend: its cotangent is that matmul's output gradient) and also returns every weight
  matmul's activation operand;
* B is then the pullback of `forward` w.r.t. the activation, the addends and the parameters
  that are used other than as a matmul weight (biases, norm scales: `other_leaves`), with the
  matmul weights held fixed: the input gradient, every matmul's output gradient and the small
  parameters' gradients, without the weight-gradient GEMMs;
* W is the pullback of `weight_matmuls(p, acts)` -- only the weight matmuls, fed the saved
  activation operands -- w.r.t. the matmul weights (`dot_leaves`): the weight-gradient GEMMs.

A block whose weight matmul sits inside a control-flow primitive or a custom derivative (a
`scan`, `while`, `cond`, `custom_vjp` in its jaxpr: collective matmul's ring steps, say) is not
split: `split_block` returns None and why, and the executor keeps its full-backward W.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jax_overlap.parallel import compat

# Call primitives whose body is evaluated inline, by the name of their jaxpr parameter.
_INLINE = {"pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
           "remat": "jaxpr", "checkpoint": "jaxpr"}


class Unsupported(Exception):
    """A weight matmul this module cannot reach."""


class SplitBlock(NamedTuple):
    """A block's B/W split (see the module docstring).

    Attributes:
      forward: `(p, x, z) -> (y, acts)`; `z`: one array per weight matmul; `acts`: one per
        distinct activation operand (matmuls of one input, q, k and v, share its entry: W's
        stash holds it once).
      weight_matmuls: `(p, acts) -> outs`: the weight matmuls only, one output each, in
        `z`'s order.
      dot_leaves: indices (in `jax.tree.leaves(p)` order) of W's parameters: used only as
        matmul weights.
      z_avals: per weight matmul, (shape, dtype, varying axes) of its output.
    """

    forward: Callable
    weight_matmuls: Callable
    dot_leaves: tuple[int, ...]
    z_avals: tuple

    def other_leaves(self, n: int) -> tuple[int, ...]:
        """B's parameters: every leaf that is not one of `dot_leaves`."""
        return tuple(i for i in range(n) if i not in self.dot_leaves)


class _Step(NamedTuple):
    """One equation of the flattened block: where its inputs come from, where outputs go."""

    eqn: Any
    ins: tuple  # keys, or ("lit", value)
    outs: tuple


def _sub_jaxprs(eqn) -> list:
    found = []
    for value in eqn.params.values():
        for v in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, jax.extend.core.Jaxpr):
                found.append(v)
    return found


def _has_dot(jaxpr) -> bool:
    return any(e.primitive.name == "dot_general" or any(_has_dot(j) for j in _sub_jaxprs(e))
               for e in jaxpr.eqns)


def _flatten(jaxpr, consts, in_keys, counter, steps, const_vals):
    """Appends `jaxpr`'s equations to `steps`, inlining call primitives; returns out keys."""
    env = dict(zip(jaxpr.invars, in_keys))
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = k = next(counter)
        const_vals[k] = c

    def key(v):
        return ("lit", v.val) if isinstance(v, jax.extend.core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _INLINE and _INLINE[name] in eqn.params:
            inner = eqn.params[_INLINE[name]]
            outs = _flatten(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()),
                            [key(v) for v in eqn.invars], counter, steps, const_vals)
        else:
            outs = [next(counter) for _ in eqn.outvars]
            steps.append(_Step(eqn, tuple(key(v) for v in eqn.invars), tuple(outs)))
        for v, k in zip(eqn.outvars, outs):
            env[v] = k
    return [key(v) for v in jaxpr.outvars]


def _is_lit(k) -> bool:
    return isinstance(k, tuple) and k[0] == "lit"


class _Graph:
    """The flattened block and what the split needs to know about it."""

    def __init__(self, jaxpr, consts, n_params: int):
        counter = itertools.count()
        self.param_keys = [next(counter) for _ in range(n_params)]
        self.x_key = next(counter)
        self.steps: list[_Step] = []
        self.consts: dict = {}
        self.out_keys = _flatten(jaxpr, consts, [*self.param_keys, self.x_key], counter,
                                 self.steps, self.consts)
        weight_only = {k: True for k in [*self.param_keys, *self.consts]}
        weight_only[self.x_key] = False
        origins = {k: {i} for i, k in enumerate(self.param_keys)}
        self.weight_dots: list[tuple[int, int]] = []  # (step index, activation operand pos)
        other: set[int] = set()

        def w(k):
            return True if _is_lit(k) else weight_only[k]

        for n, step in enumerate(self.steps):
            flags = [w(k) for k in step.ins]
            name = step.eqn.primitive.name
            if name == "dot_general" and len(flags) == 2 and flags[0] != flags[1]:
                self.weight_dots.append((n, flags.index(False)))
                for k in step.outs:
                    weight_only[k] = False
                continue
            if all(flags):
                srcs = set().union(*(origins.get(k, set()) for k in step.ins if not _is_lit(k)))
                for k in step.outs:
                    weight_only[k], origins[k] = True, srcs
                continue
            if any(flags) and any(_has_dot(j) for j in _sub_jaxprs(step.eqn)):
                raise Unsupported(f"a weight matmul inside `{name}`")
            for k, f in zip(step.ins, flags):
                if f and not _is_lit(k):
                    other |= origins.get(k, set())
            for k in step.outs:
                weight_only[k] = False
        for k in self.out_keys:
            if not _is_lit(k) and weight_only.get(k):
                other |= origins.get(k, set())
        self.dot_leaves = tuple(i for i in range(n_params) if i not in other)
        self.weight_only = weight_only
        # Weight matmul k reads activation operand `act_of[k]`: one per distinct input (q, k
        # and v read the norm's output: `collectives.column_parallel_parts`).
        inputs = [self.steps[n].ins[pos] for n, pos in self.weight_dots]
        firsts = list(dict.fromkeys(inputs))
        self.act_of = tuple(firsts.index(k) for k in inputs)

    def run(self, params, x, *, z=None, acts=None):
        """Evaluates the block. `z`: add `z[k]` to the k-th weight matmul's output and record
        its activation operand. `acts`: weight part only, weight matmuls fed `acts[k]`.

        Returns:
          (outputs, the distinct activation operands recorded, weight matmul outputs).
        """
        env = dict(self.consts)
        env.update(zip(self.param_keys, params))
        env[self.x_key] = x
        dot_of = {n: (k, pos) for k, (n, pos) in enumerate(self.weight_dots)}
        found, outs_k = [], []

        def read(k):
            return k[1] if _is_lit(k) else env[k]

        for n, step in enumerate(self.steps):
            if n in dot_of:
                k, pos = dot_of[n]
                operands = [None if (acts is not None and i == pos) else read(a)
                            for i, a in enumerate(step.ins)]
                if acts is not None:
                    operands[pos] = acts[self.act_of[k]]
                elif self.act_of[k] == len(found):  # the first matmul of this input
                    found.append(operands[pos])
                (out,) = _bind(step.eqn, operands)
                outs_k.append(out)
                if z is not None:
                    out = out + z[k]
                env[step.outs[0]] = out
                continue
            if acts is not None and not all(_is_lit(a) or self.weight_only[a] for a in step.ins):
                continue  # activation work: not needed for the weight matmuls
            for k, v in zip(step.outs, _bind(step.eqn, [read(a) for a in step.ins])):
                env[k] = v
        outputs = None if acts is not None else [read(k) for k in self.out_keys]
        return outputs, found, outs_k


def _bind(eqn, invals) -> list:
    if eqn.primitive.name == "pvary":
        # A replayed value may already vary over an axis the traced one did not (the
        # in-loop buckets mark a weight varying over tp before its last weight matmuls);
        # marking it again is an error, so only the axes it lacks are added.
        axes = tuple(eqn.params["axes"])
        return [compat.to_varying(v, tuple(a for a in axes if a not in compat.varying_axes(v)))
                for v in invals]
    out = compat.bind_eqn(eqn, invals)
    return list(out) if eqn.primitive.multiple_results else [out]


def split_block(block: Callable, p_layer: Any, x: jax.Array) -> tuple[SplitBlock | None, str]:
    """Reads `block(p, x)`'s jaxpr at one layer's shapes and builds its B/W split.

    Returns:
      (the `SplitBlock`, "") or (None, why the block cannot be split).
    """
    leaves, treedef = jax.tree.flatten(p_layer)
    n = len(leaves)
    closed = jax.make_jaxpr(lambda ls, x_: block(jax.tree.unflatten(treedef, ls), x_))(leaves, x)
    if len(closed.jaxpr.outvars) != 1:
        return None, "the block returns more than one array"
    try:
        graph = _Graph(closed.jaxpr, closed.consts, n)
    except Unsupported as e:
        return None, str(e)
    if not graph.weight_dots or not graph.dot_leaves:
        return None, "no parameter is used only as a matmul weight"
    _, _, probe = graph.run(leaves, x)
    z_avals = tuple((tuple(o.shape), o.dtype, tuple(sorted(compat.varying_axes(o))))
                    for o in probe)

    def forward(p, x_, z):
        outputs, found, _ = graph.run(jax.tree.leaves(p), x_, z=z)
        return outputs[0], found

    def weight_matmuls(p, acts):
        return graph.run(jax.tree.leaves(p), jnp.zeros((), jnp.float32), acts=acts)[2]

    return SplitBlock(forward, weight_matmuls, graph.dot_leaves, z_avals), ""
