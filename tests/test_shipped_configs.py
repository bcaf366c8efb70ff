"""Every shipped config loads and its parallel plan builds for its device count, without a
device or a compile: the GPU recipes (configs/gpu/) for 8 H100s (16 for the two-host ones),
with the plan's `auto` choices fitting the GPU's memory."""

from __future__ import annotations

import glob
import os

import pytest

from jax_overlap import config
from jax_overlap.analysis.analyze import build_plan
from jax_overlap.plan import fits_memory
from tests.helpers import REPO

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
GPU_RECIPES = sorted(glob.glob(os.path.join(REPO, "configs", "gpu", "*.yaml")))
# Real sizes at the top level of configs/: planned for a GPU like the recipes.
REAL_SIZES = {"gpt_1p3b.yaml", "llama3_8b.yaml", "bert_large.yaml"}
# Every shape the README's "Train on GPUs" lists, for both models.
SHAPES = {"dp8": (8, 1, 1, 1), "dp2_tp4": (2, 1, 4, 1), "pp4_dp2": (2, 4, 1, 1),
          "pp2_dp2_tp2": (2, 2, 2, 1), "fsdp8": (8, 1, 1, 1), "2hosts": (8, 1, 1, 2)}


def _name(path: str) -> str:
    return os.path.relpath(path, REPO)


@pytest.mark.parametrize("path", CONFIGS, ids=_name)
def test_config_loads_and_plans(path):
    cfg = config.load(path)
    target = "h100" if os.path.basename(path) in REAL_SIZES else "cpu"
    plan = build_plan(cfg, target).plan
    assert plan.num_devices == cfg.num_devices
    assert plan.microbatches * plan.micro_batch * plan.dp * plan.dcn == cfg.train.global_batch


@pytest.mark.parametrize("path", GPU_RECIPES, ids=_name)
def test_gpu_recipe_plans_for_its_gpus(path):
    stem = os.path.basename(path)[:-len(".yaml")]
    shape = next(s for s in SHAPES if stem.endswith("_" + s))
    cfg = config.load(path)
    plan = build_plan(cfg, "h100").plan
    dp, pp, tp, dcn = SHAPES[shape]
    assert (plan.dp, plan.pp, plan.tp, plan.dcn) == (dp, pp, tp, dcn)
    assert plan.num_devices == (16 if shape == "2hosts" else 8)
    assert cfg.train.precision == "bf16"
    assert cfg.checkpoint.every_steps > 0 and cfg.checkpoint.async_save  # resumable
    assert fits_memory(plan.memory_estimate, plan.target), (
        f"{_name(path)}: estimated {plan.memory_estimate / 1e9:.1f} GB per GPU does not fit")
    if shape == "fsdp8":
        assert plan.overlap.fsdp
    if pp > 1:
        assert plan.pipelined and plan.choices["pipeline.paired"].value is True


def test_every_shape_is_shipped_for_both_models():
    stems = {os.path.basename(p)[:-len(".yaml")] for p in GPU_RECIPES}
    for model in ("gpt_1p3b", "llama3_8b"):
        for shape in SHAPES:
            if (model, shape) == ("llama3_8b", "dp8"):
                continue  # a replica does not fit: its dp8 recipe is llama3_8b_fsdp8
            assert f"{model}_{shape}" in stems, f"configs/gpu/{model}_{shape}.yaml missing"


def test_readme_lists_every_gpu_recipe():
    readme = open(os.path.join(REPO, "README.md")).read()
    for path in GPU_RECIPES:
        assert _name(path) in readme, f"README's 'Train on GPUs' does not list {_name(path)}"
