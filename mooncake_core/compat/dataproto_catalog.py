"""``mooncake.dataproto_catalog``: logical rows of immutable DataProto fragments.

A :class:`DataProtoCatalog` maps ``(partition, key)`` rows to a tag dict and, per field,
the ``(fragment_id, row)`` of an immutable DataProto ref stored with
:mod:`mooncake_core.compat.structured_object_store` (the fragment id is the ref's one
stage manifest key; handles are the JSON-safe dicts of ``export_dataproto_ref``). It
counts how many row fields point at each fragment and how many pinned reads hold it;
a fragment that is *managed* (published through :meth:`DataProtoCatalog.publish`) and
no longer referenced nor read is *retired*: its handle is returned in every result's
``retired_handles`` until :meth:`DataProtoCatalog.ack_retired` says its objects are gone.

:class:`DataProtoCatalogTransfer` puts data with a ``MooncakeBundleTransfer`` and
publishes it in a catalog reached through ``catalog_call(method, *args, **kwargs)`` (a
local object, or an actor); publications are idempotent per operation id and retried.

Behaviour, results, errors and messages follow the published 0.3.13 module; the handles
are the published JSON, so a catalog here and a client there (or the reverse) agree.
"""

from __future__ import annotations

import copy
import logging
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["DataProtoCatalog", "DataProtoCatalogTransfer"]

logger = logging.getLogger(__name__)

#: a field's place: (fragment id, row in that fragment)
_Location = tuple[str, int]


def _text(value: Any, name: str) -> str:
    if isinstance(value, str) and value:
        return value
    raise ValueError(f"{name} must be a non-empty string")


def _unique_names(values: Any, label: str) -> tuple[str, ...]:
    if isinstance(values, str):
        raise ValueError(f"{label} must be a sequence of non-empty strings")
    names = tuple(values)
    if not names or not all(isinstance(v, str) and v for v in names):
        raise ValueError(f"{label} must be non-empty strings")
    if len(set(names)) != len(names):
        raise ValueError(f"{label} must be unique")
    return names


def _copied_tags(
    tags: Sequence[Mapping[str, Any]] | None, count: int
) -> list[dict[str, Any]] | None:
    if tags is None:
        return None
    if len(tags) != count:
        raise ValueError("tags must have the same length as keys")
    for tag in tags:
        if not isinstance(tag, Mapping):
            raise TypeError("tags must be mappings")
    return [copy.deepcopy(dict(tag)) for tag in tags]


def _sos() -> Any:
    from mooncake_core.compat import structured_object_store

    return structured_object_store


