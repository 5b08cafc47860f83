"""The deploy configs parse as Serve configs and their arguments validate."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from actors.config import AppConfig, resolve_model

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["serve-local.yaml", "serve-cluster.yaml"])
def test_deploy_configs_parse(name):
    schema = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "configs" / name).read_text()))
    (app,) = schema.applications
    assert app.import_path == "cluster.serving.app:build_app"
    args = dict(app.args)
    if name == "serve-cluster.yaml":  # its model lives on the cluster's nodes
        args["model"] = "tests/golden/A"
    config = AppConfig.from_args(args)
    assert Path(config.model).is_absolute() and (Path(config.model) / "config.json").exists()


def test_app_arguments_are_validated():
    with pytest.raises(ValueError, match="unknown"):
        AppConfig.from_args({"modle": "x"})
    with pytest.raises(ValueError, match="decoder_replicas"):
        AppConfig.from_args({"decoder_replicas": 0})
    with pytest.raises(ValueError, match="speculation must be one of off, fixed or scheduled"):
        AppConfig.from_args({"speculation": "always"})
    with pytest.raises(ValueError, match="speculation_k"):
        AppConfig.from_args({"speculation_k": -1})
    with pytest.raises(ValueError, match="local_prefill_tokens"):
        AppConfig.from_args({"local_prefill_tokens": 1.5})
    with pytest.raises(ValueError, match="no checkpoint"):
        AppConfig.from_args({"model": "/nonexistent"})
    assert resolve_model("tests/golden/A") == ROOT / "tests" / "golden" / "A"
    with pytest.raises(ValueError, match="decoder_max_replicas"):
        AppConfig.from_args({"decoder_replicas": 2, "decoder_max_replicas": 1})
    with pytest.raises(ValueError, match="one of api_key, api_key_file and api_keys_file"):
        AppConfig.from_args({"api_key": "k", "api_key_file": "/k"})


def test_a_pool_split_is_checked_against_the_model():
    model = {"model": "tests/golden/A"}  # 8 routed experts
    assert AppConfig.from_args({**model, "decoder_parallel": {"experts": 4}}).decoder_parallel.experts == 4
    with pytest.raises(ValueError, match="prefill_parallel.experts=3 does not divide the model's 8 routed experts"):
        AppConfig.from_args({**model, "prefill_parallel": {"experts": 3}})
    with pytest.raises(ValueError, match="decoder_parallel.tensor: tensor parallelism is not built"):
        AppConfig.from_args({**model, "decoder_parallel": {"experts": 2, "tensor": 2}})
    with pytest.raises(ValueError, match="compiled_step"):
        AppConfig.from_args({**model, "decoder_parallel": {"experts": 2}, "compiled_step": True})
    with pytest.raises(ValueError, match="unknown application argument 'decoder_parallel.expert'"):
        AppConfig.from_args({**model, "decoder_parallel": {"expert": 2}})
    from cluster.serving.app import decoder_options

    assert decoder_options(AppConfig.from_args({**model, "decoder_parallel": {"experts": 2}}))["health_check_period_s"] == 2


def test_the_decoder_pool_queues_at_the_router_and_autoscales_on_its_batch():
    from cluster.serving.app import decoder_options

    fixed = decoder_options(AppConfig.from_args({"max_batch": 16, "max_queued_requests": 100}))
    assert (fixed["num_replicas"], fixed["max_ongoing_requests"], fixed["max_queued_requests"]) == (1, 20, 100)
    scaled = decoder_options(AppConfig.from_args({"max_batch": 32, "decoder_replicas": 2, "decoder_max_replicas": 8}))
    assert "num_replicas" not in scaled and scaled["max_ongoing_requests"] == 40
    assert scaled["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 32}


def test_the_grafana_dashboard_reads_only_metrics_the_code_exports():
    """Every series the dashboard queries is one the router, the pools or the stores
    define (Ray exports them with the ray_ prefix), so a renamed metric fails here."""
    import json
    import re

    source = "\n".join(path.read_text() for folder in ("cluster", "actors", "storage")
                       for path in (ROOT / folder).rglob("*.py"))
    defined = set(re.findall(r'metrics\.(?:Gauge|Counter|Histogram)\(\s*"(v41_[a-z0-9_]+)"', source))
    defined |= {f"v41_store_{name}" for name in re.findall(r'"(\w+)"', source[source.index("FIELDS = ("):][:200])}
    dashboard = json.loads((ROOT / "configs" / "grafana-dashboard.json").read_text())
    queried = {re.sub(r"_bucket$", "", name) for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"ray_(v41_[a-z0-9_]+)", target["expr"])}
    assert len(dashboard["panels"]) >= 10 and queried
    assert queried <= defined, queried - defined
    for needed in ("v41_ttft_seconds", "v41_time_per_output_token_seconds", "v41_store_hits",
                   "v41_queue_wait_seconds", "v41_engram_wait_seconds", "v41_spec_acceptance_length"):
        assert needed in queried
