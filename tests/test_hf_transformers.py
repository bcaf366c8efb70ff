"""Against transformers (`make test-hf`; needs the `[hf]` extra: torch, transformers).

Tiny random `LlamaForCausalLM` (grouped-query attention, Llama-3.1 RoPE scaling),
`MixtralForCausalLM` (4 experts, top-2) and `GPT2LMHeadModel` are built here, no download. Import: HF weights -> jax_overlap, logits
compared in fp32. Export: jax_overlap weights -> `from_pretrained`, logits compared. Config:
written config.json -> transformers -> read back gives the same model fields. Generate:
greedy `jax-overlap generate` on a `convert --to-hf` export = transformers' `generate`.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_overlap import config
from jax_overlap.hf import convert, layouts
from jax_overlap.model_api import build_model
from jax_overlap.training import hf_runs
from jax_overlap.parallel.collectives import Parallel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf
TOL = 1e-5


def llama_hf(tied=False):
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1 so the scale parameters are tested too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def mixtral_hf():
    """4 experts, top-2, grouped-query attention; the router spread out so that its top-2
    choices are not near ties (a near tie could flip between fp32 implementations)."""
    cfg = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("gate.weight"):
                p.mul_(20.0)
    return model.eval()


def gpt2_hf():
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                                  n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def our_logits(model, params, ids):
    par = Parallel()
    x = model.embed(params["embed"], jnp.asarray(ids), par)
    x = jax.lax.scan(lambda h, p: (model.block(p, h, par), None), x, params["blocks"])[0]
    return np.asarray(model.logits(params["embed"], params["head"], x, par))


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def ids(seq_len=32, batch=2):
    return np.random.default_rng(0).integers(0, 256, (batch, seq_len)).astype(np.int32)


@pytest.mark.parametrize("make", [llama_hf, lambda: llama_hf(tied=True), gpt2_hf, mixtral_hf],
                         ids=["llama-gqa", "llama-tied", "gpt2", "mixtral"])
def test_import_matches_transformers_logits(tmp_path, make):
    hf_model = make()
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    cfg = convert.hf_run_config(str(tmp_path / "hf"))
    model = build_model(cfg)
    params = convert.load_hf_params(str(tmp_path / "hf"), cfg.model)
    err = rel_err(our_logits(model, params, ids()), hf_logits(hf_model, ids()))
    print(f"import {cfg.model.kind}: logits rel err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("over", [
    ["model.kind=llama", "model.heads=8", "model.kv_heads=2", "model.d_model=64",
     "model.rope_scaling=llama3", "model.rope_original_max_len=8", "model.rope_theta=5e5"],
    ["model.kind=gpt", "model.d_model=64"],
    ["model.kind=llama", "model.heads=8", "model.kv_heads=2", "model.d_model=64",
     "model.experts=4", "model.experts_per_token=2"]], ids=["llama-gqa", "gpt2", "mixtral"])
@pytest.mark.parametrize("shard_mb", [0.0, 0.05])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, over, shard_mb):
    cfg = config.load(None, [*over, "model.layers=2", "model.seq_len=32", "model.d_ff=96",
                             "model.vocab=256"])
    model = build_model(cfg)
    params = jax.tree.map(np.array, model.init(jax.random.key(1)))
    if cfg.model.experts:  # a router far from uniform: no near-tied top-2 choices
        params["blocks"]["moe"]["w_router"] *= 20.0
    out = tmp_path / "export"
    files = convert.export_params(cfg.model, params, str(out), "fp32", int(shard_mb * 2**20))
    assert (len(files) > 1) == (shard_mb > 0)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    err = rel_err(hf_logits(hf_model, ids()), our_logits(model, params, ids()))
    print(f"export {cfg.model.kind} shard_mb={shard_mb}: logits rel err {err:.2e}")
    assert err <= TOL
    # config.json round-trips through transformers: the same model fields come back.
    reread = json.loads(hf_model.config.to_json_string())
    assert layouts.model_fields_from_hf(reread) == layouts.model_fields_from_hf(
        json.load(open(out / "config.json")))
    assert build_model(convert.hf_run_config(str(out))) == model


# ---------------------------------------------------------------------------------------------
# The tokenized round trip (issue 28): prepare-data BPE -> train a Llama -> evaluate ->
# convert --to-hf -> transformers loads the tokenizer and the model and scores the same text.

from test_tokenized_run import first_devices, text_file, trained  # noqa: E402,F401


def test_exported_tokenizer_and_model_score_like_evaluate(trained, tmp_path):  # noqa: F811
    from jax_overlap.data import tokenizer as toklib
    from jax_overlap.training import scoring

    data = text_file(tmp_path)
    text = open(data, "rb").read()
    ours = scoring.evaluate_command(trained["run"], None, data)
    export = str(tmp_path / "export")
    hf_runs.to_hf(trained["run"], export)

    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    ids = hf_tok(text.decode())["input_ids"]
    want = toklib.load(f"{trained['run']}/tokenizer.json").encode(text)
    assert ids == want.tolist()
    assert hf_tok.model_max_length == 16

    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    windows = scoring.windows(np.asarray(ids), 16)
    assert len(windows) == ours["windows"]
    with torch.no_grad():
        logits = model(torch.tensor(windows[:, :-1])).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.tensor(windows[:, 1:]).reshape(-1))
    assert abs(float(loss) - ours["loss"]) / ours["loss"] <= 1e-4
    gen = transformers.GenerationConfig.from_pretrained(export)
    assert gen.max_length == 16


def test_a_byte_level_export_tokenizes_bytes(tmp_path):
    from jax_overlap.data import tokenizer as toklib
    from jax_overlap.hf import tokenizer_files

    tokenizer_files.write_export(str(tmp_path), toklib.byte_tokenizer(), 64)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "héllo wörld\n\ttabs € 日本"
    assert hf_tok(text)["input_ids"] == list(text.encode())
    assert hf_tok.decode(list(text.encode())) == text


GEN_MODELS = {
    "llama-gqa": ["model.kind=llama", "model.heads=4", "model.kv_heads=2",
                  "model.tied_embeddings=false"],
    "gpt2": ["model.kind=gpt"],
    "mixtral": ["model.kind=llama", "model.heads=4", "model.kv_heads=2",
                "model.tied_embeddings=false", "model.experts=4", "model.experts_per_token=2"],
}


@pytest.fixture(scope="module", params=list(GEN_MODELS))
def exported(request, tmp_path_factory):
    """A tiny model with weights far from their init (so greedy decoding wanders over the
    vocabulary), through `convert --from-hf` into a run and `convert --to-hf` out of it."""
    from tests.helpers import run_cli

    root = tmp_path_factory.mktemp(f"gen-{request.param}")
    cfg = config.load(None, [*GEN_MODELS[request.param], "model.layers=2", "model.d_model=64",
                             "model.d_ff=96", "model.seq_len=32", "model.vocab=256"])
    model = build_model(cfg)
    leaves, tree = jax.tree.flatten(model.init(jax.random.key(2)))
    keys = jax.random.split(jax.random.key(5), len(leaves))
    params = tree.unflatten([np.asarray(p + 0.3 * jax.random.normal(k, p.shape))
                             for p, k in zip(leaves, keys)])
    convert.export_params(cfg.model, params, str(root / "src"))
    run, out = str(root / "run"), str(root / "hf")
    for argv in (["--from-hf", str(root / "src"), "--out", run], ["--to-hf", run, "--out", out]):
        proc = run_cli("convert", *argv, "--set", "mesh.dp=1", "--set", "mesh.tp=1")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_greedy_generate_matches_transformers(exported):
    """`jax-overlap generate --temperature 0` on an exported model gives, token for token,
    transformers' `generate(do_sample=False)` from the same directory."""
    from tests.helpers import last_json_line, run_cli

    prompt, new = "def fo", 12
    proc = run_cli("generate", "--from-hf", exported, "--prompt", prompt, "--temperature", "0",
                   "--max-new-tokens", str(new), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = last_json_line(proc.stdout)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    ids = torch.tensor([ours["prompt_tokens"]])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    theirs = out[0, ids.shape[1]:].tolist()
    print(f"generate {exported}: ours {ours['new_tokens']} transformers {theirs}")
    assert ours["prompt_tokens"] == list(prompt.encode())
    assert ours["new_tokens"] == theirs
    assert len(set(theirs)) > 3  # a model that says something, not one token over and over
