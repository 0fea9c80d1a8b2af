"""Failures that always fit: a failure converter that bounds what a failure carries.

Temporal refuses a failure larger than its size limit (``Failure exceeds size
limit``); the activity's completion is then lost and the attempt dies on its
heartbeat or start-to-close timeout, with the real cause nowhere to be seen. A
database error's text can hold a whole statement and its parameters (a view
of hundreds of formula columns, a batch insert), and a failure carries its
cause chain and their stack traces too. :class:`BoundedFailureConverter` cuts
every message and stack trace of the chain, the chain's depth, and drops
details payloads over a budget, always keeping the head of the first cause
readable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import temporalio.api.failure.v1
from temporalio.client import Client
from temporalio.converter import DataConverter, DefaultFailureConverter, PayloadConverter

MAX_MESSAGE_CHARS = 4_000
"""Longest message of one failure in the chain."""
MAX_STACK_CHARS = 8_000
"""Longest stack trace of one failure in the chain (its tail, where the raise is, is kept)."""
MAX_CAUSE_DEPTH = 4
"""Causes kept below the top failure; deeper ones are cut, saying so."""
MAX_DETAILS_BYTES = 64 * 1024
"""Largest details payload of one failure; a larger one is dropped, saying so."""


def _cut_head(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


def _cut_tail(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"[{len(text) - limit} earlier characters cut] ...{text[-limit:]}"


def bound_failure(failure: temporalio.api.failure.v1.Failure, depth: int = 0) -> None:
    """Bound ``failure`` and its cause chain in place (see the module docstring).

    Messages keep their first :data:`MAX_MESSAGE_CHARS` characters, stack
    traces their last :data:`MAX_STACK_CHARS`; application details larger than
    :data:`MAX_DETAILS_BYTES` are dropped and the message says so; causes
    deeper than :data:`MAX_CAUSE_DEPTH` are removed and the last kept message
    says so.
    """
    failure.message = _cut_head(failure.message, MAX_MESSAGE_CHARS)
    failure.stack_trace = _cut_tail(failure.stack_trace, MAX_STACK_CHARS)
    if failure.HasField("application_failure_info"):
        details = failure.application_failure_info.details
        size = details.ByteSize()
        if size > MAX_DETAILS_BYTES:
            failure.application_failure_info.ClearField("details")
            failure.message += f" [details of {size} bytes dropped]"
    if failure.HasField("encoded_attributes") and (
        failure.encoded_attributes.ByteSize() > MAX_DETAILS_BYTES
    ):
        failure.ClearField("encoded_attributes")
    if not failure.HasField("cause"):
        return
    if depth >= MAX_CAUSE_DEPTH:
        failure.ClearField("cause")
        failure.message += " [deeper causes cut]"
        return
    bound_failure(failure.cause, depth + 1)


class BoundedFailureConverter(DefaultFailureConverter):
    """The SDK's default failure converter, then :func:`bound_failure` on the result."""

    def to_failure(
        self,
        exception: BaseException,
        payload_converter: PayloadConverter,
        failure: temporalio.api.failure.v1.Failure,
    ) -> None:
        """See ``temporalio.converter.FailureConverter.to_failure``; bounds the result."""
        super().to_failure(exception, payload_converter, failure)
        bound_failure(failure)


DATA_CONVERTER = dataclasses.replace(
    DataConverter.default, failure_converter_class=BoundedFailureConverter
)
"""The data converter of every client and worker of nexusctl."""


def with_bounded_failures(client: Client) -> Client:
    """``client`` itself if it already uses :data:`DATA_CONVERTER`'s failure
    converter, else a client on the same connection and namespace that does."""
    if isinstance(client.data_converter.failure_converter, BoundedFailureConverter):
        return client
    config: dict[str, Any] = dict(client.config())
    config["data_converter"] = DATA_CONVERTER
    return Client(**config)
