"""Hugging Face <-> jax_overlap layouts for Llama (`LlamaForCausalLM`), Mixtral
(`MixtralForCausalLM`: our Llama with `model.experts` > 0, every layer MoE, no shared expert)
and GPT-2 (`GPT2LMHeadModel`): config.json fields and every tensor's name, shape and transpose.

Pure numpy; knows the parameter trees of `models/llama.py`, `models/moe.py` and `models/gpt.py`
by name only (the library never imports `models`).

Mixtral: the router `block_sparse_moe.gate` (E, D) is our `w_router` (D, E); expert j's
`w1` (gate) and `w3` (up), (F, D) each, are `w_experts_gate_up[j, :, 0 | 1, :]`, its `w2`
(D, F) is `w_experts_down[j]`. HF routes dropless with the same softmax, top-k and
renormalised gates as `models/moe.route`; our `moe_stats` leaf (statistics, always 0) has no
HF tensor and is zeros on the way in.

RoPE: `models/llama.py` rotates the two halves of each head (HF's `rotate_half`), the layout
HF's q_proj/k_proj rows already have, so q and k need no permutation here. (Meta's original
checkpoints interleave pairs instead; HF's own conversion script permutes them on the way in.
`interleaved_to_half` is that permutation, for completeness and the tests.)
"""

from __future__ import annotations

import numpy as np

from jax_overlap.config import ConfigError
from jax_overlap.model_api import MOE_STATS, moe_stats_len

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                 "gpt2": "GPT2LMHeadModel"}
KIND_OF_MODEL_TYPE = {"llama": "llama", "mixtral": "llama", "gpt2": "gpt"}
# Buffers some writers include that carry no parameters.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def _fail(flag: str, where: str, what: str) -> ConfigError:
    return ConfigError([f"{flag} {where}: {what}"])


def model_type_of(hf: dict, flag: str, where: str) -> str:
    model_type = hf.get("model_type", "")
    archs = hf.get("architectures") or []
    if model_type not in KIND_OF_MODEL_TYPE:
        known = ", ".join(f"{t} ({a})" for t, a in ARCHITECTURES.items())
        raise _fail(flag, where, f"unknown architecture {model_type or archs or '?'!r}; "
                                 f"supported: {known}")
    return model_type


