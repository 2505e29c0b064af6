from __future__ import annotations

import logging

import pytest

from cluster.config import ServeConfig
from cluster.observability.log_levels import configure_logging, parse_log_levels


def test_a_level_then_logger_levels():
    assert parse_log_levels("info") == ("INFO", {})
    assert parse_log_levels("WARNING, pdserve.requests=debug,ray=ERROR") == (
        "WARNING", {"pdserve.requests": "DEBUG", "ray": "ERROR"})


@pytest.mark.parametrize("bad", ["loud", "pdserve=DEBUG", "INFO,=DEBUG", "INFO,x=LOUD", "INFO,,"])
def test_bad_specs_say_how_to_write_one(bad):
    with pytest.raises(ValueError, match="e.g. 'INFO,pdserve.requests=DEBUG'"):
        parse_log_levels(bad)
    with pytest.raises(ValueError, match="log_level"):
        ServeConfig(log_level=bad)


def test_configure_sets_each_named_logger():
    configure_logging("INFO,pdserve.test_log_levels=DEBUG")
    assert logging.getLogger("pdserve.test_log_levels").level == logging.DEBUG
