"""Key/value-cache decoding (`models/decoder.py`), sampling (`jax_overlap.training.generate`),
`train.sample_every` and `jax-overlap generate`."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_overlap import config
from jax_overlap.data import tokenizer as toklib
from jax_overlap.model_api import build_model
from jax_overlap.parallel.collectives import Parallel
from jax_overlap.training import generate
from jax_overlap.training.assemble import assemble
from tests.helpers import TINY, last_json_line, run_cli

SHAPE = ["model.layers=2", "model.d_model=32", "model.d_ff=64", "model.seq_len=16",
         "model.vocab=256"]
MODELS = {
    "gpt": ["model.kind=gpt", "model.tied_embeddings=false"],
    "llama-gqa": ["model.kind=llama", "model.heads=4", "model.kv_heads=2",
                  "model.rope_scaling=llama3", "model.rope_original_max_len=4"],
    "llama-mqa": ["model.kind=llama", "model.heads=4", "model.kv_heads=1"],
    # one unit of a dense layer then an MoE layer (the unit caches both layers' kv heads), 4
    # experts top-2, a shared expert, dropless (decoding one token at a time then routes as
    # the full forward does)
    "moe": ["model.kind=llama", "model.heads=4", "model.kv_heads=2", "model.experts=4",
            "model.experts_per_token=2", "model.shared_experts=1", "model.moe_every=2",
            "model.expert_capacity=dropless"],
}


def tiny(kind, mesh=(1, 1)):
    ep = [f"mesh.ep={mesh[0]}"] if kind == "moe" else []  # experts split over the dp ranks
    cfg = config.load(None, [*MODELS[kind], *SHAPE, f"mesh.dp={mesh[0]}", f"mesh.tp={mesh[1]}",
                             *ep])
    model = build_model(cfg)
    # Norm scales away from 1 and biases away from 0, so every parameter is exercised.
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(7), p.shape),
                          model.init(jax.random.key(1)))
    return cfg, model, params


def full_logits(model, params, ids_bt):
    par = Parallel()
    x = model.embed(params["embed"], jnp.asarray(ids_bt), par)
    x = jax.lax.scan(lambda h, p: (model.block(p, h, par), None), x, params["blocks"])[0]
    return model.logits(params["embed"], params["head"], x, par)


def ids(batch=2, t=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (batch, t)).astype(np.int32)


@pytest.mark.parametrize("kind", ["gpt", "llama-gqa", "moe"])
def test_cache_decode_gives_the_full_forward_logits(kind):
    """Prefill 5 tokens, then 2, then one at a time to the end of the context: every
    position's logits equal the full forward's over the same 16 tokens (fp32)."""
    _, model, params = tiny(kind)
    tokens = ids()
    want = np.asarray(full_logits(model, params, tokens))
    decode = jax.jit(lambda p, t, c, pos: model.decode(p, t, c, pos, Parallel()))
    cache = model.init_cache(2, 16)
    got, pos = [], 0
    for n in [5, 2] + [1] * 9:
        logits, cache = decode(params, tokens[:, pos:pos + n], cache, jnp.int32(pos))
        got.append(np.asarray(logits))
        pos += n
    got = np.concatenate(got, axis=1)
    assert got.shape == want.shape
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < 2e-6, err
    # and the cache holds what later tokens read: decoding is not the prefix recomputed
    assert float(jnp.abs(cache["k"][:, :, 15]).max()) > 0


def one_device_plan(cfg, model, devices):
    run = assemble(cfg, devices, model=model)
    return run.mesh, run.plan


def test_greedy_generation_is_the_full_forwards_argmax():
    """The fori_loop over the cache picks, token by token, the argmax of a full forward over
    everything so far (no cache)."""
    cfg, model, params = tiny("llama-gqa")
    mesh, plan = one_device_plan(cfg, model, jax.devices()[:1])
    prompt = ids(batch=2, t=4, seed=1)
    fn = generate.make_generate(model, plan, mesh, 2, 4, 8, temperature=0.0)
    got = np.asarray(fn(params, jnp.asarray(prompt), jax.random.key(0)))
    # One compiled full forward over the whole context: causal, so the zeros after position
    # t do not change position t's logits.
    forward = jax.jit(lambda seq: full_logits(model, params, seq))
    seq = np.zeros((2, 16), np.int32)
    seq[:, :4] = prompt
    for t in range(4, 12):
        seq[:, t] = np.argmax(np.asarray(forward(seq))[:, t - 1], axis=-1)
    assert np.array_equal(got, seq[:, 4:12])


@pytest.mark.parametrize("kind", [pytest.param("gpt", marks=pytest.mark.slow), "llama-mqa",
                                  pytest.param("moe", marks=pytest.mark.slow)])
def test_dp_tp_mesh_generates_what_one_device_does(kind):
    """On dp=2 x tp=2 (llama-mqa: one kv head, replicated over tp) the parameters and the
    cache are sharded; greedy and seeded top-k samples are the single device's."""
    from jax_overlap.pipeline import layout
    from jax_overlap.training import step as steplib

    prompt = ids(batch=4, t=3, seed=2)
    out = {}
    for mesh_shape in [(1, 1), (2, 2)]:
        cfg, model, params = tiny(kind, mesh_shape)
        devices = jax.devices()[:mesh_shape[0] * mesh_shape[1]]
        mesh, plan = one_device_plan(cfg, model, devices)
        placed = jax.device_put(layout.to_staged(params, plan.layer_perm),
                                steplib.param_shardings(model, mesh, plan.layout))
        prompt_bt = generate.place_prompt(prompt, mesh)
        for temperature, top_k in [(0.0, 0), (1.0, 5)]:
            fn = generate.make_generate(model, plan, mesh, 4, 3, 10, temperature, top_k)
            out[mesh_shape, temperature] = np.asarray(fn(placed, prompt_bt, jax.random.key(3)))
        if mesh_shape == (2, 2):
            blocks = placed["blocks"]["moe"] if kind == "moe" else placed["blocks"]
            assert len(blocks["w_o"].sharding.device_set) == 4
    assert np.array_equal(out[(1, 1), 0.0], out[(2, 2), 0.0])
    assert np.array_equal(out[(1, 1), 1.0], out[(2, 2), 1.0])
    assert not np.array_equal(out[(1, 1), 0.0], out[(1, 1), 1.0])