def _rope_parameters(hf: dict) -> dict:
    """transformers v5 `rope_parameters`, or the v4 `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    return params


def model_fields_from_hf(hf: dict, flag: str = "--from-hf", where: str = "") -> dict:
    """`model.*` config values for an HF config.json (raises one line when unsupported)."""
    model_type = model_type_of(hf, flag, where)
    if model_type == "gpt2":
        d = hf["n_embd"]
        eps = hf.get("layer_norm_epsilon", 1e-5)
        if abs(eps - 1e-5) > 1e-12 or hf.get("activation_function", "gelu_new") != "gelu_new":
            raise _fail(flag, where, "GPT-2 with layer_norm_epsilon != 1e-5 or an activation "
                                     "other than gelu_new is not supported")
        if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
            raise _fail(flag, where, "GPT-2 attention scaling other than 1/sqrt(head_dim) is "
                                     "not supported")
        return {"kind": "gpt", "layers": hf["n_layer"], "d_model": d, "heads": hf["n_head"],
                "d_ff": hf.get("n_inner") or 4 * d, "vocab": hf["vocab_size"],
                "seq_len": hf["n_positions"],
                "tied_embeddings": bool(hf.get("tie_word_embeddings", True))}
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if (hf.get("head_dim") or d // heads) != d // heads:
        raise _fail(flag, where, f"head_dim {hf['head_dim']} != hidden_size / "
                                 f"num_attention_heads = {d // heads} is not supported")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise _fail(flag, where, f"{model_type} with biases or an activation other than silu "
                                 f"is not supported")
    rope = _rope_parameters(hf)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise _fail(flag, where, f"rope type {rope_type!r} is not supported (default, llama3)")
    fields = {"kind": "llama", "layers": hf["num_hidden_layers"], "d_model": d, "heads": heads,
              "kv_heads": hf.get("num_key_value_heads") or heads,
              "d_ff": hf["intermediate_size"], "vocab": hf["vocab_size"],
              "seq_len": hf["max_position_embeddings"],
              "tied_embeddings": bool(hf.get("tie_word_embeddings", False)),
              "rope_theta": float(rope.get("rope_theta", 10000.0)),
              "norm_eps": float(hf.get("rms_norm_eps", 1e-6))}
    if rope_type == "llama3":
        fields.update(rope_scaling="llama3", rope_factor=float(rope["factor"]),
                      rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_len=int(rope["original_max_position_embeddings"]))
    if model_type == "mixtral":
        fields.update(_mixtral_fields(hf, flag, where))
    return fields


def _mixtral_fields(hf: dict, flag: str, where: str) -> dict:
    """The MoE keys of a Mixtral config.json: every layer MoE, dropless, no shared expert."""
    window = hf.get("sliding_window")
    if window and window < hf["max_position_embeddings"]:
        raise _fail(flag, where, f"sliding_window {window} < max_position_embeddings "
                                 f"{hf['max_position_embeddings']}: sliding-window attention is "
                                 f"not supported; set sliding_window to null")
    return {"experts": int(hf["num_local_experts"]),
            "experts_per_token": int(hf["num_experts_per_tok"]),
            "expert_capacity": "dropless", "shared_experts": 0, "moe_every": 1,
            "router_aux_loss": float(hf.get("router_aux_loss_coef", 0.001))}


def hf_config(m, dtype: str = "float32") -> dict:
    """config.json for a jax_overlap `ModelConfig` `m` (kind llama or gpt)."""
    if m.kind == "gpt":
        return {"architectures": [ARCHITECTURES["gpt2"]], "model_type": "gpt2",
                "n_embd": m.d_model, "n_layer": m.layers, "n_head": m.heads,
                "n_inner": m.d_ff, "vocab_size": m.vocab, "n_positions": m.seq_len,
                "n_ctx": m.seq_len, "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5, "tie_word_embeddings": bool(m.tied_embeddings),
                "scale_attn_weights": True, "torch_dtype": dtype, "dtype": dtype}
    if m.kind != "llama":
        raise ValueError(f"model.kind: {m.kind!r} has no Hugging Face layout; llama or gpt")
    if m.experts and (m.moe_every != 1 or m.shared_experts):
        raise ConfigError([f"model.moe_every={m.moe_every}, model.shared_experts="
                           f"{m.shared_experts}: Mixtral (the Hugging Face MoE layout) has "
                           f"every layer MoE and no shared expert; export needs moe_every=1 and "
                           f"shared_experts=0"])
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=m.rope_factor,
                    low_freq_factor=m.rope_low_freq_factor,
                    high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_max_len)
    model_type = "mixtral" if m.experts else "llama"
    out = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
           "hidden_size": m.d_model, "num_hidden_layers": m.layers,
           "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads or m.heads,
           "head_dim": m.d_model // m.heads, "intermediate_size": m.d_ff,
           "vocab_size": m.vocab, "max_position_embeddings": m.seq_len,
           "rms_norm_eps": m.norm_eps, "hidden_act": "silu", "attention_bias": False,
           "mlp_bias": False, "tie_word_embeddings": bool(m.tied_embeddings),
           "rope_theta": m.rope_theta, "rope_parameters": rope, "torch_dtype": dtype,
           "dtype": dtype}
    if m.experts:
        out.update(num_local_experts=m.experts, num_experts_per_tok=m.experts_per_token,
                   router_aux_loss_coef=m.router_aux_loss, router_jitter_noise=0.0,
                   sliding_window=None, output_router_logits=False)
        del out["mlp_bias"]
    return out


# ---------------------------------------------------------------------------------------------
# Tensors. Each layout is a list of (HF name with {i} for the layer and {j} for the expert,
# our path, HF shape); the layer entries are stacked along our leading 'layers' axis, the
# expert entries along the axis after it. A path ending in an int is one half of a pair our
# tree stacks on `PAIR_AXIS[name]` (counted with the layer axis): k/v, gate/up.

PAIR_AXIS = {"w_kv": 3, "w_gate_up": 2, "w_experts_gate_up": 3}


def _llama_entries(m):
    d, h, f, v = m.d_model, m.heads, m.d_ff, m.vocab
    kv, hd = m.kv_heads or m.heads, m.d_model // m.heads
    p = "model.layers.{i}."
    blk = ("blocks", "moe") if m.experts else ("blocks",)
    out = [("model.embed_tokens.weight", ("embed", "wte"), (v, d)),
           ("model.norm.weight", ("head", "norm", "scale"), (d,)),
           (p + "input_layernorm.weight", (*blk, "attn_norm", "scale"), (d,)),
           (p + "post_attention_layernorm.weight", (*blk, "mlp_norm", "scale"), (d,)),
           (p + "self_attn.q_proj.weight", (*blk, "w_q"), (h * hd, d)),
           (p + "self_attn.k_proj.weight", (*blk, "w_kv", 0), (kv * hd, d)),
           (p + "self_attn.v_proj.weight", (*blk, "w_kv", 1), (kv * hd, d)),
           (p + "self_attn.o_proj.weight", (*blk, "w_o"), (d, h * hd))]
    if m.experts:
        x = p + "block_sparse_moe."
        out += [(x + "gate.weight", (*blk, "w_router"), (m.experts, d)),
                (x + "experts.{j}.w1.weight", (*blk, "w_experts_gate_up", 0), (f, d)),
                (x + "experts.{j}.w3.weight", (*blk, "w_experts_gate_up", 1), (f, d)),
                (x + "experts.{j}.w2.weight", (*blk, "w_experts_down"), (d, f))]
    else:
        out += [(p + "mlp.gate_proj.weight", ("blocks", "w_gate_up", 0), (f, d)),
                (p + "mlp.up_proj.weight", ("blocks", "w_gate_up", 1), (f, d)),
                (p + "mlp.down_proj.weight", ("blocks", "w_down"), (d, f))]
    if not m.tied_embeddings:
        out.append(("lm_head.weight", ("head", "w_out"), (v, d)))
    return out


def _gpt2_entries(m):
    d, f, v, t = m.d_model, m.d_ff, m.vocab, m.seq_len
    p = "transformer.h.{i}."
    out = [("transformer.wte.weight", ("embed", "wte"), (v, d)),
           ("transformer.wpe.weight", ("embed", "wpe"), (t, d)),
           ("transformer.ln_f.weight", ("head", "ln_f", "scale"), (d,)),
           ("transformer.ln_f.bias", ("head", "ln_f", "bias"), (d,))]
    for hf_ln, ours in (("ln_1", "ln_attn"), ("ln_2", "ln_mlp")):
        out += [(p + f"{hf_ln}.weight", ("blocks", ours, "scale"), (d,)),
                (p + f"{hf_ln}.bias", ("blocks", ours, "bias"), (d,))]
    out += [(p + "attn.c_attn.weight", ("blocks", "w_qkv"), (d, 3 * d)),
            (p + "attn.c_attn.bias", ("blocks", "b_qkv"), (3 * d,)),
            (p + "attn.c_proj.weight", ("blocks", "w_o"), (d, d)),
            (p + "attn.c_proj.bias", ("blocks", "b_o"), (d,)),
            (p + "mlp.c_fc.weight", ("blocks", "w_in"), (d, f)),
            (p + "mlp.c_fc.bias", ("blocks", "b_in"), (f,)),
            (p + "mlp.c_proj.weight", ("blocks", "w_out"), (f, d)),
            (p + "mlp.c_proj.bias", ("blocks", "b_out"), (d,))]
    if not m.tied_embeddings:
        out.append(("lm_head.weight", ("head", "w_out"), (v, d)))
    return out


def entries(m):
    """(HF name pattern, our path, HF shape) for every tensor of model config `m`."""
    return _llama_entries(m) if m.kind == "llama" else _gpt2_entries(m)


def _layers(m, name):
    return range(m.layers) if "{i}" in name else [None]


def _experts(m, name):
    return range(m.experts) if "{j}" in name else [None]


def expected_shapes(m) -> dict[str, tuple]:
    """Every HF tensor name of model config `m` with its shape."""
    out = {}
    for name, _, shape in entries(m):
        for i in _layers(m, name):
            for j in _experts(m, name):
                out[name.format(i=i, j=j)] = tuple(shape)
    return out


def _key(path) -> str:
    """The leaf's own name: the last string of its path ('w_kv' for ('blocks', 'w_kv', 0))."""
    return [k for k in path if isinstance(k, str)][-1]


