"""``mooncake.mooncake_store_service`` drop-in: the published store REST service, on our store.

The published wheel ships an aiohttp service (console script ``mc_store_rest_server``) that
sets up one ``MooncakeDistributedStore`` from a ``MooncakeConfig`` (``--config FILE`` or the
``MOONCAKE_*`` variables, ``-D key=value`` overrides), lends its segment to the pool and
answers HTTP requests. Ours serves the same routes with the same JSON bodies, bytes and
status codes on :class:`mooncake_core.compat.store.MooncakeDistributedStore`:

=====================================  =====================================================
``PUT /api/put``                       ``{"key": str, "value": str}``; the value's UTF-8
                                       bytes are stored. 200, 400 without key or value,
                                       500 when the store refuses (an empty value, say)
``GET /api/get/{key}``                 200 with the stored bytes
                                       (``application/octet-stream``), 404 missing
``GET /api/exist/{key}``               200 ``{"exists": bool}``
``DELETE /api/remove/{key}``           200; 500 when missing or leased (a read leases it)
``DELETE /api/remove_all``             200 ``{"status": "success removed N keys"}``
``POST /api/mount``                    ``{"size": int}``: lend more memory; 200 with
                                       ``segment_ids`` and ``allocated_size``
``POST /api/unmount``                  ``{"segment_ids": [...]}``: withdraw it again
``POST /api/mount_shm``                ``{"name": shm name, "size": n, "offset"?}``: lend
                                       that part of ``/dev/shm/<name>`` (the store's
                                       ``mount_segment``): 200 with ``segment_ids``; 500
                                       for a missing file or a bad range
``POST /api/unmount_shm``              ``{"segment_ids": [...]}``: withdraw them one by one
                                       (500 names the ids that failed)
``POST /api/reconfigure``              ``{"mode": "decode", "path", "size", "offset"?}``
                                       mounts the file in place of the previous ones
                                       (mounted first, then the old ones unmounted; a
                                       failed mount keeps them); ``{"mode": "prefill"}``
                                       unmounts them
``POST /api/unmount_local_disk``       ``{"grace_period_seconds": 0..3600}``; withdraws the
                                       SSD tier (200 without one too, as published)
=====================================  =====================================================

Bad input never takes the service down: a body that is not JSON, or a field of the wrong
type, answers the published status code with a one-line ``{"error": ...}`` of ours.

Differs on purpose: the HTTP port binds ``127.0.0.1`` unless ``--host`` (ours) names
another address (the published binds ``0.0.0.0``); a configuration the service cannot use,
a master that never answers within ``--max-wait-time``, or a port in use end the process
with one line and exit status 1, not a traceback; store calls run off the event loop, so a
slow one does not stall other requests.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from mooncake_core import __version__
from mooncake_core.compat.mooncake_config import MooncakeConfig
from mooncake_core.compat.store import MooncakeDistributedStore
from mooncake_core.config import parse_bool, parse_size
from mooncake_core.errors import ConfigError

__all__ = [
    "DEFAULT_HOST",
    "MooncakeConfig",
    "MooncakeDistributedStore",
    "MooncakeStoreService",
    "main",
    "parse_arguments",
    "sync_main",
]

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
#: the published request body limit (100 MiB): a value is sent as JSON text
_MAX_BODY = 100 << 20
#: the longest ``/api/unmount_local_disk`` grace period the published service accepts
_MAX_GRACE_S = 3600
_RETRY_S = 1.0
#: seconds between the lines that say the service still waits for its master
_PROGRESS_S = 5.0

Handler = Callable[[web.Request], Awaitable[web.Response]]


class _BadRequest(Exception):
    """A request the service answers with ``status`` and a one-line error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json(status: int, body: dict[str, Any]) -> web.Response:
    # json.dumps with its default separators: the published bodies, byte for byte
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json(status, {"error": message})


async def _body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object; :class:`_BadRequest` 500 (the published code) otherwise."""
    try:
        data = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadRequest(500, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _BadRequest(500, f"request body must be a JSON object, got {type(data).__name__}")
    return data


def _shm_file(name: object) -> str | None:
    """``/dev/shm/<name>`` for a bare shared-memory name (a leading ``/`` allowed)."""
    if not isinstance(name, str):
        return None
    bare = name.removeprefix("/")
    if bare in ("", ".", "..") or "/" in bare:
        return None
    return "/dev/shm/" + bare


def _ids(value: object) -> list[str]:
    """``segment_ids`` as a list (one id may be given as a string)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise _BadRequest(500, "segment_ids must be a string or a list of strings")


