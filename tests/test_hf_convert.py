"""Hugging Face conversion with `safetensors` alone (no torch): tensor names and shapes, exact
round trips (single file, sharded index, bf16), the RoPE permutation, and the CLI's one-line
errors. The comparison against transformers itself is `make test-hf`."""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import last_json_line, rel, run_cli

from jax_overlap import config
from jax_overlap.hf import convert, layouts, safetensors_io
from jax_overlap.model_api import build_model

LLAMA = ["model.kind=llama", "model.heads=4", "model.kv_heads=2", "model.tied_embeddings=false"]
MIXTRAL = [*LLAMA, "model.experts=4", "model.experts_per_token=2", "model.router_aux_loss=0.02"]
MODELS = {"llama": LLAMA, "llama-tied": ["model.kind=llama", "model.tied_embeddings=true"],
          "gpt2": ["model.kind=gpt"], "mixtral": MIXTRAL}


def model_and_params(over):
    cfg = config.load(None, [*over, "model.layers=2", "model.d_model=32", "model.d_ff=64",
                             "model.seq_len=16"])
    model = build_model(cfg)
    return cfg, jax.tree.map(np.asarray, model.init(jax.random.key(0)))


@pytest.mark.parametrize("name", MODELS)
def test_names_shapes_and_exact_round_trip(name):
    cfg, params = model_and_params(MODELS[name])
    tensors = layouts.params_to_hf(cfg.model, params)
    assert {n: a.shape for n, a in tensors.items()} == layouts.expected_shapes(cfg.model)
    if name == "llama":
        assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 8, 32)  # GQA
        assert "lm_head.weight" in tensors
    if name == "llama-tied":
        assert "lm_head.weight" not in tensors
    if name == "gpt2":
        assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    if name == "mixtral":  # router (E, D); expert 3 of layer 1: w1, w3 (F, D), w2 (D, F)
        moe = params["blocks"]["moe"]
        p = "model.layers.1.block_sparse_moe."
        np.testing.assert_array_equal(tensors[p + "gate.weight"], moe["w_router"][1].T)
        np.testing.assert_array_equal(tensors[p + "experts.3.w1.weight"],
                                      moe["w_experts_gate_up"][1, 3, :, 0].T)
        np.testing.assert_array_equal(tensors[p + "experts.3.w3.weight"],
                                      moe["w_experts_gate_up"][1, 3, :, 1].T)
        np.testing.assert_array_equal(tensors[p + "experts.3.w2.weight"],
                                      moe["w_experts_down"][1, 3].T)
        assert len(tensors) == 3 + 2 * (6 + 1 + 3 * 4)  # embed, norm, head; per layer: norms,
        # q k v o, router, 3 per expert
        assert not any("mlp." in n or "moe_stats" in n for n in tensors)
    back = layouts.params_from_hf(cfg.model, tensors)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back),
                                                    jax.tree.leaves(params)))


def test_config_json_round_trips():
    for over in MODELS.values():
        cfg, _ = model_and_params(over + ["model.rope_scaling=llama3"] * (over[0] ==
                                                                           "model.kind=llama"))
        fields = layouts.model_fields_from_hf(layouts.hf_config(cfg.model))
        want = {k: getattr(cfg.model, k) for k in fields}
        if "kv_heads" in want:
            want["kv_heads"] = cfg.model.kv_heads or cfg.model.heads  # 0 means = heads
        assert fields == want


def test_mixtral_config_json_fields():
    cfg, _ = model_and_params(MIXTRAL)
    hf = layouts.hf_config(cfg.model)
    assert hf["architectures"] == ["MixtralForCausalLM"] and hf["model_type"] == "mixtral"
    assert (hf["num_local_experts"], hf["num_experts_per_tok"]) == (4, 2)
    assert hf["router_aux_loss_coef"] == 0.02 and hf["sliding_window"] is None
    fields = layouts.model_fields_from_hf({**hf, "head_dim": None})  # as transformers v5 saves
    assert fields["expert_capacity"] == "dropless" and fields["moe_every"] == 1


@pytest.mark.parametrize("over,message", [
    (["model.moe_every=2"], "export needs moe_every=1 and shared_experts=0"),
    (["model.shared_experts=1"], "export needs moe_every=1 and shared_experts=0")])