TRANSPOSED = ("w_gate_up", "w_down", "w_out", "w_router", "w_experts_gate_up", "w_experts_down")


def _hf_to_ours(m, path, a: np.ndarray) -> np.ndarray:
    """One HF tensor (one layer, one expert) -> our array (without the layer/expert axes)."""
    d, h, hd = m.d_model, m.heads, m.d_model // m.heads
    key = _key(path)
    if m.kind == "llama":
        if key == "w_q":
            return a.T.reshape(d, h, hd)
        if key == "w_kv":
            return a.T.reshape(d, -1, hd)  # (D, KV, hd), stacked over k/v by the caller
        if key == "w_o":
            return a.T.reshape(h, hd, d)
        if key in TRANSPOSED:
            return a.T
        return a
    if key == "w_qkv":  # (D, 3D) [q heads | k heads | v heads] -> (D, H, 3 hd)
        return a.reshape(d, 3, h, hd).transpose(0, 2, 1, 3).reshape(d, h, 3 * hd)
    if key == "b_qkv":
        return a.reshape(3, h, hd).transpose(1, 0, 2).reshape(h, 3 * hd)
    if key == "w_o":
        return a.reshape(h, hd, d)
    if key == "w_out" and path[0] == "head":
        return a.T
    return a


def _ours_to_hf(m, path, a: np.ndarray) -> np.ndarray:
    d, h, hd = m.d_model, m.heads, m.d_model // m.heads
    key = _key(path)
    if m.kind == "llama":
        if key in ("w_q", "w_kv"):
            return a.reshape(d, -1).T
        if key == "w_o":
            return a.reshape(h * hd, d).T
        if key in TRANSPOSED:
            return a.T
        return a
    if key == "w_qkv":
        return a.reshape(d, h, 3, hd).transpose(0, 2, 1, 3).reshape(d, 3 * d)
    if key == "b_qkv":
        return a.reshape(h, 3, hd).transpose(1, 0, 2).reshape(3 * d)
    if key == "w_o":
        return a.reshape(d, d)
    if key == "w_out" and path[0] == "head":
        return a.T
    return a




