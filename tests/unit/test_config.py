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


def test_published_env_names_are_honoured_below_ours(tmp_path: Path) -> None:
    env = {
        "MOONCAKE_MASTER": "10.0.0.9:50051",
        "MOONCAKE_TE_META_DATA_SERVER": "http://10.0.0.9:8080/metadata",
        "MC_METADATA_SERVER": "etcd://10.0.0.9:2379",  # below MOONCAKE_TE_META_DATA_SERVER
        "MOONCAKE_DEVICE": "mlx5_0,mlx5_1",
        "MOONCAKE_OFFLOAD_ENABLED": "true",
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": str(tmp_path),
        "MC_TRANSFER_TIMEOUT": "7",
        "MC_TCP_BIND_ADDRESS": "127.0.0.2",
        "MC_GID_INDEX": "3",
        "MC_SLICE_SIZE": "65536",
        "MC_RETRY_CNT": "5",
        "MC_LOG_LEVEL": "trace",
    }
    cfg = load_config(environ=env)
    assert cfg.master_server_address == "10.0.0.9:50051"
    assert cfg.metadata_server == "http://10.0.0.9:8080/metadata"
    assert cfg.device_name == "mlx5_0,mlx5_1"
    assert cfg.store.ssd_path == str(tmp_path)
    assert cfg.transfer.timeout_s == 7.0 and cfg.transfer.listen_host == "127.0.0.2"
    assert (cfg.transfer.gid_index, cfg.transfer.slice_size, cfg.transfer.retry_count) == (
        3,
        65536,
        5,
    )
    assert cfg.log.level == "DEBUG"
    ours = dict(env, MOONCAKE_MASTER_SERVER_ADDRESS="10.0.0.1:1", MOONCAKE_DEVICE_NAME="x")
    cfg = load_config(environ=ours)
    assert (cfg.master_server_address, cfg.device_name) == ("10.0.0.1:1", "x")
    assert load_config(environ={"MC_METADATA_SERVER": "etcd://h:1"}).metadata_server == (
        "etcd://h:1"
    )
    assert load_config(environ={"MC_FORCE_TCP": "1", "MOONCAKE_CONFIG_PATH": ""}).protocol == "tcp"
    with pytest.raises(ConfigError, match="MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"):
        load_config(environ={"MOONCAKE_OFFLOAD_ENABLED": "1"})
    with pytest.raises(ConfigError, match="MC_FORCE_TCP"):
        load_config(environ={"MC_FORCE_TCP": "sometimes"})


def test_published_env_we_lack_is_refused_with_a_line(caplog: pytest.LogCaptureFixture) -> None:
    from mooncake_core import config

    values, notes = config.published_env(
        {"MOONCAKE_TENANT_ID": "t1", "MC_NUM_QP_PER_EP": "4", "MC_SOMETHING_NEW": "1", "PATH": "/"}
    )
    assert values == {}
    assert notes == [
        "MC_NUM_QP_PER_EP is set but not supported by mooncake-core "
        "(our RDMA transport sizes its queues itself); ignored",
        "MC_SOMETHING_NEW is set but mooncake-core does not know it; ignored",
        "MOONCAKE_TENANT_ID is set but not supported by mooncake-core "
        "(tenants are not supported); ignored",
    ]
    config._WARNED.clear()
    with caplog.at_level("WARNING", logger="mooncake_core.config"):
        load_config(environ={"MC_USE_TENT": "1"})
        load_config(environ={"MC_USE_TENT": "1"})  # once per process
    assert [r.getMessage() for r in caplog.records] == [
        "MC_USE_TENT is set but not supported by mooncake-core "
        "(there is one engine here (no TENT runtime)); ignored"
    ]
    # every listed name is either mapped onto a real key or refused with a reason
    keys = {
        f"{s}.{k}"
        for s, sect in load_config(environ={}).to_dict().items()
        if isinstance(sect, dict)
        for k in sect
    } | set(load_config(environ={}).to_dict())
    for name, (key, why) in config.PUBLISHED_ENV.items():
        assert why, name
        assert key == "" or key in keys, name


def test_published_protocol_names_map_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from mooncake_core import config

    config._WARNED.clear()
    with caplog.at_level("WARNING", logger="mooncake_core.config"):
        assert load_config(environ={"MOONCAKE_PROTOCOL": "efa"}).protocol == "rdma"
        assert load_config(environ={"MOONCAKE_PROTOCOL": "nvlink"}).protocol == "auto"
        assert load_config(environ={"MOONCAKE_PROTOCOL": "RDMA"}).protocol == "rdma"
    assert [r.getMessage() for r in caplog.records] == [
        "protocol 'efa': mooncake-core has no such transport; using 'rdma' instead",
        "protocol 'nvlink': mooncake-core has no such transport; using 'auto' instead",
    ]


def test_defaults_sit_below_file_and_env(tmp_path: Path) -> None:
    d = {"store": {"client_ttl_s": 10.0, "placement": "random"}}
    assert load_config(environ={}, defaults=d).store.client_ttl_s == 10.0
    env = {"MOONCAKE_STORE_CLIENT_TTL_S": "3"}
    assert load_config(environ=env, defaults=d).store.client_ttl_s == 3.0
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"store": {"placement": "local-first"}}))
    cfg = load_config(f, environ={}, defaults=d)
    assert (cfg.store.placement, cfg.store.client_ttl_s) == ("local-first", 10.0)


def test_published_mooncake_json_keys(tmp_path: Path) -> None:
    from mooncake_core import config

    f = tmp_path / "mooncake.json"
    f.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": "127.0.0.1:50051",
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": "3.125GB",
                "local_buffer_size": "1GB",
                "enable_ssd_offload": True,
                "ssd_offload_path": str(tmp_path),
                "transfer_timeout": 12,
                "tenant_id": "default",
                "prefill_url": "127.0.0.1:13003",
            }
        )
    )
    cfg = load_config(f, environ={})
    assert cfg.store.ssd_path == str(tmp_path) and cfg.transfer.timeout_s == 12.0
    _, notes = config.published_file_keys({"prefill_url": "x", "tenant_id": "t"}, "m.json")
    assert notes == [
        "m.json: tenant_id is not supported by mooncake-core (tenants are not supported); ignored",
        "m.json: prefill_url is not supported by mooncake-core (a legacy PD-pipe key); ignored",
    ]
    f.write_text(json.dumps({"enable_ssd_offload": True}))
    with pytest.raises(ConfigError, match="enable_ssd_offload needs ssd_offload_path"):
        load_config(f, environ={})
