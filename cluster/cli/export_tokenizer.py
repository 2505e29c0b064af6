"""`pdserve export-tokenizer DIR`: the served model's tokenizer as a Hugging Face directory.

For harnesses that tokenize on their own (guidellm, aiperf, inference-perf, vLLM's bench):
point their tokenizer option at DIR and they count and build prompts exactly as pdserve
encodes them. --model takes what `pdserve serve --model` takes (default: the bundled
SmolLM2-135M-Instruct GGUF).
"""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("export-tokenizer", help="write the served tokenizer as a Hugging Face directory",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="directory to write tokenizer.json, tokenizer_config.json, special_tokens_map.json")
    p.add_argument("--model", default="", help="HF directory, .gguf file or cached HF model id "
                                                "(default: the bundled SmolLM2-135M-Instruct GGUF)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.loader.load import load_model_config, resolve_model_path
    from engine.tokenizer import Tokenizer
    from engine.tokenizer_export import FILES, export_hf_tokenizer

    path = resolve_model_path(args.model or None)
    out = export_hf_tokenizer(Tokenizer.load(path), args.dir,
                              model_max_length=load_model_config(path).max_position_embeddings)
    print(f"wrote {', '.join(FILES)} of {path.name}'s tokenizer to {out}")
    return 0
