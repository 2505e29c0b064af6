"""Write the tokenizer pdserve serves as a Hugging Face tokenizer directory.

Outside tools (guidellm, aiperf, inference-perf, transformers' AutoTokenizer) need the served
model's tokenizer as files. For a GGUF there are none on disk, and the tokenizer transformers
rebuilds from a GGUF splits digits and whitespace differently from the one pdserve rebuilds
(SmolLM2's ".\\n 1": pdserve [30, 3805, 33], transformers [30, 198, 216, 33]). This writes
pdserve's own: tokenizer.json (the same ``tokenizers`` pipeline, plus a post-processor that
adds BOS where pdserve adds it), tokenizer_config.json (special tokens, chat template) and
special_tokens_map.json, so the directory encodes every string exactly as the server does.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _Backend
from tokenizers import processors

from engine.tokenizer import Tokenizer

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export_hf_tokenizer(tok: Tokenizer, out_dir: str | Path, *, model_max_length: int | None = None) -> Path:
    """Write ``tok`` to ``out_dir`` (created; existing tokenizer files are replaced)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory: give a directory to write the tokenizer to")
    out.mkdir(parents=True, exist_ok=True)
    backend = _Backend.from_str(tok.backend_json())
    bos = tok.id_to_token(tok.bos_token_id) if tok.bos_token_id is not None else None
    eos = tok.id_to_token(tok.eos_token_id) if tok.eos_token_id is not None else None
    if tok.add_bos_token and bos is not None:   # pdserve prepends BOS itself: make the file do it
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)])
    backend.save(str(out / "tokenizer.json"))
    special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length or 1_000_000_000_000_000_019_884_624_838_656,
    }
    if tok.chat_template_source:
        config["chat_template"] = tok.chat_template_source
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")
    return out
