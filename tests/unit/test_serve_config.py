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