def check_tensors(m, tensors: dict, flag: str, where: str) -> None:
    """One line for missing tensors or a shape that does not match config.json."""
    expected = expected_shapes(m)
    present = {n: tuple(a.shape) for n, a in tensors.items() if not n.endswith(IGNORED_SUFFIXES)}
    if m.kind == "gpt":  # GPT-2 files may omit the 'transformer.' prefix
        present = {(n if n.startswith(("transformer.", "lm_head")) else "transformer." + n): s
                   for n, s in present.items()}
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise _fail(flag, where, f"missing tensors {', '.join(missing[:3])}{more}; the "
                                 f"weights do not match config.json")
    for name, shape in expected.items():
        if present[name] != shape:
            raise _fail(flag, where, f"tensor {name} has shape {list(present[name])} but "
                                     f"config.json implies {list(shape)}; fix config.json "
                                     f"or the weights")


def params_from_hf(m, tensors: dict, flag: str = "--from-hf", where: str = "") -> dict:
    """Our logical parameter tree (fp32 numpy) from HF tensors of model config `m`."""
    check_tensors(m, tensors, flag, where)
    if m.kind == "gpt":
        tensors = {(n if n.startswith(("transformer.", "lm_head")) else "transformer." + n): a
                   for n, a in tensors.items()}
    params: dict = {}
    pending: dict = {}

    def one(name, i, j):
        return _hf_to_ours(m, path, np.asarray(tensors[name.format(i=i, j=j)], np.float32))

    for name, path, _ in entries(m):
        arrs = [np.stack([one(name, i, j) for j in _experts(m, name)]) if "{j}" in name
                else one(name, i, None) for i in _layers(m, name)]
        value = np.stack(arrs) if "{i}" in name else arrs[0]
        if isinstance(path[-1], int):  # one half of a stacked pair (k/v, gate/up)
            pending.setdefault(path[:-1], {})[path[-1]] = value
            if len(pending[path[:-1]]) < 2:
                continue
            pair = pending.pop(path[:-1])
            # (L, D, KV, 2, hd) / (L, D, 2, F) / (L, E, D, 2, F)
            value = np.stack([pair[0], pair[1]], axis=PAIR_AXIS[_key(path)])
            path = path[:-1]
        _put(params, path, value)
    if m.experts:  # the statistics leaf: no HF tensor, always 0
        _put(params, ("blocks", "moe", MOE_STATS),
             np.zeros((m.layers, moe_stats_len(m.experts)), np.float32))
    params.setdefault("head", {})
    return params


def _put(tree: dict, path, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def params_to_hf(m, params: dict, dtype=np.float32) -> dict[str, np.ndarray]:
    """HF tensors (name -> numpy array in `dtype`) from our logical parameter tree."""
    out: dict[str, np.ndarray] = {}
    for name, path, _ in entries(m):
        pair = path[-1] if isinstance(path[-1], int) else None
        node = params
        for k in (path[:-1] if pair is not None else path):
            node = node[k]
        full = np.asarray(node, np.float32)
        if pair is not None:
            full = np.take(full, pair, axis=PAIR_AXIS[_key(path)])
        for i in _layers(m, name):
            layer = full[i] if i is not None else full
            for j in _experts(m, name):
                one = layer[j] if j is not None else layer
                out[name.format(i=i, j=j)] = np.ascontiguousarray(
                    _ours_to_hf(m, path, one)).astype(dtype)
    return out


def interleaved_to_half(w_out_in: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q/k projection (heads*hd, D) from Meta's interleaved-pair RoPE layout to the
    half-split layout HF and `models/llama.py` use (HF's `permute` in its conversion script)."""
    n, d = w_out_in.shape
    hd = n // heads
    return w_out_in.reshape(heads, hd // 2, 2, d).transpose(0, 2, 1, 3).reshape(n, d)


def half_to_interleaved(w_out_in: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `interleaved_to_half`."""
    n, d = w_out_in.shape
    hd = n // heads
    return w_out_in.reshape(heads, 2, hd // 2, d).transpose(0, 2, 1, 3).reshape(n, d)
