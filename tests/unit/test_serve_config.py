"""ServeConfig's checks on the stream write bound, and its `serve` flag."""
from __future__ import annotations

import argparse

import pytest

from cluster.cli import serve as serve_cli
from cluster.config import ServeConfig


def test_stream_write_timeout_must_not_be_negative():
    with pytest.raises(ValueError, match="stream_write_timeout must be >= 0 seconds"):
        ServeConfig(stream_write_timeout=-1.0)
    assert ServeConfig(stream_write_timeout=0.0).stream_write_timeout == 0.0     # 0 = no bound


def test_stream_write_timeout_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--stream-write-timeout", "5", "--no-ray"])
    assert serve_cli.config_from_args(args).stream_write_timeout == 5.0
    assert ServeConfig().stream_write_timeout == 30.0


def test_both_frontends_off_is_refused_before_anything_starts(tmp_path):
    """grpc_port 0 and http_port 0 would serve nothing: start_stack refuses before the
    preflight (the model below does not exist) and before Ray or the weights."""
    import asyncio

    from cluster.server_stack import check_frontends, start_stack

    cfg = ServeConfig(grpc_port=0, http_port=0, model=str(tmp_path / "no-such-model"), ray=False)
    with pytest.raises(ValueError, match="grpc_port and http_port are both 0.*set one"):
        asyncio.run(start_stack(cfg))
    check_frontends(ServeConfig(grpc_port=0, http_port=8000))     # HTTP only
    check_frontends(ServeConfig(grpc_port=50051, http_port=0))    # gRPC only


def test_port_flags_say_zero_turns_a_frontend_off():
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    sub = next(a for a in parser._subparsers._group_actions if a.choices).choices["serve"]
    helps = {a.dest: a.help for a in sub._actions}
    assert "0 = off" in helps["grpc_port"] and "0 = off" in helps["http_port"]
    args = parser.parse_args(["serve", "--grpc-port", "0", "--http-port", "8001"])
    cfg = serve_cli.config_from_args(args)
    assert (cfg.grpc_port, cfg.http_port) == (0, 8001)


def test_first_token_release_from_flag_env_and_yaml_and_bad_values_say_the_choices(tmp_path):
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--first-token-release", "decode", "--no-ray"])
    assert serve_cli.config_from_args(args).first_token_release == "decode"
    assert ServeConfig.from_sources(env={"PDSERVE_FIRST_TOKEN_RELEASE": "decode"}).first_token_release == "decode"
    (tmp_path / "c.yaml").write_text("first_token_release: decode\n")
    assert ServeConfig.from_sources(str(tmp_path / "c.yaml"), env={}).first_token_release == "decode"
    with pytest.raises(ValueError, match="first_token_release must be one of prefill, decode"):
        ServeConfig(first_token_release="client")
