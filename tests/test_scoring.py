"""`jax-overlap evaluate`'s logic: windows of seq_len + 1 tokens (last partial dropped), and the
mean next-token loss over all of them is the single-device number on any mesh."""

import jax
import numpy as np
import pytest
from helpers import TINY, rel

from jax_overlap import config
from jax_overlap.config import ConfigError
from jax_overlap.model_api import build_model
from jax_overlap.training.assemble import assemble
from jax_overlap.training import grads as gradslib
from jax_overlap.training import scoring


def test_windows_do_not_overlap_and_drop_the_partial_one():
    w = scoring.windows(np.arange(23), seq_len=4)
    assert w.shape == (4, 5) and w[1, 0] == 5 and w[-1, -1] == 19


def test_mean_loss_is_the_same_on_a_mesh_and_on_one_device(tmp_path):
    over = ["model.kind=llama", "model.kv_heads=2", "train.global_batch=4",
            "pipeline.microbatches=1"]
    tokens = np.frombuffer(open(config.__file__, "rb").read()[:3000], np.uint8).astype(np.int32)
    cfg1 = config.load(TINY, over + ["mesh.dp=1", "mesh.tp=1"])
    model1 = build_model(cfg1)
    params = model1.init(jax.random.key(0))
    w = scoring.windows(tokens, cfg1.model.seq_len)  # 176 windows: batches of 4, none partial
    batch = {"inputs": w[:, :-1], "targets": w[:, 1:]}
    want = float(gradslib.reference_loss(model1, params, batch))
    for dp, tp in [(1, 1), (2, 2)]:
        cfg = config.load(TINY, over + [f"mesh.dp={dp}", f"mesh.tp={tp}",
                                        "train.global_batch=6"])  # 176 = 29 x 6 + 2
        run = assemble(cfg, jax.devices()[: dp * tp])
        model, plan, mesh = run.model, run.plan, run.mesh
        placed = run.place_params(params)
        out = scoring.evaluate(cfg, placed, model, plan, mesh, w, cfg.train.global_batch)
        assert out["windows"] == len(w) and out["tokens"] == w[:, 1:].size
        assert rel(out["loss"], want) <= 1e-5, (dp, tp, out, want)
    with pytest.raises(ConfigError, match="than one window"):
        scoring.evaluate(cfg, placed, model, plan, mesh, scoring.windows(tokens[:10], 64), 6)