def _grace(data: dict[str, Any]) -> int:
    value = data.get("grace_period_seconds", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _BadRequest(500, "grace_period_seconds must be a non-negative integer")
    return value


class MooncakeStoreService:
    """One store client set up from a ``MooncakeConfig``, served over HTTP (published API).

    ``config_path``: a JSON config file; without it the ``MOONCAKE_*`` variables
    (:meth:`MooncakeConfig.load_from_env`). ``cli_config``: field overrides (strings are
    parsed as the field's type). ``host``: the address :meth:`start_http_service` binds.
    """

    def __init__(
        self,
        config_path: str | None = None,
        cli_config: dict[str, Any] | None = None,
        *,
        host: str = DEFAULT_HOST,
    ) -> None:
        self.store: MooncakeDistributedStore | None = None
        self.host = host
        self.port: int | None = None
        self.current_mode = "prefill"
        self.mounted_segment_ids: list[str] = []
        self.last_mount_info: dict[str, Any] = {}
        self._state_lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        if config_path:
            self.config = MooncakeConfig.from_file(config_path)
        else:
            self.config = MooncakeConfig.load_from_env()
        for key, value in (cli_config or {}).items():
            self._override(key, value)

    def _override(self, key: str, value: Any) -> None:
        fields = {f.name: f for f in dataclasses.fields(MooncakeConfig)}
        if key not in fields:
            logger.warning("-D%s: MooncakeConfig has no such field; ignored", key)
            return
        current = getattr(self.config, key)
        if isinstance(value, str):
            if key in ("global_segment_size", "local_buffer_size"):
                value = parse_size(value, key)
            elif isinstance(current, bool):
                value = parse_bool(value, key)
            elif key == "client_http_port":
                try:
                    value = int(value)
                except ValueError:
                    raise ConfigError(f"{key}: expected a port number, got {value!r}") from None
        setattr(self.config, key, value)

    def _setup_args(self) -> dict[str, Any]:
        c = self.config
        return {
            "local_hostname": c.local_hostname,
            "metadata_server": c.metadata_server,
            "global_segment_size": c.global_segment_size,
            "local_buffer_size": c.local_buffer_size,
            "protocol": c.protocol,
            "rdma_devices": c.device_name or "",
            "master_server_addr": c.master_server_address,
            "enable_ssd_offload": c.enable_ssd_offload,
            "ssd_offload_path": c.ssd_offload_path,
            "tenant_id": c.tenant_id,
        }

    # ------------------------------------------------------------------ start / stop
    async def start_store_service(
        self, max_wait_time: float = 60, shutdown_event: asyncio.Event | None = None
    ) -> bool:
        """Set the store up, retrying once a second for up to ``max_wait_time`` seconds
        (a master that is not up yet; a line every few seconds says so); False when time ran
        out or ``shutdown_event`` was set."""
        deadline = time.monotonic() + max_wait_time
        attempt, ret = 0, None
        while True:
            if shutdown_event is not None and shutdown_event.is_set():
                logger.info("store start cancelled")
                return False
            attempt += 1
            store = MooncakeDistributedStore()
            got = await self._setup_once(store, deadline, shutdown_event)
            if got is None:  # out of time or cancelled while that attempt ran
                break
            ret = got
            if ret == 0:
                self.store = store
                logger.info(
                    "store set up as %s (master %s)",
                    store.get_hostname(),
                    self.config.master_server_address,
                )
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                break
            logger.warning(
                "store setup failed (code %d): waiting for the master at %s, retry in %.1f s"
                " (%.0f s left)",
                ret,
                self.config.master_server_address,
                min(_RETRY_S, left),
                left,
            )
            try:
                waiter = (
                    shutdown_event.wait() if shutdown_event is not None else asyncio.sleep(left)
                )
                await asyncio.wait_for(waiter, min(_RETRY_S, left))
            except asyncio.TimeoutError:
                continue
        if shutdown_event is not None and shutdown_event.is_set():
            logger.info("store start cancelled")
        else:
            logger.error(
                "store setup: no success in %d attempt(s) within %g s (%s); giving up",
                attempt,
                max_wait_time,
                "the master never answered" if ret is None else f"last code {ret}",
            )
        return False

    async def _setup_once(
        self,
        store: MooncakeDistributedStore,
        deadline: float,
        shutdown_event: asyncio.Event | None,
    ) -> int | None:
        """One ``setup`` in a daemon thread (it may wait for the master longer than we
        may); its code, or None when the deadline passed or shutdown was asked first (a
        store that sets up after that is closed in its thread)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        abandoned = threading.Event()

        def deliver(code: int) -> None:  # on the loop, so ordered with abandoned.set()
            if abandoned.is_set():
                if code == 0:
                    threading.Thread(target=store.close, daemon=True).start()
            elif not done.done():
                done.set_result(code)

        def run() -> None:
            try:
                code = store.setup(self._setup_args())
            except Exception:  # noqa: BLE001 - reported as a failed attempt
                logger.exception("store setup raised")
                code = -1
            if abandoned.is_set():
                if code == 0:
                    store.close()
                return
            try:
                loop.call_soon_threadsafe(deliver, code)
            except RuntimeError:  # the loop is gone
                if code == 0:
                    store.close()

        threading.Thread(target=run, name="store-setup", daemon=True).start()
        began = time.monotonic()
        stop = asyncio.ensure_future(shutdown_event.wait()) if shutdown_event else None
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                waits: set[asyncio.Future[Any]] = {done} if stop is None else {done, stop}
                await asyncio.wait(
                    waits, timeout=min(_PROGRESS_S, left), return_when=asyncio.FIRST_COMPLETED
                )
                if done.done():
                    return done.result()
                if stop is not None and stop.done():
                    break
                logger.warning(
                    "still waiting for the store master at %s (%.0f s so far, %.0f s left)",
                    self.config.master_server_address,
                    time.monotonic() - began,
                    max(0.0, deadline - time.monotonic()),
                )
        finally:
            if stop is not None:
                stop.cancel()
        abandoned.set()
        if done.done() and done.result() == 0:
            await asyncio.to_thread(store.close)
        return None

    async def start_http_service(self, port: int = 8080) -> bool:
        """Serve the routes on ``self.host:port`` (port 0: a free one, kept in ``self.port``)."""
        routes: list[tuple[str, str, str, Handler]] = [
            ("POST", "/api/reconfigure", "RECONFIGURE", self.handle_reconfigure),
            ("POST", "/api/mount_shm", "MOUNT_SHM", self.handle_mount_shm),
            ("POST", "/api/unmount_shm", "UNMOUNT_SHM", self.handle_unmount_shm),
            ("POST", "/api/mount", "MOUNT", self.handle_mount),
            ("POST", "/api/unmount", "UNMOUNT", self.handle_unmount),
            (
                "POST",
                "/api/unmount_local_disk",
                "UNMOUNT_LOCAL_DISK",
                self.handle_unmount_local_disk,
            ),
            ("PUT", "/api/put", "PUT", self.handle_put),
            ("GET", "/api/get/{key}", "GET", self.handle_get),
            ("GET", "/api/exist/{key}", "EXIST", self.handle_exist),
            ("DELETE", "/api/remove/{key}", "REMOVE", self.handle_remove),
            ("DELETE", "/api/remove_all", "REMOVE_ALL", self.handle_remove_all),
        ]
        app = web.Application(client_max_size=_MAX_BODY)
        for method, path, name, handler in routes:
            if method == "GET":  # GET routes answer HEAD too, as aiohttp's web.get does
                app.router.add_get(path, _guarded(name, handler))
            else:
                app.router.add_route(method, path, _guarded(name, handler))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, port)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        bound = [a for a in runner.addresses if isinstance(a, tuple)]
        self.port = int(bound[0][1]) if bound else port
        logger.info("store REST API on http://%s:%d/api/", self.host, self.port)
        return True

    async def stop(self) -> None:
        """Stop serving and close the store."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        store, self.store = self.store, None
        if store is not None:
            ret = await asyncio.to_thread(store.close)
            if ret != 0:
                logger.warning("store close returned %d", ret)

    def _store(self) -> MooncakeDistributedStore:
        if self.store is None:
            raise _BadRequest(500, "the store is not set up")
        return self.store

    # ------------------------------------------------------------------ objects
    async def handle_put(self, request: web.Request) -> web.Response:
        """``PUT /api/put`` with ``{"key": ..., "value": ...}``."""
        data = await _body(request)
        key, value = data.get("key"), data.get("value")
        if not key or value is None:
            return _error(400, "Missing key or value")
        if not isinstance(key, str):
            raise _BadRequest(500, f"key must be a string, got {type(key).__name__}")
        if not isinstance(value, str):
            raise _BadRequest(500, f"value must be a string, got {type(value).__name__}")
        try:
            raw = value.encode()
        except UnicodeEncodeError as exc:
            raise _BadRequest(500, f"value is not encodable as UTF-8: {exc}") from None
        if await asyncio.to_thread(self._store().put, key, raw) != 0:
            return _error(500, "PUT operation failed")
        return _json(200, {"status": "success"})

    async def _exists(self, key: str) -> web.Response | None:
        """None when ``key`` exists; else the 404 / 500 answer."""
        found = await asyncio.to_thread(self._store().is_exist, key)
        if found == 0:
            return _error(404, "Key not found")
        if found < 0:
            return _error(500, "Exist check failed")
        return None

    async def handle_get(self, request: web.Request) -> web.Response:
        """``GET /api/get/{key}``: the stored bytes."""
        key = request.match_info["key"]
        missing = await self._exists(key)
        if missing is not None:
            return missing
        value = await asyncio.to_thread(self._store().get, key)
        if not value:
            # an empty answer is also what a get of a key removed meanwhile gives
            missing = await self._exists(key)
            if missing is not None:
                return missing
        return web.Response(status=200, body=bytes(value), content_type="application/octet-stream")

    async def handle_exist(self, request: web.Request) -> web.Response:
        """``GET /api/exist/{key}``: ``{"exists": bool}``."""
        found = await asyncio.to_thread(self._store().is_exist, request.match_info["key"])
        if found < 0:
            return _error(500, "Exist check failed")
        return _json(200, {"exists": found > 0})

    async def handle_remove(self, request: web.Request) -> web.Response:
        """``DELETE /api/remove/{key}`` (not forced: a leased key stays)."""
        if await asyncio.to_thread(self._store().remove, request.match_info["key"]) != 0:
            return _error(500, "Remove operation failed")
        return _json(200, {"status": "success"})

    async def handle_remove_all(self, request: web.Request) -> web.Response:
        """``DELETE /api/remove_all`` (leased keys stay)."""
        n = await asyncio.to_thread(self._store().remove_all)
        if n < 0:
            return _error(500, "RemoveAll operation failed")
        return _json(200, {"status": f"success removed {n} keys"})

    # ------------------------------------------------------------------ memory segments
    async def handle_mount(self, request: web.Request) -> web.Response:
        """``POST /api/mount`` ``{"size": n, "protocol"?, "location"?}``: lend more memory."""
        data = await _body(request)
        size = data.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            return _error(400, "Invalid size, must be a positive integer")
        protocol = data.get("protocol", self.config.protocol)
        location = data.get("location", "")
        if not isinstance(protocol, str) or not isinstance(location, str):
            raise _BadRequest(500, "protocol and location must be strings")
        res = await asyncio.to_thread(
            self._store().allocate_and_mount_segment, size, protocol, location
        )
        if res["ret"] != 0:
            return _error(500, f"Allocate and mount failed, ret={res['ret']}")
        return _json(
            200,
            {
                "status": "success",
                "segment_ids": list(res["segment_ids"]),
                "allocated_size": res["allocated_size"],
            },
        )

    async def handle_unmount(self, request: web.Request) -> web.Response:
        """``POST /api/unmount`` ``{"segment_ids": [...], "grace_period_seconds"?}``."""
        data = await _body(request)
        raw = data.get("segment_ids", [])
        if not raw:
            return _error(400, "Missing segment_ids")
        ids, grace = _ids(raw), _grace(data)
        ret = await asyncio.to_thread(self._store().unmount_and_free_segment, ids, grace)
        if ret != 0:
            return _error(500, f"Unmount and free failed, ret={ret}")
        return _json(200, {"status": "success"})

    # ------------------------------------------------------------------ file-backed segments
    def _mount_file(
        self, path: str, size: int, offset: int, protocol: str, location: str
    ) -> dict[str, Any]:
        """``size`` bytes of the file ``path`` from ``offset`` lent to the pool (the store's
        ``mount_segment``): ``{"ret": 0 or -1, "segment_ids": [...]}``."""
        return self._store().mount_segment(path, size, offset, protocol, location)

    def _unmount_file(self, segment_id: str, grace: int) -> int:
        return self._store().unmount_segment([segment_id], grace)

    async def handle_mount_shm(self, request: web.Request) -> web.Response:
        """``POST /api/mount_shm`` ``{"name": shm name, "size": n, "offset"?, ...}``."""
        data = await _body(request)
        path, size = _shm_file(data.get("name")), data.get("size")
        if not path or size is None:
            return _error(400, "Missing or invalid name or size")
        args = self._file_args(data, path, size)
        res = await asyncio.to_thread(self._mount_file, *args)
        if res["ret"] != 0:
            return _error(500, f"Mount failed, ret={res['ret']}")
        return _json(200, {"status": "success", "segment_ids": list(res["segment_ids"])})

    def _file_args(
        self, data: dict[str, Any], path: str, size: object
    ) -> tuple[str, int, int, str, str]:
        offset = data.get("offset", 0)
        protocol = data.get("protocol", self.config.protocol)
        location = data.get("location", "")
        for name, value in (("size", size), ("offset", offset)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _BadRequest(500, f"{name} must be a non-negative integer")
        if not isinstance(protocol, str) or not isinstance(location, str):
            raise _BadRequest(500, "protocol and location must be strings")
        assert isinstance(size, int) and isinstance(offset, int)
        return path, size, offset, protocol, location

    async def handle_unmount_shm(self, request: web.Request) -> web.Response:
        """``POST /api/unmount_shm`` ``{"segment_ids": [...]}``, one id at a time."""
        data = await _body(request)
        raw = data.get("segment_ids", [])
        if not raw:
            return _error(400, "Missing segment_ids")
        ids, grace = _ids(raw), _grace(data)
        failed: list[str] = []
        async with self._state_lock:
            for sid in ids:
                if await asyncio.to_thread(self._unmount_file, sid, grace) != 0:
                    failed.append(sid)
                elif sid in self.mounted_segment_ids:
                    self.mounted_segment_ids.remove(sid)
            if not self.mounted_segment_ids:
                self.current_mode = "prefill"
        if failed:
            return _json(
                500,
                {"error": "Unmount failed for one or more segments", "failed_segment_ids": failed},
            )
        return _json(200, {"status": "success"})

    async def handle_reconfigure(self, request: web.Request) -> web.Response:
        """``POST /api/reconfigure``: ``{"mode": "decode", "path", "size", ...}`` mounts a file
        segment in place of the previous ones; ``{"mode": "prefill"}`` unmounts them."""
        data = await _body(request)
        mode = data.get("mode", "")
        if not isinstance(mode, str):
            raise _BadRequest(500, f"mode must be a string, got {type(mode).__name__}")
        mode = mode.lower()
        if mode == "decode":
            return await self._to_decode(data)
        if mode == "prefill":
            return await self._to_prefill()
        return _error(400, "Invalid mode. Use 'decode' or 'prefill'")

    async def _to_decode(self, data: dict[str, Any]) -> web.Response:
        path, size = data.get("path"), data.get("size")
        if not path or size is None:
            return _error(400, "Missing path or size for decode mode")
        if not isinstance(path, str):
            raise _BadRequest(500, f"path must be a string, got {type(path).__name__}")
        args = self._file_args(data, path, size)
        async with self._state_lock:
            before = list(self.mounted_segment_ids)
            res = await asyncio.to_thread(self._mount_file, *args)
            if res["ret"] != 0:
                if before:  # the segments mounted before keep serving
                    return _json(
                        500,
                        {
                            "error": f"Mount failed, ret={res['ret']}; keeping previous decode"
                            " segments",
                            "mode": self.current_mode,
                        },
                    )
                self.current_mode = "prefill"
                self.mounted_segment_ids.clear()
                self.last_mount_info.clear()
                return _json(
                    500,
                    {
                        "error": f"Mount failed, ret={res['ret']}; rolled back to prefill",
                        "mode": self.current_mode,
                    },
                )
            stuck = [s for s in before if await asyncio.to_thread(self._unmount_file, s, 0) != 0]
            if stuck:
                logger.warning("reconfigure: could not unmount %s; kept for a later try", stuck)
            self.mounted_segment_ids = list(res["segment_ids"]) + stuck
            self.current_mode = "decode"
            path_, size_, offset, protocol, location = args
            self.last_mount_info = {
                "path": path_,
                "offset": offset,
                "size": size_,
                "protocol": protocol,
                "location": location,
            }
            ids = list(self.mounted_segment_ids)
        return _json(200, {"status": "success", "mode": "decode", "segment_ids": ids})

    async def _to_prefill(self) -> web.Response:
        async with self._state_lock:
            if self.mounted_segment_ids:
                ret = await asyncio.to_thread(
                    self._store().unmount_segment, list(self.mounted_segment_ids)
                )
                if ret != 0:
                    return _error(500, f"Unmount failed, ret={ret}")
                self.mounted_segment_ids.clear()
            self.current_mode = "prefill"
            self.last_mount_info.clear()
        return _json(200, {"status": "success", "mode": "prefill"})

    async def handle_unmount_local_disk(self, request: web.Request) -> web.Response:
        """``POST /api/unmount_local_disk`` ``{"grace_period_seconds": 0..3600}``."""
        try:
            data = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "Malformed JSON body")
        if not isinstance(data, dict):
            return _error(400, "Request body must be a JSON object")
        grace = data.get("grace_period_seconds", 0)
        if isinstance(grace, bool) or not isinstance(grace, int) or not 0 <= grace <= _MAX_GRACE_S:
            return _error(
                400,
                "Invalid grace_period_seconds, must be a non-negative integer no greater than"
                f" {_MAX_GRACE_S}",
            )
        store = self._store()
        # 0 without an SSD tier (nothing to withdraw), as published
        ret = await asyncio.to_thread(store.unmount_local_disk_segment, grace)
        if ret != 0:
            return _error(500, f"Unmount local disk failed, ret={ret}")
        return _json(200, {"status": "success"})


def _guarded(name: str, handler: Handler) -> Handler:
    """``handler`` whose refusals and failures become one-line JSON errors; timed at debug."""

    async def run(request: web.Request) -> web.Response:
        began = time.perf_counter()
        try:
            return await handler(request)
        except _BadRequest as exc:
            logger.warning("%s %s: %s", name, request.path, exc)
            return _error(exc.status, str(exc))
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the service
            logger.exception("%s %s failed", name, request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")
        finally:
            logger.debug("%s took %.2f ms", name, (time.perf_counter() - began) * 1000)

    return run


def parse_arguments() -> argparse.Namespace:
    """The published command line from :data:`sys.argv` (``--config``, ``-D key=value``,
    ``--port``, ``--max-wait-time``) plus ours: ``--host`` and ``--version``."""
    parser = argparse.ArgumentParser(
        prog="mc_store_rest_server",
        description="Mooncake store REST service (mooncake-core's implementation)",
    )
    parser.add_argument("--config", type=str, help="Mooncake config file (JSON)")
    parser.add_argument(
        "-D",
        "--define",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. -Dlocal_hostname=node1 (repeatable)",
    )
    parser.add_argument("--port", type=int, default=8080, help="HTTP port (default: 8080)")
    parser.add_argument(
        "--max-wait-time",
        type=float,
        default=60,
        help="seconds to keep retrying the store setup while the master is not up (default: 60)",
    )
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address the HTTP port binds (ours; default {DEFAULT_HOST}, the published"
        " binds 0.0.0.0)",
    )
    parser.add_argument("--version", action="version", version=f"mooncake-core {__version__}")
    return parser.parse_args()


def _defines(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            logger.warning("-D%s: not KEY=VALUE; ignored", item)
            continue
        out[key] = value
    return out


class _Fatal(Exception):
    """The service cannot run; the message is its one line."""


async def main() -> None:
    """Run the service with the command line in :data:`sys.argv` until SIGINT or SIGTERM
    (the published ``main``)."""
    args = parse_arguments()
    try:
        service = MooncakeStoreService(args.config, _defines(args.define), host=args.host)
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError
        raise _Fatal(f"configuration: {exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        if not await service.start_store_service(args.max_wait_time, stop):
            if stop.is_set():
                return
            raise _Fatal(
                f"the store could not be set up within {args.max_wait_time:g} s"
                f" (master {service.config.master_server_address})"
            )
        try:
            await service.start_http_service(args.port)
        except OSError as exc:
            raise _Fatal(
                f"cannot serve on {args.host}:{args.port}: {exc.strerror or exc}"
            ) from None
        logger.info("Mooncake store service is running")
        await stop.wait()
        logger.info("shutting down")
    finally:
        await service.stop()


def sync_main() -> int | None:
    """The ``mc_store_rest_server`` entry point: None after a clean stop, 1 with one line on
    stderr when the service cannot run."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
    try:
        asyncio.run(main())
    except _Fatal as exc:
        print(f"mc_store_rest_server: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return None


if __name__ == "__main__":
    sys.exit(sync_main())
