"""Payload hash of a pack: a fingerprint of everything that apply would do.

The seed's ``packs.PackPayloadHash``: AppPack install rows record it, so a
re-apply of the same content is recognised and a changed pack is not.
"""

from __future__ import annotations

import hashlib
import json

from nexuscrm.packs.model import PackManifest


def canonical_payload(pack: PackManifest) -> str:
    """The canonical JSON text that :func:`payload_hash` digests.

    ``json.dumps(pack.model_dump(mode="json"), sort_keys=True,
    separators=(",", ":"), ensure_ascii=False)``. ``source`` is excluded by
    the model, so where a pack was loaded from never changes its hash; every
    other field, including defaults, is included. Object and field order is
    kept as declared (the SFDX loader sorts them by API name).
    """
    data = pack.model_dump(mode="json")
    # Connector keys came later: left out when empty so older packs keep their hash.
    for key in ("inbound_routes", "callout_profiles", "labels"):
        if not data[key]:
            del data[key]
    # Later still: namespaces, customizations, custom metadata records.
    if data.get("namespace") is None:
        data.pop("namespace", None)
    for obj in data.get("objects", ()):
        for key in ("customizations", "records"):
            if not obj.get(key):
                obj.pop(key, None)
        if obj.get("package_namespace") is None:
            obj.pop("package_namespace", None)
        for fld in obj.get("fields", ()):
            # Roll-up filter criteria came with roll-ups computed in views.
            summary = fld.get("summary")
            if summary is not None and not summary.get("filters"):
                summary.pop("filters", None)
            # Restricted picklists came later: left out when not restricted.
            if not fld.get("restricted"):
                fld.pop("restricted", None)
    for route in data.get("inbound_routes", ()):
        # Likewise a route's companion_pack (cross-pack routes came later still).
        if route.get("companion_pack") is None:
            route.pop("companion_pack", None)
    for profile in data.get("callout_profiles", ()):
        if not profile.get("projection_fields"):
            profile.pop("projection_fields", None)
    return json.dumps(
        data,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )


def payload_hash(pack: PackManifest) -> str:
    """Return the sha256 hex digest (64 lower-case hex chars) of the pack's
    :func:`canonical_payload`, UTF-8 encoded. Never raises for a valid manifest."""
    return hashlib.sha256(canonical_payload(pack).encode("utf-8")).hexdigest()
