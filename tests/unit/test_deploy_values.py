"""The chart's values.schema.json and values files against ServeConfig (no helm needed).

values.schema.json closes `config` to exactly ServeConfig's fields, so `helm install` rejects a
key `pdserve serve` would reject; these tests keep that list and its types in step with
cluster/config.py.
"""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import jsonschema
import pytest
import yaml

from cluster.config import KV_CACHE_DTYPES, ROUTER_POLICIES, TRANSFER_BACKENDS, ServeConfig

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "tuple[str, ...]": "array"}


def schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def values(name: str) -> dict:
    return yaml.safe_load((CHART / name).read_text())


def test_schema_config_properties_are_exactly_serveconfig_fields():
    config = schema()["properties"]["config"]
    assert config["additionalProperties"] is False
    assert sorted(config["properties"]) == sorted(ServeConfig.keys())


def test_schema_config_types_match_serveconfig_types():
    props = schema()["properties"]["config"]["properties"]
    for f in fields(ServeConfig):
        allowed = props[f.name]["type"]
        allowed = allowed if isinstance(allowed, list) else [allowed]
        assert JSON_TYPES[f.type] in allowed, f"config.{f.name}: schema {allowed}, ServeConfig {f.type}"
    assert props["router_policy"]["enum"] == list(ROUTER_POLICIES)
    assert props["transfer_backend"]["enum"] == list(TRANSFER_BACKENDS)
    assert props["kv_cache_dtype"]["enum"] == list(KV_CACHE_DTYPES)


@pytest.mark.parametrize("name", ["values.yaml", "values-gpu.yaml"])
def test_values_files_config_keys_are_serveconfig_keys(name):
    cfg = values(name).get("config", {})
    assert set(cfg) <= set(ServeConfig.keys()), sorted(set(cfg) - set(ServeConfig.keys()))


def test_default_values_satisfy_schema():
    jsonschema.Draft7Validator(schema()).validate(values("values.yaml"))


def test_schema_rejects_unknown_config_key_and_bad_types():
    v = jsonschema.Draft7Validator(schema())
    base = values("values.yaml")
    bad_key = {**base, "config": {**base["config"], "grpc-port": 1}}
    bad_policy = {**base, "config": {**base["config"], "router_policy": "random"}}
    bad_start = {**base, "head": {**base["head"], "rayStartParams": {"num-cpus": 0}}}
    for doc in (bad_key, bad_policy, bad_start):
        assert list(v.iter_errors(doc)), doc


def test_serveconfig_accepts_default_values_config(tmp_path):
    """The chart's config block (before the chart adds pool sizes) is a valid ServeConfig file."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(values("values.yaml")["config"]))
    cfg = ServeConfig.from_sources(yaml_path=str(path), env={})
    assert (cfg.host, cfg.grpc_port, cfg.http_port, cfg.metrics_port) == ("0.0.0.0", 50051, 8000, 9400)
    assert cfg.address == "auto"
