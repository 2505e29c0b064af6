"""`pdserve bench` flag handling that needs no server."""
from __future__ import annotations

import pytest

from cluster.cli import main


@pytest.mark.parametrize("argv,message", [
    (["--request-rate", "2", "--sweep", "1,2"], "either --request-rate or --sweep"),
    (["--dataset", "trace", "--trace-path", "x.jsonl", "--request-rate", "2"], "--trace-time-scale"),
    (["--dataset", "sharegpt"], "--sharegpt-path"),
    (["--dataset", "trace"], "--trace-path"),
    (["--num-requests", "0"], "--num-requests"),
    (["--burstiness", "0.5", "--arrival", "poisson", "--request-rate", "1"], "--arrival gamma"),
    (["--max-concurrency", "-2"], "--max-concurrency"),
    (["--slo-ttft-ms", "-1"], "--slo-ttft-ms"),
])
def test_bad_flags_fail_before_connecting_and_say_how_to_fix(argv, message, capsys):
    assert main(["bench", "--target", "127.0.0.1:1", "--connect-timeout", "0.1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unreachable_target_says_so(capsys):
    assert main(["bench", "--target", "127.0.0.1:1", "--connect-timeout", "0.5", "--no-progress"]) == 2
    assert "cannot reach pdserve at --target 127.0.0.1:1" in capsys.readouterr().err


def test_bad_rate_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--request-rate", "fast"])
    assert "not a request rate" in capsys.readouterr().err