def test_mixtral_export_refuses_what_mixtral_cannot_hold(tmp_path, over, message):
    cfg, params = model_and_params([*MIXTRAL, *over])
    with pytest.raises(config.ConfigError, match=message):
        convert.export_params(cfg.model, params, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")  # nothing written


def test_sharded_index_and_bf16_round_trip(tmp_path):
    cfg, params = model_and_params(LLAMA)
    files = convert.export_params(cfg.model, params, str(tmp_path / "s"), "fp32",
                                  shard_bytes=40_000)
    index = json.load(open(tmp_path / "s" / safetensors_io.INDEX))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    assert not os.path.exists(tmp_path / "s" / safetensors_io.SINGLE)
    back = convert.load_hf_params(str(tmp_path / "s"), cfg.model)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back),
                                                    jax.tree.leaves(params)))
    convert.export_params(cfg.model, params, str(tmp_path / "b"), "bf16")
    raw = safetensors_io.read_tensors(str(tmp_path / "b"))
    assert raw["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    assert json.load(open(tmp_path / "b" / "config.json"))["torch_dtype"] == "bfloat16"
    back = convert.load_hf_params(str(tmp_path / "b"), cfg.model)
    want = params["embed"]["wte"].astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(back["embed"]["wte"], want)


def test_rope_permutation_maps_interleaved_pairs_to_halves():
    """Meta's layout rotates pairs (2i, 2i+1); HF's and ours rotate (i, i + hd/2). The
    permuted projection gives, after our rotation, the permuted result of Meta's."""
    heads, hd, d = 2, 8, 6
    rng = np.random.default_rng(0)
    w_meta = rng.normal(size=(heads * hd, d))
    x = rng.normal(size=d)
    theta = rng.uniform(0, 3, size=hd // 2)
    cos, sin = np.cos(theta), np.sin(theta)

    q = (w_meta @ x).reshape(heads, hd // 2, 2)
    meta = np.stack([q[..., 0] * cos - q[..., 1] * sin, q[..., 0] * sin + q[..., 1] * cos], -1)
    meta = meta.reshape(heads, hd)

    q = (layouts.interleaved_to_half(w_meta, heads) @ x).reshape(heads, hd)
    a, b = q[:, : hd // 2], q[:, hd // 2:]
    ours = np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
    perm = layouts.interleaved_to_half(np.eye(hd), 1)  # the same row permutation
    np.testing.assert_allclose(ours, meta @ perm.T, atol=1e-12)
    np.testing.assert_array_equal(
        layouts.half_to_interleaved(layouts.interleaved_to_half(w_meta, heads), heads), w_meta)


def write_hf(tmp_path, name="hf", hf_cfg=None, tensors=None, model=LLAMA):
    """An exported HF checkpoint of `model` (a config path), its config.json and tensors
    edited by `hf_cfg` / `tensors`."""
    cfg, params = model_and_params(model)
    out = tmp_path / name
    convert.export_params(cfg.model, params, str(out))
    if hf_cfg is not None:
        json.dump(hf_cfg(json.load(open(out / "config.json"))), open(out / "config.json", "w"))
    if tensors is not None:
        t = tensors(safetensors_io.read_tensors(str(out)))
        os.remove(out / safetensors_io.SINGLE)
        safetensors_io.write_tensors(str(out), t)
    return str(out)


def bad_arch(c):
    return {**c, "model_type": "bert", "architectures": ["BertForMaskedLM"]}


def drop_k(t):
    return {n: a for n, a in t.items() if "k_proj" not in n}


def wrong_shape(c):
    return {**c, "intermediate_size": 80}


def write_mixtral(tmp_path, hf_cfg=None, tensors=None):
    return write_hf(tmp_path, hf_cfg=hf_cfg, tensors=tensors, model=MIXTRAL)


def sliding(c):
    return {**c, "sliding_window": 8}


def drop_expert(t):
    return {n: a for n, a in t.items() if ".experts.2." not in n}


def more_experts(c):
    return {**c, "num_local_experts": 5}


@pytest.mark.parametrize("edit,message", [
    (dict(hf_cfg=bad_arch), "unknown architecture 'bert'"),
    (dict(tensors=drop_k), "missing tensors model.layers.0.self_attn.k_proj.weight"),
    (dict(hf_cfg=wrong_shape), "tensor model.layers.0.mlp.gate_proj.weight has shape [64, 32]"),
    (dict(hf_cfg=sliding, write=write_mixtral), "sliding_window 8 < max_position_embeddings 16"),
])
def test_bad_hf_input_is_one_line(tmp_path, edit, message):
    write = edit.pop("write", write_hf)
    src = write(tmp_path, **edit)
    proc = run_cli("convert", "--from-hf", src, "--out", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("edit,message", [
    (dict(tensors=drop_expert), "missing tensors model.layers.0.block_sparse_moe.experts.2.w1"),
    (dict(hf_cfg=more_experts), "missing tensors model.layers.0.block_sparse_moe.experts.4.w1"),
    (dict(hf_cfg=wrong_shape), "tensor model.layers.0.block_sparse_moe.experts.0.w1.weight has "
                               "shape [64, 32] but config.json implies [80, 32]")],
    ids=["missing-expert", "experts", "d_ff"])
def test_bad_mixtral_weights_are_one_line(tmp_path, edit, message):
    src = write_mixtral(tmp_path, **edit)
    with pytest.raises(config.ConfigError) as e:
        convert.load_hf_params(src, convert.hf_run_config(src).model)
    assert len(e.value.problems) == 1 and message in e.value.problems[0]


@pytest.mark.slow
def test_convert_evaluate_and_back_through_the_cli(tmp_path):
    """HF dir -> run (step-0 checkpoint) -> evaluate on dp2 x tp2 and from the HF dir on one
    device (same number) -> HF dir again, tensor for tensor identical."""
    src = write_hf(tmp_path)
    data = tmp_path / "text.txt"
    data.write_bytes(open(config.__file__, "rb").read()[:5000])
    run = str(tmp_path / "run")
    proc = run_cli("convert", "--from-hf", src, "--out", run, "--json")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("evaluate", "--run-dir", run, "--data", str(data), "--json",
                   "--set", "mesh.dp=2", "--set", "mesh.tp=2", "--set", "train.global_batch=8")
    assert proc.returncode == 0, proc.stderr
    on_mesh = last_json_line(proc.stdout)
    proc = run_cli("evaluate", "--from-hf", src, "--data", str(data), "--json",
                   "--set", "model.seq_len=16")
    assert proc.returncode == 0, proc.stderr
    direct = last_json_line(proc.stdout)
    assert on_mesh["windows"] == direct["windows"] == 5000 // 17
    assert on_mesh["tokens"] == direct["tokens"] == (5000 // 17) * 16
    assert rel(on_mesh["loss"], direct["loss"]) <= 1e-5
    assert 4.0 < direct["loss"] < 7.0  # a random byte model: about log(256) = 5.5
    assert direct["perplexity"] == pytest.approx(np.exp(direct["loss"]), rel=1e-6)
    proc = run_cli("convert", "--to-hf", run, "--out", str(tmp_path / "back"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert last_json_line(proc.stdout)["step"] == 0
    a = safetensors_io.read_tensors(src)
    b = safetensors_io.read_tensors(str(tmp_path / "back"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert json.load(open(tmp_path / "back" / "config.json")) == json.load(
        open(os.path.join(src, "config.json")))


def test_init_from_hf_starts_training_from_the_hf_weights(tmp_path):
    from helpers import TINY, np_batch

    from jax_overlap.training import grads as gradslib
    from jax_overlap.training import loop as train

    over = [*LLAMA, "model.layers=2", "model.d_model=32", "model.d_ff=64", "model.seq_len=16",
            "mesh.dp=2", "mesh.tp=2", "train.steps=1"]
    cfg, params = model_and_params(LLAMA)
    params = jax.tree.map(lambda a: a * 1.5, params)  # not what a fresh init would give
    convert.export_params(cfg.model, params, str(tmp_path / "hf"))
    run_cfg = config.load(TINY, over + [f"checkpoint.init_from_hf={tmp_path / 'hf'}"])
    result = train.run(run_cfg, str(tmp_path / "run"), progress=False,
                       devices=jax.devices()[:4])
    want = gradslib.reference_loss(build_model(run_cfg), params, np_batch(run_cfg))
    assert rel(result.losses[0], float(want)) <= 1e-5
    with pytest.raises(config.ConfigError) as e:
        config.load(TINY, over + [f"checkpoint.init_from_hf={tmp_path / 'nope'}"])
    assert e.value.problems[0].startswith("checkpoint.init_from_hf:")
