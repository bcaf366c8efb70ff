"""ResNet-18/50/152 (v1.5) as a `StagedModel`, with batch norm synchronised over dp.

Batch norm: in training, every BN normalises with the statistics of the *global* batch: each
device sums x and x^2 over its examples and one `psum` over 'dp' per BN (a (2C,) vector)
completes them, so dp=k computes exactly what one device computes on the whole batch.
`bn_sync=False` keeps the per-device statistics instead (the cheaper, mesh-dependent
behaviour of plain data-parallel BN). Statistics are always the current batch's (training
mode); there are no running averages, so `logits` evaluates with the batch's statistics.
Statistics are per microbatch, so with `pipeline.microbatches` M > 1 they are those of the
global microbatch (B / M examples), as in any gradient-accumulating BN training.

Staged layout. The StagedModel protocol stacks blocks with a leading layer axis, but ResNet's
residual blocks change shape from stage to stage. Here one stacked "layer" is a *unit*: a
contiguous group of residual blocks, the groups chosen by `jax_overlap.parallel.partition` so that
units have (near) equal estimated FLOPs. Each unit's parameters are packed into one flat
vector, padded to the largest unit's size, so `params['blocks']['packed']` is (units, P).
Activations between units travel as (B, 1 + N): column 0 is the index of the next unit to run
(a tag written by the previous unit), the rest is the flattened (H, W, C) map padded to the
largest unit boundary N. `block` reads the tag and `lax.switch`es to that unit's residual
blocks, so the same code runs under the pp=1 layer scan and in any pipeline schedule, in
whatever order the schedule stores the units (the activation, not the storage, says where it
is). The tag carries no gradient.

`ResNetModel.from_config(cfg, units)` makes `units` units: the library's `build_model` passes
one per virtual pipeline stage (pp x v, `model_api.pipeline_units`; one unit, hence no padding
and no switch, at pp=1); every stage then holds one FLOP-balanced unit.
`convert_params` regroups parameters between unit counts: the network is the same, so a
checkpoint taken at one pp restores at another after conversion. Anything that treats a
parameter leaf as a layer (LAMB's trust ratio) sees a unit's packed vector as one leaf.

Tensor parallelism is not supported (mesh.tp must be 1): scale ResNets over dp and pp.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache, partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_overlap.parallel.collectives import Parallel
from jax_overlap.parallel.mesh import DP
from jax_overlap.parallel.partition import Partition, describe_partition, partition

# depth -> (block kind, residual blocks per stage); the standard ResNet family plus ResNet-10.
PRESETS: dict[int, tuple[str, tuple[int, ...]]] = {
    10: ("basic", (1, 1, 1, 1)),
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}
# Images at most this wide get the CIFAR stem (3x3 conv, no max-pool) instead of ImageNet's.
SMALL_IMAGE = 64


@dataclass(frozen=True)
class ResNetConfig:
    """What defines the network (independent of the mesh).

    Attributes:
      depth: a key of `PRESETS` (18, 50, 152, ...).
      width: channels of the first stage (64 in the standard models).
      image_size: side of the square input images.
      classes: number of output classes.
      channels: input image channels.
      bn_sync: batch-norm statistics over the global batch (psum over dp); False: per device.
      zero_init_residual: start each residual branch's last BN scale at 0 (the block starts as
        the identity; helps deep nets train). Tests that compare gradients turn it off so
        every branch weight gets a gradient.
    """

    depth: int = 18
    width: int = 64
    image_size: int = 32
    classes: int = 10
    channels: int = 3
    bn_sync: bool = True
    zero_init_residual: bool = True

    def __post_init__(self):
        if self.depth not in PRESETS:
            raise ValueError(f"model.layers: ResNet depth {self.depth} is not one of "
                             f"{sorted(PRESETS)}")

    @classmethod
    def from_model_config(cls, m) -> "ResNetConfig":
        """Reads `cfg.model`: dedicated fields when the config has them, else the shared ones.

        Shared-field meaning for `model.kind: resnet`: `layers` = depth, `d_model` = width of
        the first stage, `seq_len` = image side, `vocab` = classes.
        """
        return cls(depth=getattr(m, "depth", m.layers), width=getattr(m, "width", m.d_model),
                   image_size=getattr(m, "image_size", m.seq_len),
                   classes=getattr(m, "classes", m.vocab),
                   bn_sync=getattr(m, "bn_sync", True))

    @property
    def imagenet_stem(self) -> bool:
        return self.image_size > SMALL_IMAGE


@dataclass(frozen=True)
class BlockSpec:
    """One residual block's static shape."""

    kind: str  # basic | bottleneck
    c_in: int
    c_mid: int
    c_out: int
    stride: int
    size_in: int  # input side (square maps)
    name: str

    @property
    def size_out(self) -> int:
        return -(-self.size_in // self.stride)

    @property
    def projection(self) -> bool:
        return self.stride != 1 or self.c_in != self.c_out

    def forward_flops(self) -> float:
        """2 x multiply-accumulates of the convolutions (BN / ReLU / add are negligible)."""
        hw_out = self.size_out ** 2
        if self.kind == "basic":
            macs = hw_out * 9 * (self.c_in * self.c_out + self.c_out * self.c_out)
        else:
            macs = (self.size_in ** 2 * self.c_in * self.c_mid + hw_out * 9 * self.c_mid ** 2
                    + hw_out * self.c_mid * self.c_out)
        if self.projection:
            macs += hw_out * self.c_in * self.c_out
        return 2.0 * macs


def block_specs(cfg: ResNetConfig) -> tuple[BlockSpec, ...]:
    """The residual blocks of a config, in order (ResNet v1.5: stride on the 3x3 conv)."""
    kind, counts = PRESETS[cfg.depth]
    expansion = 4 if kind == "bottleneck" else 1
    size = stem_output_size(cfg)
    c_in, specs = cfg.width, []
    for stage, count in enumerate(counts):
        c_mid = cfg.width * 2 ** stage
        for i in range(count):
            stride = 2 if stage > 0 and i == 0 else 1
            spec = BlockSpec(kind, c_in, c_mid, c_mid * expansion, stride, size,
                             f"s{stage + 1}b{i}")
            specs.append(spec)
            c_in, size = spec.c_out, spec.size_out
    return tuple(specs)


def stem_output_size(cfg: ResNetConfig) -> int:
    # ImageNet stem: stride-2 7x7 conv then a stride-2 max-pool.
    return -(-cfg.image_size // 4) if cfg.imagenet_stem else cfg.image_size


# ------------------------------------------------------------------------------ modules


# Initial distributions. `ResNetModel.init` draws every weight from ONE normal vector with
# these scales (`_initial_value`) instead of calling each module's initializer: XLA on CPU
# spends about a second compiling each separate threefry draw, i.e. minutes for a ResNet.
CONV_INIT = nn.initializers.variance_scaling(2.0, "fan_out", "normal")  # He, as torchvision
DENSE_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "normal")


def _last_bn(kind: str) -> str:
    """The BN closing a residual branch (zero-initialised with `zero_init_residual`)."""
    return "bn2" if kind == "basic" else "bn3"


def _initial_value(path: tuple[str, ...], shape: tuple[int, ...], zero_bn: str | None
                   ) -> tuple[str, float]:
    """('normal', std) or ('const', value) for one parameter, matching the modules' inits."""
    name = path[-1]
    if name == "kernel" and len(shape) == 4:  # conv (kh, kw, c_in, c_out): fan_out = kh kw c_out
        return "normal", float(np.sqrt(2.0 / (shape[0] * shape[1] * shape[3])))
    if name == "kernel" and len(shape) == 2:  # dense (c_in, c_out)
        return "normal", float(np.sqrt(1.0 / shape[0]))
    if name == "scale":
        return "const", 0.0 if zero_bn is not None and path[0] == zero_bn else 1.0
    if name == "bias":
        return "const", 0.0
    raise ValueError(f"no initial distribution for parameter {'/'.join(path)} {shape}")


def _conv(features: int, k: int, stride: int, dtype, name: str) -> nn.Conv:
    # Symmetric k//2 padding (as torchvision): a stride-2 layer maps S to ceil(S/2).
    return nn.Conv(features, (k, k), (stride, stride), padding=[(k // 2, k // 2)] * 2,
                   use_bias=False, dtype=dtype, param_dtype=jnp.float32, kernel_init=CONV_INIT,
                   name=name)


class BatchNorm(nn.Module):
    """Training-mode batch norm; statistics in fp32, over the global batch when `sync`.

    Inside the train step's `shard_map` (`par.active`) the 'dp' axis is bound, and one psum
    of the stacked per-channel sums of x and x^2 gives the global statistics with a single
    collective per BN. On one device (the reference) local and global coincide.
    """

    sync: bool = True
    zero_init: bool = False
    eps: float = 1e-5
    dp_axis: str = DP

    @nn.compact
    def __call__(self, x_bhwc, par: Parallel):
        c = x_bhwc.shape[-1]
        scale_c = self.param("scale", nn.initializers.zeros if self.zero_init
                             else nn.initializers.ones, (c,))
        bias_c = self.param("bias", nn.initializers.zeros, (c,))
        x32_bhwc = x_bhwc.astype(jnp.float32)
        count = x32_bhwc.size // c
        sums_2c = jnp.concatenate([x32_bhwc.sum((0, 1, 2)), jnp.square(x32_bhwc).sum((0, 1, 2))])
        if self.sync and par.active:
            sums_2c = jax.lax.psum(sums_2c, self.dp_axis)  # (2C,) per device, over dp
            count = count * jax.lax.psum(1, self.dp_axis)  # () the dp size, over dp
        mean_c = sums_2c[:c] / count
        var_c = jnp.maximum(sums_2c[c:] / count - jnp.square(mean_c), 0.0)
        y_bhwc = (x32_bhwc - mean_c) * (jax.lax.rsqrt(var_c + self.eps) * scale_c) + bias_c
        return y_bhwc.astype(x_bhwc.dtype)


class ResidualBlock(nn.Module):
    """A basic (two 3x3) or bottleneck (1x1, 3x3, 1x1) block with a projection shortcut when
    the shape changes."""

    spec: BlockSpec
    bn_sync: bool = True
    zero_init_residual: bool = True

    @nn.compact
    def __call__(self, x_bhwc, par: Parallel):
        s, dt = self.spec, par.compute_dtype
        bn = partial(BatchNorm, sync=self.bn_sync)
        if s.kind == "basic":
            y = _conv(s.c_out, 3, s.stride, dt, "conv1")(x_bhwc)
            y = nn.relu(bn(name="bn1")(y, par))
            y = _conv(s.c_out, 3, 1, dt, "conv2")(y)
        else:
            y = _conv(s.c_mid, 1, 1, dt, "conv1")(x_bhwc)
            y = nn.relu(bn(name="bn1")(y, par))
            y = _conv(s.c_mid, 3, s.stride, dt, "conv2")(y)
            y = nn.relu(bn(name="bn2")(y, par))
            y = _conv(s.c_out, 1, 1, dt, "conv3")(y)
        y = bn(zero_init=self.zero_init_residual, name=_last_bn(s.kind))(y, par)
        shortcut = x_bhwc.astype(dt)
        if s.projection:
            shortcut = bn(name="bn_proj")(_conv(s.c_out, 1, s.stride, dt, "conv_proj")(x_bhwc),
                                          par)
        return nn.relu(y + shortcut)


class Stem(nn.Module):
    width: int
    imagenet: bool
    bn_sync: bool = True

    @nn.compact
    def __call__(self, images_bhwc, par: Parallel):
        dt = par.compute_dtype
        if self.imagenet:
            y = _conv(self.width, 7, 2, dt, "conv")(images_bhwc)
        else:
            y = _conv(self.width, 3, 1, dt, "conv")(images_bhwc)
        y = nn.relu(BatchNorm(sync=self.bn_sync, name="bn")(y, par))
        if self.imagenet:
            y = nn.max_pool(y, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
        return y


class Head(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, y_bhwc):
        pooled_bc = y_bhwc.astype(jnp.float32).mean((1, 2))
        return nn.Dense(self.classes, kernel_init=DENSE_INIT, name="fc")(pooled_bc)


# ------------------------------------------------------------------------------ packing


def _layout(module: nn.Module, x: jax.ShapeDtypeStruct, *static) -> tuple[Any, tuple, tuple]:
    """(treedef, leaf paths, leaf shapes) of a module's parameters, without computing them."""
    shapes = jax.eval_shape(lambda x_: module.init(jax.random.key(0), x_, *static), x)["params"]
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    paths = tuple(tuple(k.key for k in path) for path, _ in with_paths)
    return treedef, paths, tuple(tuple(leaf.shape) for _, leaf in with_paths)


@lru_cache(maxsize=None)
def _block_layout(spec: BlockSpec) -> tuple[Any, tuple, tuple]:
    x = jax.ShapeDtypeStruct((1, spec.size_in, spec.size_in, spec.c_in), jnp.float32)
    return _layout(ResidualBlock(spec), x, Parallel())


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _pack_act(y_bhwc: jax.Array, tag: int, width: int) -> jax.Array:
    """(B, H, W, C) -> (B, 1 + width): the next unit's index, the map, zero padding."""
    b = y_bhwc.shape[0]
    flat_bn = y_bhwc.reshape(b, -1).astype(jnp.float32)
    tag_b1 = jnp.full((b, 1), tag, jnp.float32)
    pad_bp = jnp.zeros((b, width - flat_bn.shape[1]), jnp.float32)
    return jnp.concatenate([tag_b1, flat_bn, pad_bp], axis=1)


def _unpack_act(x_bn: jax.Array, shape: tuple[int, int, int]) -> jax.Array:
    return x_bn[:, 1:1 + _size(shape)].reshape(x_bn.shape[0], *shape)


# ------------------------------------------------------------------------------ model


@dataclass(frozen=True)
class ResNetModel:
    """A ResNet as a `jax_overlap.model_api.StagedModel` of `units` packed block groups.

    Attributes:
      cfg: the network.
      units: stacked layers (pipeline units); each a FLOP-balanced run of residual blocks.
    """

    cfg: ResNetConfig
    units: int = 1

    def __post_init__(self):
        if not 1 <= self.units <= len(self.specs):
            raise ValueError(f"units: {self.units} must be between 1 and the "
                             f"{len(self.specs)} residual blocks of ResNet-{self.cfg.depth}")

    @classmethod
    def from_config(cls, cfg, units: int = 1) -> "ResNetModel":
        """The config's ResNet (`cfg.model`) in `units` pipeline units (one per virtual
        pipeline stage; one at pp=1). The config's validation refuses mesh.tp > 1."""
        return cls(ResNetConfig.from_model_config(cfg.model), units)

    # Static structure ----------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.units

    @cached_property
    def specs(self) -> tuple[BlockSpec, ...]:
        return block_specs(self.cfg)

    def block_costs(self) -> list[float]:
        """Estimated training FLOPs per residual block (stem added to the first, head to the
        last: they run on the first / last pipeline stage)."""
        costs = [3.0 * s.forward_flops() for s in self.specs]
        costs[0] += 3.0 * self._stem_flops()
        costs[-1] += 3.0 * self._head_flops()
        return costs

    def block_names(self) -> list[str]:
        return [s.name for s in self.specs]

    def plan(self, stages: int | None = None, virtual_stages: int = 1) -> Partition:
        """The FLOP-balanced cut of the residual blocks (default: into this model's units)."""
        if stages is None:
            stages, virtual_stages = self.units, 1
        return partition(self.block_costs(), stages, virtual_stages, self.block_names())

    def describe_partition(self, stages: int | None = None, virtual_stages: int = 1) -> str:
        """`jax_overlap.parallel.partition.describe_partition` of `plan(...)`, for the CLI."""
        return describe_partition(self.plan(stages, virtual_stages))

    @cached_property
    def _bounds(self) -> tuple[int, ...]:
        return self.plan().bounds

    @cached_property
    def _unit_blocks(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(range(a, b)) for a, b in zip(self._bounds, self._bounds[1:]))

    def _boundary_shape(self, u: int) -> tuple[int, int, int]:
        """(H, W, C) entering unit u (u == units: leaving the last unit)."""
        if u == 0:
            s = stem_output_size(self.cfg)
            return (s, s, self.cfg.width)
        last = self.specs[self._bounds[u] - 1]
        return (last.size_out, last.size_out, last.c_out)

    @cached_property
    def act_width(self) -> int:
        """N: the largest flattened map at a unit boundary (activations are (B, 1 + N))."""
        return max(_size(self._boundary_shape(u)) for u in range(self.units + 1))

    def _unit_size(self, u: int) -> int:
        return sum(_size(shape) for b in self._unit_blocks[u]
                   for shape in _block_layout(self.specs[b])[2])

    @cached_property
    def packed_size(self) -> int:
        """P: parameters per packed unit (the largest unit; the others are zero-padded)."""
        return max(self._unit_size(u) for u in range(self.units))

    # Parameters -----------------------------------------------------------------------------
    def _stem(self) -> Stem:
        return Stem(self.cfg.width, self.cfg.imagenet_stem, self.cfg.bn_sync)

    def _block_module(self, spec: BlockSpec) -> ResidualBlock:
        return ResidualBlock(spec, self.cfg.bn_sync, self.cfg.zero_init_residual)

    def _outer_layouts(self) -> tuple[tuple, tuple]:
        s, c = self.cfg.image_size, self.cfg.channels
        stem = _layout(self._stem(), jax.ShapeDtypeStruct((1, s, s, c), jnp.float32), Parallel())
        h, w, c_last = self._boundary_shape(self.units)
        head = _layout(Head(self.cfg.classes), jax.ShapeDtypeStruct((1, h, w, c_last),
                                                                    jnp.float32))
        return stem, head

    def init_parts(self, rng: jax.Array) -> tuple[Any, list[Any], Any]:
        """(stem params, every residual block's params, head params), independent of units.

        One normal draw covers the whole network, laid out in network order (stem, block 0,
        ..., head), so the values do not depend on how blocks are grouped into units.
        """
        stem_layout, head_layout = self._outer_layouts()
        zero_bn = _last_bn(PRESETS[self.cfg.depth][0]) if self.cfg.zero_init_residual else None
        groups = ([(stem_layout, None)]
                  + [(_block_layout(spec), zero_bn) for spec in self.specs]
                  + [(head_layout, None)])
        rules = [[_initial_value(path, shape, zb) for path, shape in zip(lay[1], lay[2])]
                 for lay, zb in groups]
        n_random = sum(_size(shape) for (lay, _), group in zip(groups, rules)
                       for shape, (kind, _) in zip(lay[2], group) if kind == "normal")
        z = jax.random.normal(rng, (n_random,), jnp.float32)
        trees, offset = [], 0
        for (lay, _), group in zip(groups, rules):
            leaves = []
            for shape, (kind, value) in zip(lay[2], group):
                if kind == "normal":
                    leaves.append(z[offset:offset + _size(shape)].reshape(shape) * value)
                    offset += _size(shape)
                else:
                    leaves.append(jnp.full(shape, value, jnp.float32))
            trees.append(jax.tree.unflatten(lay[0], leaves))
        return trees[0], trees[1:-1], trees[-1]

    def pack_blocks(self, block_params: list[Any]) -> jax.Array:
        """Per-block trees -> (units, P): each unit's blocks raveled in order, zero-padded."""
        rows = []
        for blocks in self._unit_blocks:
            parts = [leaf.reshape(-1) for b in blocks for leaf in jax.tree.leaves(block_params[b])]
            flat = jnp.concatenate(parts)
            rows.append(jnp.pad(flat, (0, self.packed_size - flat.shape[0])))
        return jnp.stack(rows)

    def _unpack_unit(self, u: int, packed_p: jax.Array) -> list[Any]:
        trees, offset = [], 0
        for b in self._unit_blocks[u]:
            treedef, _, shapes = _block_layout(self.specs[b])
            leaves = []
            for shape in shapes:
                leaves.append(packed_p[offset:offset + _size(shape)].reshape(shape))
                offset += _size(shape)
            trees.append(jax.tree.unflatten(treedef, leaves))
        return trees

    def unpack_blocks(self, packed_up: jax.Array) -> list[Any]:
        """(units, P) -> per-block trees; the inverse of `pack_blocks`."""
        return [tree for u in range(self.units) for tree in self._unpack_unit(u, packed_up[u])]

    def convert_params(self, params: Any, source: "ResNetModel") -> Any:
        """`source`'s parameters regrouped into this model's units (same network)."""
        if source.cfg != self.cfg:
            raise ValueError("convert_params: the two models are different networks")
        blocks = source.unpack_blocks(params["blocks"]["packed"])
        return {"embed": params["embed"], "blocks": {"packed": self.pack_blocks(blocks)},
                "head": params["head"]}

    def init(self, rng: jax.Array) -> Any:
        embed, blocks, head = self.init_parts(rng)
        return {"embed": embed, "blocks": {"packed": self.pack_blocks(blocks)}, "head": head}

    def param_axes(self) -> Any:
        # Nothing is split over tp; the packed units stack on 'layers' (split over pp).
        shapes = jax.eval_shape(self.init, jax.random.key(0))
        axes = jax.tree.map(lambda leaf: (None,) * leaf.ndim, shapes)
        axes["blocks"] = {"packed": ("layers", None)}
        return axes

    def num_params(self) -> int:
        """Parameters of the network (without the packing's padding)."""
        shapes = jax.eval_shape(self.init, jax.random.key(0))
        outer = sum(_size(x.shape) for part in ("embed", "head")
                    for x in jax.tree.leaves(shapes[part]))
        return outer + sum(self._unit_size(u) for u in range(self.units))

    # StagedModel ---------------------------------------------------------------------------
    def _check(self, par: Parallel) -> None:
        if par.tp > 1:
            raise ValueError("mesh.tp: ResNet has no tensor-parallel layout; set mesh.tp=1")

    def embed(self, params_embed, images_bhwc, par: Parallel):
        self._check(par)
        y_bhwc = self._stem().apply({"params": params_embed}, images_bhwc, par)
        return _pack_act(y_bhwc, 0, self.act_width)

    def _run_unit(self, u: int, packed_p, x_bn, par: Parallel):
        y_bhwc = _unpack_act(x_bn, self._boundary_shape(u))
        for b, tree in zip(self._unit_blocks[u], self._unpack_unit(u, packed_p)):
            y_bhwc = self._block_module(self.specs[b]).apply({"params": tree}, y_bhwc, par)
        return _pack_act(y_bhwc, u + 1, self.act_width)

    def block(self, params_block, x_bn, par: Parallel):
        """Runs the unit named by the activation's tag (column 0)."""
        self._check(par)
        packed_p = params_block["packed"]
        if self.units == 1:
            return self._run_unit(0, packed_p, x_bn, par)
        # Every row carries the same tag; it is an index, not a value to differentiate.
        tag = jax.lax.stop_gradient(x_bn[0, 0]).astype(jnp.int32)
        branches = [partial(self._run_unit, u, par=par) for u in range(self.units)]
        return jax.lax.switch(tag, branches, packed_p, x_bn)

    def head_loss(self, params_embed, params_head, x_bn, targets_b, par: Parallel):
        del params_embed
        y_bhwc = _unpack_act(x_bn, self._boundary_shape(self.units))
        logits_bk = Head(self.cfg.classes).apply({"params": params_head}, y_bhwc)
        return optax.softmax_cross_entropy_with_integer_labels(logits_bk, targets_b).sum()

    def loss_count(self, targets_b):
        return jnp.asarray(targets_b.shape[0], jnp.float32)

    def logits(self, params, images_bhwc, par: Parallel = Parallel()) -> jax.Array:
        """Class scores on one device (batch-norm statistics of this batch)."""
        x_bn = self.embed(params["embed"], images_bhwc, par)
        x_bn, _ = jax.lax.scan(lambda x, p: (self.block(p, x, par), None), x_bn,
                               params["blocks"])
        y_bhwc = _unpack_act(x_bn, self._boundary_shape(self.units))
        return Head(self.cfg.classes).apply({"params": params["head"]}, y_bhwc)

    # Cost model ----------------------------------------------------------------------------
    def _stem_flops(self) -> float:
        k = 7 if self.cfg.imagenet_stem else 3
        side = -(-self.cfg.image_size // 2) if self.cfg.imagenet_stem else self.cfg.image_size
        return 2.0 * side ** 2 * k * k * self.cfg.channels * self.cfg.width

    def _head_flops(self) -> float:
        return 2.0 * self.specs[-1].c_out * self.cfg.classes

    def forward_flops(self) -> float:
        """Forward FLOPs of one example (2 x conv/fc multiply-accumulates)."""
        return (self._stem_flops() + sum(s.forward_flops() for s in self.specs)
                + self._head_flops())

    def flops_per_example(self) -> float:
        """Training FLOPs (forward + backward = 3 x forward) of one example, for MFU."""
        return 3.0 * self.forward_flops()

    # Data ----------------------------------------------------------------------------------
    def data_stream(self, cfg):
        """The image batches this model trains on (see `models.data_images.image_stream`)."""
        from models.data_images import image_stream

        return image_stream(cfg, self.cfg.image_size, self.cfg.classes, self.cfg.channels)


def units_padding(model: ResNetModel) -> float:
    """Stored / real block parameters: the packing's memory overhead (1.0 = none)."""
    real = sum(model._unit_size(u) for u in range(model.units))
    return model.units * model.packed_size / real


__all__ = ["PRESETS", "ResNetConfig", "BlockSpec", "block_specs", "ResNetModel",
           "BatchNorm", "ResidualBlock", "units_padding"]


def build(cfg, pipeline_units: int = 1):
    """The model `model.kind: resnet` names (registered in pyproject.toml), in the
    `pipeline_units` units the library's `build_model` asks for."""
    return ResNetModel.from_config(cfg, pipeline_units)
