"""Configuration: file, environment, overrides, sizes, and one-line errors naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_core.config import load_config, parse_size
from mooncake_core.errors import ConfigError


def test_sizes() -> None:
    assert parse_size("4GB") == 4 << 30
    assert parse_size("512 MiB") == 512 << 20
    assert parse_size("3.125GiB") == int(3.125 * (1 << 30))
    assert parse_size(1024) == 1024
    assert parse_size("64k") == 64 << 10
    for bad in ("lots", "-1GB", True, [1], "1.5.5MB"):
        with pytest.raises(ConfigError):
            parse_size(bad, "global_segment_size")


def test_mooncake_json_file_env_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "mooncake.json"
    f.write_text(
        json.dumps(
            {
                "local_hostname": "10.0.0.2",
                "metadata_server": "etcd://127.0.0.1:2379",
                "protocol": "rdma",
                "device_name": "mlx5_0",
                "master_server_address": "127.0.0.1:50051",
                "global_segment_size": "4GB",
                "local_buffer_size": 134217728,
            }
        )
    )
    env = {
        "MOONCAKE_CONFIG_PATH": str(f),
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_TRANSFER_SLICE_SIZE": "1MiB",
    }
    cfg = load_config(environ=env, device_name="")
    assert cfg.local_hostname == "10.0.0.2"
    assert cfg.global_segment_size == 4 << 30 and cfg.local_buffer_size == 128 << 20
    assert cfg.protocol == "tcp"  # env beats file
    assert cfg.device_name == ""  # argument beats file
    assert cfg.transfer.slice_size == 1 << 20
    assert cfg.replace(transfer={"secret": "x"}).transfer.secret == "x"
    assert cfg.replace(transfer={"secret": "x"}).transfer.slice_size == 1 << 20


@pytest.mark.parametrize(
    "content,key",
    [
        ({"global_segment_size": "huge"}, "global_segment_size"),
        ({"protocol": "carrier-pigeon"}, "protocol"),
        ({"local_hostnme": "x"}, "local_hostnme"),
        ({"transfer": {"slice_size": 10}}, "transfer.slice_size"),
        ({"transfer": {"connections_per_peer": "two"}}, "transfer.connections_per_peer"),
        ({"store": {"replica_num": 0}}, "store.replica_num"),
        ({"store": {"location_cache": -1}}, "store.location_cache"),
        ({"transfer": {"shm_copy_threads": 65}}, "transfer.shm_copy_threads"),
        ({"transfer": 5}, "transfer"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, content: dict[str, object], key: str) -> None:
    f = tmp_path / "m.json"
    f.write_text(json.dumps(content))
    with pytest.raises(ConfigError) as ei:
        load_config(f, environ={})
    msg = str(ei.value)
    assert msg.startswith(key + ":") or msg.startswith(key), msg
    assert "\n" not in msg


def test_unknown_key_suggests_closest(tmp_path: Path) -> None:
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"local_hostnme": "x"}))
    with pytest.raises(ConfigError, match="did you mean 'local_hostname'"):
        load_config(f, environ={})


def test_bad_env_value_names_key() -> None:
    with pytest.raises(ConfigError, match="^transfer.timeout_s: expected a number"):
        load_config(environ={"MOONCAKE_TRANSFER_TIMEOUT_S": "soon"})


def test_bad_file(tmp_path: Path) -> None:
    f = tmp_path / "m.json"
    f.write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON at line 1"):
        load_config(f, environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json", environ={})


def test_transfer_spin_is_validated() -> None:
    assert load_config(transfer={"spin_us": 0}).transfer.spin_us == 0
    with pytest.raises(ConfigError, match="transfer.spin_us: must be 0..100000, got -1"):
        load_config(transfer={"spin_us": -1})
