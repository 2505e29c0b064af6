"""`--tensor-parallel-size` and its per-pool forms: config keys, env and flags; sizes the
model cannot split are refused at start-up with the flag to change and the sizes that work."""
from __future__ import annotations

import argparse

import pytest

from cluster.cli import serve as serve_cli
from cluster.config import ServeConfig
from cluster.orchestration.launcher import engine_config, transfer_settings
from cluster.orchestration.tp_placement import check_tp_sizes


def test_pool_sizes_default_to_the_shared_one():
    cfg = ServeConfig(tensor_parallel_size=2)
    assert (cfg.pool_tp_size("prefill"), cfg.pool_tp_size("decode")) == (2, 2)
    cfg = ServeConfig(tensor_parallel_size=2, decode_tensor_parallel_size=1)
    assert (cfg.pool_tp_size("prefill"), cfg.pool_tp_size("decode"), cfg.pool_tp_size("colocated")) == (2, 1, 1)
    assert engine_config(cfg, "prefill").tensor_parallel_size == 2
    assert engine_config(cfg, "decode").tensor_parallel_size == 1
    assert ServeConfig().pool_tp_size("prefill") == 1


def test_flags_env_and_file_reach_the_config(tmp_path):
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--prefill-tensor-parallel-size", "2", "--tensor-parallel-size", "4"])
    cfg = serve_cli.config_from_args(args)
    assert (cfg.pool_tp_size("prefill"), cfg.pool_tp_size("decode")) == (2, 4)
    env = ServeConfig.from_sources(env={"PDSERVE_DECODE_TENSOR_PARALLEL_SIZE": "2"})
    assert env.pool_tp_size("decode") == 2 and env.pool_tp_size("prefill") == 1
    f = tmp_path / "c.yaml"
    f.write_text("tensor-parallel-size: 2\n")
    assert ServeConfig.from_sources(str(f)).pool_tp_size("decode") == 2


@pytest.mark.parametrize("field,value,match", [
    ("tensor_parallel_size", 0, "tensor_parallel_size must be >= 1"),
    ("prefill_tensor_parallel_size", -1, "or 0 to use tensor_parallel_size"),
    ("decode_tensor_parallel_size", -2, "or 0 to use tensor_parallel_size"),
])
def test_sizes_below_one_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        ServeConfig(**{field: value})


def test_a_backend_without_head_range_reads_is_refused():
    with pytest.raises(ValueError, match="ucxx .* use transfer_backend nixl, tcp or auto"):
        ServeConfig(tensor_parallel_size=2, transfer_backend="ucxx")
    ServeConfig(transfer_backend="ucxx")
    assert transfer_settings(ServeConfig(tensor_parallel_size=2)).backend in ("nixl", "tcp")   # auto skips ucxx


def test_cuda_ranks_need_a_gpu_each():
    with pytest.raises(ValueError, match="set gpus_per_worker to 1"):
        ServeConfig(device="cuda", tensor_parallel_size=2)
    ServeConfig(device="cuda", tensor_parallel_size=2, gpus_per_worker=1)


def test_a_size_the_model_cannot_split_is_refused_at_start_up(tiny_llama_dir):
    check_tp_sizes(ServeConfig(model=str(tiny_llama_dir), prefill_tensor_parallel_size=2, decode_tensor_parallel_size=4))
    with pytest.raises(ValueError, match=r"--decode-tensor-parallel-size .* 3: .*Use one of: 1, 2, 4"):
        check_tp_sizes(ServeConfig(model=str(tiny_llama_dir), decode_tensor_parallel_size=3))
    with pytest.raises(ValueError, match=r"--prefill-tensor-parallel-size .* 8"):
        check_tp_sizes(ServeConfig(model=str(tiny_llama_dir), tensor_parallel_size=8))
