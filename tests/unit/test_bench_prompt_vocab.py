"""`pdserve bench`'s synthetic prompts draw only ids the server accepts and the tokenizer has:
ModelInfo's vocab_size (the model's rows) and tokenizer_vocab_size (a padded vocabulary has fewer)."""
from __future__ import annotations

import argparse

from cluster.tools.bench import cli
from cluster.pb import generation_pb2 as pb


def args(dataset: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.register(p.add_subparsers())
    return p.parse_args(["bench", "--dataset", dataset, "--num-requests", "64", "--random-input-len", "64",
                         "--sp-groups", "4", "--sp-system-len", "64"])


def test_random_and_shared_prefix_prompts_stay_below_the_tokenizers_range():
    info = pb.ModelInfoResponse(model_name="m", max_model_len=4096, block_size=16, vocab_size=384,
                                tokenizer_vocab_size=320)
    assert cli.prompt_vocab(info) == 320
    for dataset in ("random", "shared-prefix"):
        reqs, _ = cli._dataset(args(dataset), info, seed=0, limit=4095)
        ids = [t for r in reqs for t in r.prompt_token_ids]
        assert max(ids) < 320 and max(ids) > 300, dataset     # the whole range is used, nothing past it


def test_an_older_server_without_tokenizer_vocab_size_uses_vocab_size():
    info = pb.ModelInfoResponse(model_name="m", max_model_len=4096, block_size=16, vocab_size=384)
    assert cli.prompt_vocab(info) == 384
