"""`v41 serve`'s arguments: --config (a Serve YAML or a mapping of the app's
arguments), the flags over it, and the API key from a file or the environment."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from cluster import UserError
from cluster.cli.serve import API_KEY_ENV, add_arguments, app_arguments
from actors.config import AppConfig
from storage.slots import cache_home, slots_template

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _own_cache_folder(tmp_path, monkeypatch):
    """`v41 serve` makes the cluster's secret in the user's v41 cache folder: the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return app_arguments(parser.parse_args(list(argv)))


def test_defaults_are_the_shipped_model_and_a_local_cache(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = parse()
    secret = cache_home() / "cache-secret"
    assert args == {"model": str(ROOT / "configs" / "small"), "ssd_dir": slots_template(cache_home().resolve()),
                    "cache_secret_file": str(secret)}
    made = secret.read_bytes()
    assert len(made) == 64 and int(made, 16) >= 0 and secret.stat().st_mode & 0o777 == 0o600  # 32 bytes, in hex
    assert parse()["cache_secret_file"] == str(secret) and secret.read_bytes() == made  # made once, kept


def test_the_step_is_left_to_the_host_unless_a_flag_names_it(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert "compiled_step" not in parse() and AppConfig.from_args(parse()).compiled_step is None
    assert parse("--no-compiled-step")["compiled_step"] is False
    assert parse("--compiled-step")["compiled_step"] is True


def test_a_serve_yaml_gives_its_first_applications_args_and_flags_win(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    yaml_args = yaml.safe_load((ROOT / "configs" / "serve-local.yaml").read_text())["applications"][0]["args"]
    args = parse("--config", str(ROOT / "configs" / "serve-local.yaml"), "--max-batch", "8", "--ram-gb", "1.5",
                 "--chunk-retention-hours", "24", "--encoder-replay-windows", "2")
    assert args == {**yaml_args, "ssd_dir": slots_template(cache_home().resolve()), "max_batch": 8,
                    "ram_capacity_bytes": 3 << 29, "chunk_retention_hours": 24.0, "encoder_replay_windows": 2,
                    "cache_secret_file": str(cache_home() / "cache-secret")}
    assert AppConfig.from_args(args).retention().ram_capacity_bytes == 3 << 29
    plain = tmp_path / "args.yaml"
    plain.write_text("max_queued_requests: 32\nwindow_ttl_minutes: 5\n")
    args = parse("--config", str(plain), "--cache-dir", str(tmp_path / "c"))
    assert args["max_queued_requests"] == 32 and args["ssd_dir"] == str(tmp_path / "c" / "v41-slots" / "{node}")


def test_expert_flags_split_the_pools_over_a_yamls_worker_resources(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    plain = tmp_path / "args.yaml"
    plain.write_text("decoder_parallel: {experts: 4, worker_resources: {GPU: 1}}\n")
    args = parse("--config", str(plain), "--decoder-experts", "2", "--prefill-experts", "2")
    assert args["decoder_parallel"] == {"experts": 2, "worker_resources": {"GPU": 1}}
    assert args["prefill_parallel"] == {"experts": 2}
    with pytest.raises(UserError, match="decoder_parallel.experts=3 does not divide"):
        parse("--decoder-experts", "3")


def test_a_mistake_is_one_line_naming_the_argument(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_batch: 0\nsurprise: 1\n")
    with pytest.raises(UserError, match="max_batch.*surprise|surprise.*max_batch"):
        parse("--config", str(bad))
    with pytest.raises(UserError, match="encoder_replay_windows"):
        parse("--encoder-replay-windows", "0")


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = parse("--api-key-file", str(key_file))
    assert "api_key" not in args and AppConfig.from_args(args).resolved_api_key() == "s3cret"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert AppConfig.from_args(parse()).resolved_api_key() == "from-env"


def test_an_external_redis_and_the_environment_for_a_cluster(monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv("V41_REDIS_PASSWORD", raising=False)  # (its password: tests/integration/test_security_redis.py)
    assert parse("--redis-url", "redis://redis.internal:6379/0")["redis_url"] == "redis://redis.internal:6379/0"
    from cluster.cli.serve import run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--print-env", "--port", "9000"])) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "export RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=9000" in printed
    assert "export RAY_SERVE_THROUGHPUT_OPTIMIZED=1" in printed
