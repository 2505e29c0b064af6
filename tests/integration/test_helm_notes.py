"""The chart's NOTES (what `helm install` prints) show a request that works: its "model" is the
name the server serves (cluster/preflight.py's rule), not a placeholder the server answers 404."""
from __future__ import annotations

import re

import pytest

from engine.loader.load import served_name
from test_helm_chart import CHART, HELM, NAMESPACE, RELEASE, helm

pytestmark = pytest.mark.skipif(HELM is None, reason="helm not found (make tools)")


def notes_model(*args: str) -> str:
    out = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *args).stdout
    notes = out[out.index("NOTES:"):]
    found = re.findall(r'"model": "([^"]*)"', notes)
    assert len(found) == 1, notes
    return found[0]


@pytest.mark.parametrize("model", ["", "/models/Qwen2.5-0.5B-Instruct", "/models/Qwen2.5-0.5B-Instruct/",
                                   "/models/gguf/tiny.Q4_1.gguf", "Qwen/Qwen2.5-0.5B-Instruct"])
def test_notes_request_uses_the_name_the_server_derives(model):
    args = ["--set", f"config.model={model}"] if model else []
    assert notes_model(*args) == served_name(model or None)


def test_notes_request_uses_the_first_served_model_name():
    assert notes_model("--set", "config.model=/models/x", "--set-json", 'config.served_model_name=["chat","alias"]') \
        == "chat"
    assert notes_model("--set", "config.served_model_name=solo") == "solo"