def test_sample_next_greedy_top_k_and_padded_vocabulary():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0, 9.0], [5.0, 1.0, 4.0, 0.0, 9.0]])
    key = jax.random.key(0)
    # id 4 is padding (the tokenizer has 4 tokens): never chosen, whatever its logit
    assert generate.sample_next(logits, key, 0.0, 0, 4).tolist() == [1, 0]
    assert generate.sample_next(logits, key, 1.0, 1, 4).tolist() == [1, 0]  # top-1 = greedy
    draws = np.stack([np.asarray(generate.sample_next(logits, jax.random.key(s), 1.0, 2, 4))
                      for s in range(200)])
    assert set(draws[:, 0]) == {1, 3} and set(draws[:, 1]) == {0, 2}  # only the top 2
    # temperature: low follows the argmax, high spreads over the vocabulary
    cold = [int(generate.sample_next(logits, jax.random.key(s), 0.05, 0, 4)[0])
            for s in range(50)]
    hot = {int(generate.sample_next(logits, jax.random.key(s), 100.0, 0, 4)[0])
           for s in range(200)}
    assert set(cold) == {1} and hot == {0, 1, 2, 3}


def test_run_tokenizer_is_the_runs_own(tmp_path):
    """The run dir's tokenizer.json first, then data.tokenizer, then the shards', then bytes;
    decode gives the text back."""
    from jax_overlap.data import prepare

    text_file = tmp_path / "code.py"
    text_file.write_text("def f(x):\n    return x + 1\n" * 400)
    shards = tmp_path / "shards"
    prepare.prepare([str(text_file)], str(shards), train_vocab=300, val_fraction=0.1,
                    progress=False)
    bpe = toklib.load(str(shards / toklib.TOKENIZER_FILE))
    cfg = config.load(TINY, [])
    assert generate.run_tokenizer(cfg, str(tmp_path)).name == toklib.BYTES
    tokens_cfg = config.from_dict(config.apply_overrides(
        cfg.to_dict(), ["data.source=tokens", f"data.path={shards}", "model.vocab=auto"]))
    tok = generate.run_tokenizer(tokens_cfg, str(tmp_path / "run"))
    assert tok.sha256 == bpe.sha256 and tok.vocab_size == bpe.vocab_size > 256
    text = "def g(x):\n    return x"
    assert len(tok.encode(text.encode())) < len(text)
    assert tok.decode(tok.encode(text.encode())) == text
    run = tmp_path / "run"
    run.mkdir()
    (run / toklib.TOKENIZER_FILE).write_bytes((shards / toklib.TOKENIZER_FILE).read_bytes())
    assert generate.run_tokenizer(cfg, str(run)).sha256 == bpe.sha256  # the run's copy
    assert toklib.byte_tokenizer().decode([104, 105, 300]) == "hi"


