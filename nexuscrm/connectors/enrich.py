"""Post-claim enrichment: read the current remote state of a batch's records.

Port of the seed's ``BatchReadClient`` path: a pack whose callout profile maps
an object kind to a batch-read endpoint gets one read per (namespace, object
kind) per claimed batch — never one per item — and the remote fields are laid
over the event's payload fields. A pack with no eligible profile takes the
payload-only path (``NoopBatchReadClient``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import httpx

from nexuscrm.errors import NexusError
from nexuscrm.packs.model import CalloutProfile


class EnrichmentError(NexusError):
    """A batch read failed; ``retriable`` says whether a later attempt may succeed."""

    def __init__(self, message: str, *, retriable: bool) -> None:
        super().__init__(message)
        self.retriable = retriable


class BatchReadClient(Protocol):
    """Reads remote records: ``{source id: {field: value}}`` for the ids it found."""

    def batch_read(
        self, namespace: str, object_kind: str, source_ids: Sequence[str]
    ) -> dict[str, dict[str, Any]]:
        """One call for all ``source_ids`` of one object kind."""
        ...


class NoopBatchReadClient:
    """The payload-only path: enriches nothing."""

    def batch_read(
        self, namespace: str, object_kind: str, source_ids: Sequence[str]
    ) -> dict[str, dict[str, Any]]:
        """Always ``{}``."""
        return {}


_REF_RE = re.compile(r"[^A-Za-z0-9]+")


def resolve_credential(ref: str, env: Mapping[str, str] = os.environ) -> str:
    """The secret for credential reference ``ref``: env ``NEXUS_CREDENTIAL_<REF>``.

    ``ref`` is upper-cased with non-alphanumerics as ``_`` (``salesforce-prod`` ->
    ``NEXUS_CREDENTIAL_SALESFORCE_PROD``). Raises ``EnrichmentError`` (not
    retriable) naming the variable when it is unset: batch credentials are
    validated when a pool is built, so a missing one fails closed.
    """
    name = "NEXUS_CREDENTIAL_" + _REF_RE.sub("_", ref).strip("_").upper()
    value = env.get(name)
    if not value:
        raise EnrichmentError(f"credential reference {ref!r}: {name} is not set", retriable=False)
    return value


class HttpBatchReadClient:
    """Batch reads over HTTP for one callout profile.

    POST ``<endpoint><object_path_map[kind]>`` with ``{"namespace", "ids"}``;
    the answer is ``{"records": {id: {field: value}}}``. The credential (if
    any) goes as a bearer token. ``deadline`` bounds each call (the flow
    deadline also bounds every post-claim batch read, as in the seed).
    """

    def __init__(
        self,
        profile: CalloutProfile,
        client: httpx.Client,
        *,
        deadline: timedelta | None,
        env: Mapping[str, str] = os.environ,
    ) -> None:
        self.profile = profile
        self.client = client
        self.deadline = deadline
        self.headers = (
            {"Authorization": f"Bearer {resolve_credential(profile.credential_ref, env)}"}
            if profile.credential_ref
            else {}
        )

    def batch_read(
        self, namespace: str, object_kind: str, source_ids: Sequence[str]
    ) -> dict[str, dict[str, Any]]:
        """Read ``source_ids``; kinds the profile does not map are not read (``{}``).

        Raises ``EnrichmentError``: 429/5xx/timeouts/transport errors are
        retriable, other statuses and malformed answers are not.
        """
        path = self.profile.object_path_map.get(object_kind)
        if path is None or not source_ids:
            return {}
        url = self.profile.endpoint.rstrip("/") + "/" + path.lstrip("/")
        timeout = self.deadline.total_seconds() if self.deadline else None
        try:
            response = self.client.post(
                url,
                json={"namespace": namespace, "ids": list(source_ids)},
                headers=self.headers,
                timeout=timeout,
            )
        except httpx.TimeoutException as exc:
            raise EnrichmentError(f"batch read {url} timed out", retriable=True) from exc
        except httpx.TransportError as exc:
            raise EnrichmentError(f"batch read {url}: {exc}", retriable=True) from exc
        if response.status_code >= 300:
            raise EnrichmentError(
                f"batch read {url} answered {response.status_code}",
                retriable=response.status_code == 429 or response.status_code >= 500,
            )
        try:
            records = response.json()["records"]
            if not isinstance(records, dict):
                raise TypeError("records is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise EnrichmentError(
                f"batch read {url}: malformed answer ({exc})", retriable=False
            ) from exc
        return {str(k): dict(v) for k, v in records.items() if isinstance(v, dict)}


def client_for_profiles(
    profiles: Sequence[CalloutProfile],
    client: httpx.Client,
    *,
    deadline: timedelta | None,
    env: Mapping[str, str] = os.environ,
) -> BatchReadClient:
    """The batch-read client of a pack: its first profile with an object path map.

    No such profile -> the payload-only ``NoopBatchReadClient``. Credentials
    are resolved here, when the pool is built (``EnrichmentError`` if missing).
    """
    for profile in profiles:
        if profile.object_path_map:
            return HttpBatchReadClient(profile, client, deadline=deadline, env=env)
    return NoopBatchReadClient()
