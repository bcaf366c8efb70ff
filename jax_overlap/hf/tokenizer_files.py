"""The tokenizer side of a Hugging Face directory: what `convert --to-hf` writes beside the
weights and what `convert --from-hf` brings into a run.

Export: `tokenizer.json` (the run's own copy; for a byte-level run a byte-level BPE whose ids
are the byte values), `tokenizer_config.json` (the fast tokenizer class, the special tokens,
`model_max_length` = `model.seq_len`) and `generation_config.json` (the special token ids,
`max_length`), so that `AutoTokenizer` and `AutoModelForCausalLM.from_pretrained(DIR)` both
load the directory.

Import: the HF directory's `tokenizer.json` (and its `tokenizer_config.json` and
`generation_config.json`, which a later export carries back) are copied into the run dir.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from jax_overlap.config import ConfigError
from jax_overlap.data import tokenizer as toklib

TOKENIZER = toklib.TOKENIZER_FILE
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CARRIED = (TOKENIZER_CONFIG, GENERATION_CONFIG)  # copied in by --from-hf, reused on export

# Special-token roles by the usual spellings of the tokenizers people use.
_ROLES = {
    "bos_token": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]"),
    "eos_token": ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|eot_id|>", "[SEP]"),
    "unk_token": ("<unk>", "[UNK]", "<|unk|>"),
    "pad_token": ("<pad>", "<|pad|>", "[PAD]"),
}


def special_tokens(tokenizer_json: str) -> dict[str, tuple[str, int]]:
    """{role: (content, id)} of the tokenizer's special added tokens, by their spelling."""
    with open(tokenizer_json) as f:
        added = json.load(f).get("added_tokens") or []
    out: dict[str, tuple[str, int]] = {}
    for token in added:
        if not token.get("special"):
            continue
        for role, names in _ROLES.items():
            if token.get("content") in names and role not in out:
                out[role] = (token["content"], int(token["id"]))
    return out


def write_export(out_dir: str, tok: toklib.Tokenizer, seq_len: int,
                 run_dir: Optional[str] = None) -> list[str]:
    """Writes the tokenizer files of an export into `out_dir`; returns their names."""
    dest = os.path.join(out_dir, TOKENIZER)
    if tok.hf is None:
        toklib.write_byte_tokenizer(dest)
    else:
        shutil.copyfile(tok.name, dest)
    specials = special_tokens(dest)
    carried = {name: _read_json(os.path.join(run_dir, name)) if run_dir else None
               for name in CARRIED}
    config = carried[TOKENIZER_CONFIG] or {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        **{role: content for role, (content, _) in specials.items()}}
    config["model_max_length"] = seq_len
    generation = carried[GENERATION_CONFIG] or {
        f"{role[:-6]}_token_id": i for role, (_, i) in specials.items() if role != "unk_token"}
    generation.setdefault("max_length", seq_len)
    for name, data in ((TOKENIZER_CONFIG, config), (GENERATION_CONFIG, generation)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
    return [TOKENIZER, TOKENIZER_CONFIG, GENERATION_CONFIG]


def check_hf_tokenizer(hf_dir: str, vocab: int) -> Optional[toklib.Tokenizer]:
    """The HF directory's tokenizer (None when it has no tokenizer.json).

    Raises:
      ConfigError: the tokenizer is unreadable or has more tokens than the model's vocab.
    """
    src = os.path.join(hf_dir, TOKENIZER)
    if not os.path.isfile(src):
        return None
    try:
        tok = toklib.load(src, field="--from-hf")
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    if tok.vocab_size > vocab:
        raise ConfigError([f"--from-hf {hf_dir}: {TOKENIZER} has {tok.vocab_size} tokens, "
                           f"more than the model's vocab_size {vocab}; fix config.json or the "
                           f"tokenizer"])
    return tok


def import_into_run(hf_dir: str, run_dir: str, vocab: int) -> Optional[toklib.Tokenizer]:
    """Copies the HF directory's tokenizer files into `run_dir`; the run's tokenizer (None
    when the directory has no tokenizer.json). Raises as `check_hf_tokenizer`."""
    if check_hf_tokenizer(hf_dir, vocab) is None:
        return None
    for name in (TOKENIZER, *CARRIED):
        if os.path.isfile(os.path.join(hf_dir, name)):
            copy_file(os.path.join(hf_dir, name), os.path.join(run_dir, name))
    return toklib.load(os.path.join(run_dir, TOKENIZER))


def copy_file(src: str, dest: str) -> None:
    tmp = dest + ".tmp"
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, dest)


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