def test_samples_go_to_tensorboards_text_tab(tmp_path):
    """The sampler's record (continuations of the prompt, filling the context when
    sample_tokens does not fit) as the loop writes it, read back from the event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jax_overlap.training import events, sample_hook

    cfg = config.load(TINY, ["mesh.dp=1", "mesh.tp=2", "train.sample_every=2",
                             "train.sample_prompt=import", "train.sample_tokens=100"])
    model = build_model(cfg)
    mesh, plan = one_device_plan(cfg, model, jax.devices()[:2])
    sampler = sample_hook.from_config(cfg, model, plan, mesh)
    assert sampler.tokens == 16 - len("import") and not sampler.due(3) and sampler.due(4)
    params = model.init(jax.random.key(0))
    record = {"event": "sample", "step": 4, **sampler.run(params, 4)}
    assert record["prompt"] == "import" and len(record["samples"]) == sample_hook.SAMPLES
    assert all(s.startswith("import") for s in record["samples"])
    assert len(set(record["samples"])) > 1  # drawn, not greedy
    assert sampler.run(params, 4) == {k: record[k] for k in ("prompt", "samples")}
    writer = events.EventWriter(str(tmp_path))
    writer.write(record)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith("samples")]
    (event,) = acc.Tensors(tag)
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 4 and text.count("```") == 2 * sample_hook.SAMPLES
    assert all(s in text for s in record["samples"])


def test_sample_every_refuses_a_model_that_cannot_decode():
    from jax_overlap.config import ConfigError
    from jax_overlap.training import sample_hook

    cfg = config.load("configs/bert_tiny.yaml", ["train.sample_every=5"])
    with pytest.raises(ConfigError, match="train.sample_every"):
        sample_hook.from_config(cfg, build_model(cfg), None, None)
    cfg = config.load(TINY, ["train.sample_every=5", "train.sample_prompt=" + "x" * 16])
    with pytest.raises(ConfigError, match="train.sample_prompt"):
        sample_hook.from_config(cfg, build_model(cfg), None, None)


def test_generate_cli_from_an_exported_model(tmp_path):
    """`generate --from-hf` on a Hugging Face directory: the greedy tokens are the ones
    computed here from the same weights."""
    from jax_overlap.hf import convert

    cfg, model, params = tiny("llama-gqa")
    convert.export_params(cfg.model, jax.tree.map(np.asarray, params), str(tmp_path))
    proc = run_cli("generate", "--from-hf", str(tmp_path), "--prompt", "hello",
                   "--max-new-tokens", "5", "--temperature", "0", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json_line(proc.stdout)
    mesh, plan = one_device_plan(cfg, model, jax.devices()[:1])
    prompt = np.frombuffer(b"hello", np.uint8).astype(np.int32)[None]
    want = generate.make_generate(model, plan, mesh, 1, 5, 5)(params, prompt, jax.random.key(0))
    assert out["prompt_tokens"] == prompt[0].tolist()
    assert out["new_tokens"] == np.asarray(want)[0].tolist()
    assert out["text"].startswith("hello") and out["from_hf"] == str(tmp_path)


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    """A pipelined (pp=2 x tp=2) tiny run with a checkpoint and samples every 2 steps."""
    run = str(tmp_path_factory.mktemp("gen") / "run")
    proc = run_cli("train", "--config", TINY, "--run-dir", run, "--no-progress",
                   "--set", "mesh.dp=1", "--set", "mesh.pp=2", "--set", "mesh.tp=2",
                   "--set", "train.steps=2", "--set", "checkpoint.every_steps=2",
                   "--set", "train.sample_every=2", "--set", "data.source=synthetic")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.slow
def test_generate_cli_on_a_pipelined_run(pp_run):
    """A pp=2 run samples while it trains and decodes on pp=1 (its dp x tp) afterwards;
    greedy tokens do not depend on the mesh, a seed repeats its sample."""
    from jax_overlap.training import sample_hook

    records = [json.loads(line) for line in open(os.path.join(pp_run, "metrics.jsonl"))]
    (sample,) = [r for r in records if r.get("event") == "sample"]
    assert sample["step"] == 2 and sample["prompt"] == sample_hook.DEFAULT_PROMPT
    assert len(sample["samples"]) == sample_hook.SAMPLES
    base = ["generate", "--run-dir", pp_run, "--prompt", "ab", "--max-new-tokens", "6", "--json"]
    greedy = run_cli(*base, "--temperature", "0")
    assert greedy.returncode == 0, greedy.stderr[-3000:]
    out = last_json_line(greedy.stdout)
    assert out["mesh"] == {"dp": 1, "pp": 1, "tp": 2} and out["step"] == 2
    assert out["prompt_tokens"] == [97, 98] and len(out["new_tokens"]) == 6
    assert out["text"].startswith("ab") and out["tokenizer"] == "bytes"
    one = run_cli(*base, "--temperature", "0", "--set", "mesh.tp=1")
    assert last_json_line(one.stdout)["new_tokens"] == out["new_tokens"]
    plain = run_cli(*base[:-1], "--top-k", "3", "--seed", "5")
    assert plain.returncode == 0 and plain.stdout.startswith("ab")
