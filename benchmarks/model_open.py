"""What opening a GGUF model costs before any weight is read, side by side in one process.

A `pdserve serve` reads the model's metadata in its frontend several times (preflight, placement,
the backend's model config, the tokenizer) and again in every worker (config, tokenizer, weights):

- ``gguf_reader_s``: ``gguf.GGUFReader`` opening the file (what every path used before);
- ``gguf_file_s``: engine/loader/gguf_file.py's ``GGUFFile`` (metadata and tensor index in one
  pass over an mmap), and the calls built on it: ``load_model_config_s``,
  ``tokenizer_s`` (``Tokenizer.from_gguf``) and ``planner_spec_s`` (``pdserve plan``'s model spec).

Each figure is the fastest of --repeats opens (the file is in the page cache after the first).

    .venv/bin/python benchmarks/model_open.py [--model PATH.gguf] [--repeats 3]

Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def fastest_s(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best, 4)


def main() -> None:
    from engine.loader.default_model import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a .gguf file (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = Path(args.model) if args.model else default_model_path()
    if path.suffix != ".gguf" or not path.is_file():
        raise SystemExit(f"--model {path} is not a .gguf file; pass one (or none for the bundled SmolLM2)")

    import gguf

    from cluster.tools.planner.model_spec import spec_from_gguf
    from engine.loader.gguf_file import GGUFFile
    from engine.loader.load import load_model_config
    from engine.tokenizer import Tokenizer

    res = {"bench": "model_open", "model": path.name, "bytes": path.stat().st_size, "repeats": args.repeats,
           "gguf_reader_s": fastest_s(lambda: gguf.GGUFReader(str(path)), args.repeats),
           "gguf_file_s": fastest_s(lambda: GGUFFile(path), args.repeats),
           "load_model_config_s": fastest_s(lambda: load_model_config(path), args.repeats),
           "tokenizer_s": fastest_s(lambda: Tokenizer.from_gguf(path), args.repeats),
           "planner_spec_s": fastest_s(lambda: spec_from_gguf(path), args.repeats)}
    res["speedup"] = round(res["gguf_reader_s"] / res["gguf_file_s"], 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