def _canonical(handle: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(ref, handle)``: the imported ref and its handle re-exported (one spelling)."""
    sos = _sos()
    ref = sos.import_dataproto_ref(handle)
    return ref, sos.export_dataproto_ref(ref)


def _single_stage_key(ref: Any) -> str:
    (stage_ref,) = ref.stage_refs.values()
    return str(stage_ref.manifest_key)


def _fragment_of(
    handle: Mapping[str, Any], rows: int
) -> tuple[str, dict[str, Any], tuple[str, ...]]:
    ref, stored = _canonical(handle)
    if len(ref.stage_refs) != 1:
        raise ValueError("catalog fragments must contain exactly one DataProto stage")
    fragment_id = _text(_single_stage_key(ref), "manifest_key")
    if ref.batch_size != rows:
        raise ValueError(
            f"DataProto batch size {ref.batch_size!r} does not match {rows} logical keys"
        )
    return fragment_id, stored, _unique_names(ref.field_index, "field names")


def _fields_of(rows: Mapping[str, Mapping[str, Any]], keys: Sequence[str]) -> list[str]:
    seen: dict[str, None] = {}
    for key in keys:
        seen.update(dict.fromkeys(rows[key]["fields"]))
    return list(seen)


class DataProtoCatalog:
    """Logical ``(partition, key)`` rows and fields over immutable DataProto fragments.

    Not thread-safe: the host serializes calls (as the published one requires). Handles
    given to :meth:`update` stay metadata only; :meth:`publish` marks the fragment
    managed, so that it is retired once no row and no pinned read refers to it.
    """

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, dict[str, Any]]] = {}
        self._handles: dict[str, dict[str, Any]] = {}
        self._refs: dict[str, int] = {}
        self._readers: dict[str, int] = {}
        self._managed: set[str] = set()
        self._retired: dict[str, dict[str, Any]] = {}
        self._done: dict[str, dict[str, Any]] = {}
        self._pins: dict[int, tuple[str, ...]] = {}
        self._last_token = 0
        self._drained = False

    # -- writes ---------------------------------------------------------------------

    def update(
        self,
        partition: str,
        keys: Sequence[str],
        *,
        tags: Sequence[Mapping[str, Any]] | None = None,
        handle: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Merge ``tags`` into the rows and point their fields at ``handle``'s rows."""
        return self._write(partition, keys, tags, handle, managed=False)

    def publish(
        self,
        operation_id: str,
        partition: str,
        keys: Sequence[str],
        *,
        tags: Sequence[Mapping[str, Any]] | None = None,
        handle: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """:meth:`update` once per ``operation_id`` (a repeat returns the first result);
        the fragment becomes managed."""
        operation_id = _text(operation_id, "operation_id")
        if operation_id in self._done:
            return copy.deepcopy(self._done[operation_id])
        result = self._write(partition, keys, tags, handle, managed=handle is not None)
        self._done[operation_id] = copy.deepcopy(result)
        return result

    def ack_publication(self, operation_id: str) -> None:
        """Forget the remembered result of ``operation_id``."""
        self._done.pop(_text(operation_id, "operation_id"), None)

    def publish_append(
        self,
        operation_id: str,
        fragment_id: str,
        partition: str,
        keys: Sequence[str],
        *,
        previous_handle: Mapping[str, Any],
        handle: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Swap managed fragment ``fragment_id`` for its appended ``handle`` (once per
        ``operation_id``); a refusal is the result ``{"append_rejected": reason}``."""
        operation_id = _text(operation_id, "operation_id")
        if operation_id in self._done:
            return copy.deepcopy(self._done[operation_id])
        if self._drained:
            return self._refuse(operation_id, "DataProto catalog is drained")
        fragment_id = _text(fragment_id, "fragment_id")
        partition = _text(partition, "partition")
        keys = _unique_names(keys, "keys")
        old_ref, old_handle = _canonical(previous_handle)
        new_ref, new_handle = _canonical(handle)
        if fragment_id not in self._managed or self._handles.get(fragment_id) != old_handle:
            return self._refuse(operation_id, f"stale DataProto append handle: {fragment_id!r}")
        same_identity = (
            new_ref.batch_size == old_ref.batch_size == len(keys)
            and new_ref.partition == old_ref.partition == partition
            and new_ref._storage_group_id == old_ref._storage_group_id
        )
        if not same_identity:
            return self._refuse(operation_id, "appended DataProto handle changed fragment identity")
        old_fields = old_ref.field_index
        if any(new_ref.field_index.get(n) != loc for n, loc in old_fields.items()):
            return self._refuse(operation_id, "appended DataProto handle changed existing fields")
        added = [n for n in new_ref.field_index if n not in old_fields]
        rows = self._rows.get(partition, {})
        absent = [k for k in keys if k not in rows]
        if absent:
            return self._refuse(
                operation_id, f"keys not found in partition {partition!r}: {absent}"
            )
        for row, key in enumerate(keys):
            fields = rows[key]["fields"]
            for name in added:
                previous = fields.get(name)
                if previous is not None:
                    self._unref(previous[0])
                fields[name] = (fragment_id, row)
                self._refs[fragment_id] += 1
        self._handles[fragment_id] = new_handle
        result = {
            "keys": list(keys),
            "tags": [copy.deepcopy(rows[k]["tag"]) for k in keys],
            "fields": _fields_of(rows, keys),
            **self._retired_result(),
        }
        self._done[operation_id] = copy.deepcopy(result)
        return result

    def _refuse(self, operation_id: str, reason: str) -> dict[str, Any]:
        self._done[operation_id] = {"append_rejected": reason}
        return {"append_rejected": reason}

    def _write(
        self,
        partition: str,
        keys: Sequence[str],
        tags: Sequence[Mapping[str, Any]] | None,
        handle: Mapping[str, Any] | None,
        *,
        managed: bool,
    ) -> dict[str, Any]:
        if self._drained:
            raise RuntimeError("DataProto catalog is drained")
        partition = _text(partition, "partition")
        keys = _unique_names(keys, "keys")
        new_tags = _copied_tags(tags, len(keys))
        fragment = None if handle is None else _fragment_of(handle, len(keys))
        if new_tags is None and fragment is None:
            raise ValueError("catalog update requires tags or a DataProto handle")
        if fragment is not None:
            fid, stored, _ = fragment
            known = self._handles.get(fid)
            if known is not None and known != stored:
                raise ValueError(f"DataProto fragment id collision: {fid!r}")
            if known is not None and (fid in self._managed) is not managed:
                raise ValueError(f"DataProto fragment management mismatch: {fid!r}")
            if fid in self._retired:
                raise ValueError(f"DataProto fragment id is pending retirement: {fid!r}")

        rows = self._rows.get(partition, {})
        merged: list[dict[str, Any]] = []
        for row, key in enumerate(keys):
            tag = copy.deepcopy(rows[key]["tag"]) if key in rows else {}
            if new_tags is not None:
                tag.update(new_tags[row])
            merged.append(tag)
        answer_tags = copy.deepcopy(merged)

        rows = self._rows.setdefault(partition, {})
        if fragment is not None:
            fid, stored, _ = fragment
            self._handles.setdefault(fid, stored)
            self._refs.setdefault(fid, 0)
            if managed:
                self._managed.add(fid)
        for row, key in enumerate(keys):
            entry = rows.setdefault(key, {"tag": {}, "fields": {}})
            entry["tag"] = merged[row]
            if fragment is None:
                continue
            fid, _, names = fragment
            for name in names:
                here: _Location = (fid, row)
                previous = entry["fields"].get(name)
                if previous is not None and previous[0] == fid:
                    entry["fields"][name] = here  # the same fragment: no count changes
                    continue
                if previous is not None:
                    self._unref(previous[0])
                entry["fields"][name] = here
                self._refs[fid] += 1
        return {
            "keys": list(keys),
            "tags": answer_tags,
            "fields": _fields_of(rows, keys),
            **self._retired_result(),
        }

    # -- reads ----------------------------------------------------------------------

    def resolve(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        *,
        pin: bool = False,
    ) -> dict[str, Any]:
        """Where the ``fields`` of ``keys`` (in order) live: ``field_groups`` of fields
        sharing per-key locations, the fragment ``handles``, their merged ``meta_info``;
        with ``pin``, a ``read_token`` that keeps those fragments until released."""
        partition = _text(partition, "partition")
        keys = _unique_names(keys, "keys")
        rows = self._rows.get(partition, {})
        absent = [k for k in keys if k not in rows]
        if absent:
            raise ValueError(f"keys were not found in partition {partition!r}: {absent}")
        wanted = (
            _fields_of(rows, keys) if fields is None else list(_unique_names(fields, "field names"))
        )
        if not wanted:
            raise ValueError("requested keys do not contain any fields")
        for key in keys:
            not_ready = [n for n in wanted if n not in rows[key]["fields"]]
            if not_ready:
                raise ValueError(f"fields are not ready for key {key!r}: {not_ready}")
        groups: dict[tuple[_Location, ...], list[str]] = {}
        used: set[str] = set()
        for name in wanted:
            where = tuple(rows[k]["fields"][name] for k in keys)
            groups.setdefault(where, []).append(name)
            used.update(fid for fid, _ in where)
        handles = {fid: copy.deepcopy(self._handles[fid]) for fid in used}
        meta: dict[str, Any] = {}
        for stored in handles.values():
            for name, value in stored.get("meta_info", {}).items():
                if name in meta and meta[name] != value:
                    raise ValueError(f"conflicting DataProto meta_info value for {name!r}")
                meta[name] = copy.deepcopy(value)
        result: dict[str, Any] = {
            "keys": list(keys),
            "tags": [copy.deepcopy(rows[k]["tag"]) for k in keys],
            "fields": wanted,
            "field_groups": [
                {"fields": names, "locations": list(where)} for where, names in groups.items()
            ],
            "handles": handles,
            "meta_info": meta,
        }
        if pin:
            self._last_token += 1
            held = tuple(used)
            self._pins[self._last_token] = held
            for fid in held:
                self._readers[fid] = self._readers.get(fid, 0) + 1
            result["read_token"] = self._last_token
        return result

    def release_read(self, token: int) -> dict[str, Any]:
        """End the pinned read ``token`` (again: nothing happens); fragments it kept
        alone are retired."""
        held = self._pins.pop(token, None)
        for fid in held or ():
            self._readers[fid] -= 1
            if self._readers[fid]:
                continue
            del self._readers[fid]
            if fid not in self._refs:
                self._retire(fid)
        return self._retired_result()

    def list(self, partition: str | None = None) -> dict[str, dict[str, Any]]:
        """``{partition: {key: tag}}``, for one partition or all."""
        if partition is None:
            names = list(self._rows)
        else:
            partition = _text(partition, "partition")
            names = [partition] if partition in self._rows else []
        return {
            p: {key: copy.deepcopy(entry["tag"]) for key, entry in self._rows[p].items()}
            for p in names
        }

    # -- lifetime -------------------------------------------------------------------

    def remove(self, partition: str, keys: Sequence[str]) -> dict[str, Any]:
        """Drop rows (unknown ones are skipped); the managed fragments this frees come
        back in ``retired_handles`` (clean them with ``cleanup_dataproto``)."""
        partition = _text(partition, "partition")
        keys = _unique_names(keys, "keys")
        rows = self._rows.get(partition)
        if rows is None:
            return self._retired_result()
        for key in keys:
            entry = rows.pop(key, None)
            for fid, _ in (entry or {"fields": {}})["fields"].values():
                self._unref(fid)
        if not rows:
            del self._rows[partition]
        return self._retired_result()

    def drain(self) -> dict[str, Any]:
        """Retire every managed fragment and forget everything; no writes after this."""
        if self._pins:
            raise RuntimeError(
                f"cannot drain DataProto catalog with {len(self._pins)} active read(s)"
            )
        for fid in self._managed:
            self._retired[fid] = self._handles[fid]
        for table in (self._rows, self._handles, self._refs, self._readers, self._done):
            table.clear()
        self._managed.clear()
        self._drained = True
        return self._retired_result()

    def ack_retired(self, handles: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Forget retired fragments whose store objects are gone (given by handle)."""
        for given in handles:
            ref, canonical = _canonical(given)
            match = next((f for f, h in self._retired.items() if h == canonical), None)
            if match is not None:
                del self._retired[match]
            elif len(ref.stage_refs) == 1 and _single_stage_key(ref) in self._retired:
                raise ValueError(f"retired DataProto fragment mismatch: {_single_stage_key(ref)!r}")
        return self._retired_result()

    def _unref(self, fid: str) -> None:
        self._refs[fid] -= 1
        if self._refs[fid]:
            return
        del self._refs[fid]
        if not self._readers.get(fid, 0):
            self._retire(fid)

    def _retire(self, fid: str) -> None:
        stored = self._handles.pop(fid)
        if fid in self._managed:
            self._managed.discard(fid)
            self._retired[fid] = stored

    def _retired_result(self) -> dict[str, Any]:
        return {"retired_handles": [copy.deepcopy(h) for h in self._retired.values()]}


class DataProtoCatalogTransfer:
    """Puts DataProto fragments with ``transfer`` (a ``MooncakeBundleTransfer``) and
    publishes them through ``catalog_call(method, *args, **kwargs)``; cleans up what the
    catalog retires. Failed publications, acknowledgements and result releases are kept
    and retried on the next call (``close()`` insists)."""

    _RESULTS_ATTR = "_mooncake_catalog_results"

    def __init__(self, transfer: Any, catalog_call: Callable[..., Any]) -> None:
        self.transfer = transfer
        self._catalog_call = catalog_call
        self._lock = threading.RLock()
        self._pending: dict[str, list[Any]] = {"publish": [], "ack": [], "results": []}

    def put(
        self,
        data: Any,
        *,
        partition: str,
        keys: Sequence[str],
        tags: Sequence[Mapping[str, Any]] | None = None,
        **put_kwargs: Any,
    ) -> dict[str, Any]:
        """Store ``data`` (one row per key) as a fresh fragment and publish it with
        ``tags``; ``data=None`` publishes tags only."""
        self._flush_acks()
        self._flush_publications(strict=True)
        partition = _text(partition, "partition")
        names = _unique_names(keys, "keys")
        new_tags = _copied_tags(tags, len(names))
        if data is None and new_tags is None:
            raise ValueError("catalog update requires tags or DataProto data")
        handle = None
        if data is not None:
            self._check_rows(data, names)
            stored = self.transfer.put(data, type="dataproto", partition=partition, **put_kwargs)
            handle = _sos().export_dataproto_ref(stored)
        publication = {
            "operation_id": uuid.uuid4().hex,
            "method": "publish",
            "args": (partition, names),
            "kwargs": {"tags": new_tags, "handle": handle},
        }
        return self._publish_twice(publication, "Retrying DataProto Catalog publication")

    def append(
        self,
        fragment_id: str,
        handle: Mapping[str, Any],
        data: Any,
        *,
        partition: str,
        keys: Sequence[str],
        stage: str,
        **append_kwargs: Any,
    ) -> dict[str, Any]:
        """Append ``data``'s fields to managed fragment ``fragment_id`` (as ``stage``);
        the catalog then owns the appended fragment instead."""
        self._flush_acks()
        self._flush_publications(strict=True)
        fragment_id = _text(fragment_id, "fragment_id")
        partition = _text(partition, "partition")
        names = _unique_names(keys, "keys")
        if append_kwargs.get("overwrite"):
            raise ValueError("catalog append does not support overwrite")
        self._check_rows(data, names)
        old_ref, old_handle = _canonical(handle)
        if old_ref.partition != partition:
            raise ValueError("DataProto handle partition does not match Catalog partition")
        plan = self._catalog_call("resolve", partition, names, list(old_ref.field_index))
        if plan["handles"].get(fragment_id) != old_handle:
            raise ValueError(f"stale DataProto append handle: {fragment_id!r}")
        appended = self.transfer.append_dataproto_fields(
            old_handle, data, stage=stage, **append_kwargs
        )
        publication = {
            "operation_id": uuid.uuid4().hex,
            "method": "publish_append",
            "args": (fragment_id, partition, names),
            "kwargs": {
                "previous_handle": old_handle,
                "handle": _sos().export_dataproto_ref(appended),
            },
        }
        result = self._publish_twice(publication, "Retrying DataProto Catalog append publication")
        if result.get("append_rejected") is not None:
            raise ValueError(result["append_rejected"])
        return result

    def resolve(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """A pinned :meth:`DataProtoCatalog.resolve`; end it with :meth:`release_read`."""
        result: dict[str, Any] = self._catalog_call("resolve", partition, keys, fields, pin=True)
        return result

    def release_read(self, token: int) -> None:
        self._clean_retired(self._catalog_call("release_read", token))

    def attach_results(self, output: Any, results: Sequence[Any]) -> None:
        """Remember on ``output`` the read results whose buffers it borrows."""
        setattr(output, self._RESULTS_ATTR, list(results))

    def release_result(self, output: Any) -> None:
        """Release the results attached to ``output``."""
        attached = getattr(output, self._RESULTS_ATTR, ()) or ()
        setattr(output, self._RESULTS_ATTR, [])
        self.discard_results(attached)

    def discard_results(self, results: Sequence[Any], *, strict: bool = False) -> None:
        """``transfer.release_result`` each (and earlier failures), two tries each."""
        self._retry(
            "results",
            results,
            self.transfer.release_result,
            "release DataProto read buffer",
            tries=2,
            strict=strict,
        )

    def list(self, partition: str | None = None) -> dict[str, dict[str, Any]]:
        result: dict[str, dict[str, Any]] = self._catalog_call("list", partition)
        return result

    def remove(self, partition: str, keys: Sequence[str]) -> None:
        self._clean_retired(self._catalog_call("remove", partition, keys))

    def drain(self) -> None:
        """Publish what is pending, drain the catalog, clean up what it retires."""
        for last in (False, True):
            try:
                self._flush_publications(strict=True)
                self._clean_retired(self._catalog_call("drain"), strict=True)
                return
            except Exception:
                if last:
                    raise
                logger.exception("Retrying DataProto Catalog drain")

    def close(self) -> None:
        """Retry everything pending; raise if something still fails."""
        self.discard_results((), strict=True)
        self._flush_publications(strict=True)
        self._flush_acks(strict=True)

    # -- helpers ----------------------------------------------------------------------

    @staticmethod
    def _check_rows(data: Any, keys: Sequence[str]) -> None:
        if len(data) != len(keys):
            raise ValueError(
                f"DataProto batch size {len(data)} does not match {len(keys)} logical keys"
            )

    def _publish_twice(self, publication: dict[str, Any], retry_message: str) -> dict[str, Any]:
        try:
            return self._publish(publication)
        except Exception:
            logger.exception(retry_message)
        try:
            return self._publish(publication)
        except Exception:
            with self._lock:
                self._pending["publish"].append(publication)
            raise

    def _publish(self, publication: Mapping[str, Any]) -> dict[str, Any]:
        op = publication["operation_id"]
        kwargs = publication["kwargs"]
        result: dict[str, Any] = self._catalog_call(
            publication["method"], op, *publication["args"], **kwargs
        )
        if publication["method"] == "publish_append" and result.get("append_rejected"):
            self.transfer.cleanup_dataproto_append(kwargs["previous_handle"], kwargs["handle"])
        self._clean_retired(result)
        try:
            self._catalog_call("ack_publication", op)
        except Exception:
            logger.exception("Failed to acknowledge DataProto Catalog publication")
            with self._lock:
                if op not in self._pending["ack"]:
                    self._pending["ack"].append(op)
        return result

    def _clean_retired(self, result: Mapping[str, Any], *, strict: bool = False) -> None:
        cleaned, failed = [], 0
        for handle in result.get("retired_handles", ()):
            try:
                self.transfer.cleanup_dataproto(handle)
            except Exception:
                failed += 1
                logger.exception("Failed to clean up retired DataProto fragment")
            else:
                cleaned.append(handle)
        if cleaned:
            try:
                self._catalog_call("ack_retired", cleaned)
            except Exception:
                logger.exception("Failed to acknowledge retired DataProto fragments")
                if strict:
                    raise
        if strict and failed:
            raise RuntimeError(f"failed to clean up {failed} retired DataProto fragment(s)")

    def _flush_acks(self, *, strict: bool = False) -> None:
        self._retry(
            "ack",
            (),
            lambda op: self._catalog_call("ack_publication", op),
            "acknowledge DataProto Catalog publication",
            strict=strict,
        )

    def _flush_publications(self, *, strict: bool = False) -> None:
        self._retry(
            "publish", (), self._publish, "publish pending DataProto fragment", strict=strict
        )

    def _retry(
        self,
        queue: str,
        more: Sequence[Any],
        action: Callable[[Any], Any],
        what: str,
        *,
        tries: int = 1,
        strict: bool = False,
    ) -> None:
        with self._lock:
            todo = [*self._pending[queue], *more]
            self._pending[queue] = []
        for _ in range(tries):
            left = []
            for item in todo:
                try:
                    action(item)
                except Exception:
                    logger.exception("Failed to %s", what)
                    left.append(item)
            todo = left
        with self._lock:
            self._pending[queue].extend(todo)
            count = len(self._pending[queue])
        if strict and count:
            raise RuntimeError(f"failed to {what} for {count} item(s)")
