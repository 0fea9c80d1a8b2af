"""nexuscrm.connectors.knobs: env knobs, queue profiles, restart backoff, fingerprints.

Expected numbers are worked out by hand from the seed's
``connectorInbound*FromEnv``, ``connectorInboundWorkerQueueProfile``,
``connectorInboundWorkItemWorkerQueueProfile``, ``connectorInboundRestartBackoff``
and ``workerFingerprint``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from nexuscrm.connectors import knobs
from nexuscrm.connectors.knobs import (
    QUEUE_CLASS_BULK as B,
)
from nexuscrm.connectors.knobs import (
    QUEUE_CLASS_DEFAULT as D,
)
from nexuscrm.connectors.knobs import (
    QUEUE_CLASS_INTERACTIVE as I,
)
from nexuscrm.connectors.knobs import (
    ConnectorKnobs,
    QueueProfile,
    RestartBackoff,
)

RESERVED = knobs.QUEUE_PROFILE_RESERVED
HEAVY = knobs.QUEUE_PROFILE_DEFAULT_HEAVY
PREFIX = "connector inbound supervisor: "


def warnings_of(logs: Sequence[Mapping[str, Any]]) -> list[str]:
    return [entry["event"] for entry in logs if entry["log_level"] == "warning"]


# --- normalize_queue_class ----------------------------------------------------


def test_normalize_queue_class() -> None:
    assert knobs.normalize_queue_class(" Bulk ") == "bulk"
    assert knobs.normalize_queue_class("INTERACTIVE") == "interactive"
    assert knobs.normalize_queue_class("default") == "default"
    with pytest.raises(ValueError, match="'urgent'"):
        knobs.normalize_queue_class("urgent")
    with pytest.raises(ValueError, match="unknown queue class ''"):
        knobs.normalize_queue_class("")


# --- workers_per_pack -----------------------------------------------------------

W = knobs.ENV_WORKERS_PER_PACK


def test_workers_per_pack_env_name() -> None:
    assert W == "NEXUSCRM_CONNECTOR_INBOUND_WORKERS_PER_PACK"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, 8), ("", 8), ("   ", 8), ("1", 1), (" 4 ", 4), ("+3", 3), ("8", 8)],
)
def test_workers_per_pack_quiet(raw: str | None, expected: int) -> None:
    env = {} if raw is None else {W: raw}
    with capture_logs() as logs:
        assert knobs.workers_per_pack(env) == expected
    assert warnings_of(logs) == []


@pytest.mark.parametrize("raw", ["0", "-2", "abc", "4.0", "1_0", "99999999999999999999"])
def test_workers_per_pack_invalid_uses_default_with_warning(raw: str) -> None:
    with capture_logs() as logs:
        assert knobs.workers_per_pack({W: raw}) == 8
    assert warnings_of(logs) == [f'{PREFIX}invalid {W}="{raw}"; using default 8']
    assert logs[0]["value"] == raw


def test_workers_per_pack_clamps_to_128() -> None:
    with capture_logs() as logs:
        assert knobs.workers_per_pack({W: "500"}) == 128
    assert warnings_of(logs) == [f"{PREFIX}{W}=500 exceeds max 128; clamping"]


@pytest.mark.parametrize("value", [9, 16, 128])
def test_workers_per_pack_unsafe_high_is_kept_with_warning(value: int) -> None:
    with capture_logs() as logs:
        assert knobs.workers_per_pack({W: str(value)}) == value
    assert warnings_of(logs) == [
        f"{PREFIX}unsafe high {W}={value} exceeds conservative default 8; worker count is "
        "preserved for compatibility, and processing budget remains controlled by "
        "NEXUSCRM_CONNECTOR_INBOUND_MAX_PROCESSING_ROWS"
    ]


# --- max_processing_rows ----------------------------------------------------------

R = knobs.ENV_MAX_PROCESSING_ROWS


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        (-3, 100),
        (0, 100),
        (1, 100),  # lone worker, one batch of 100
        (2, 105),  # 5 + 100
        (3, 130),  # 5 + 100 + 25
        (4, 155),  # 5 + 100 + 2*25
        (8, 310),  # 2*5 + 2*100 + 4*25
        (12, 465),  # 3*5 + 3*100 + 6*25
        (16, 512),  # 4*5 + 4*100 + 8*25 = 620, capped
        (128, 512),
    ],
)
def test_max_processing_rows_for_workers(workers: int, expected: int) -> None:
    assert knobs.max_processing_rows_for_workers(workers) == expected


@given(st.integers(min_value=1, max_value=127))
def test_max_processing_rows_for_workers_grows_and_is_bounded(n: int) -> None:
    here = knobs.max_processing_rows_for_workers(n)
    assert 1 <= here <= knobs.MAX_PROCESSING_ROWS
    assert knobs.max_processing_rows_for_workers(n + 1) >= here
    # never below one full batch per worker of the default (reserved) layout, unless capped
    batches = sum(knobs.worker_queue_profile(n, i, RESERVED).batch_size for i in range(n))
    assert here == min(512, batches)


def test_max_processing_rows_default_is_derived_and_not_explicit() -> None:
    with capture_logs() as logs:
        assert knobs.max_processing_rows(8, {}) == (310, False)
        assert knobs.max_processing_rows(4, {R: "  "}) == (155, False)
    assert warnings_of(logs) == []


def test_max_processing_rows_default_with_unsafe_workers_warns() -> None:
    with capture_logs() as logs:
        assert knobs.max_processing_rows(12, {}) == (465, False)
    assert warnings_of(logs) == [
        f"{PREFIX}unsafe high {W}=12 is using legacy derived processing budget 465; set "
        f"{R} explicitly to decouple worker fan-out from processing budget"
    ]


@pytest.mark.parametrize(("raw", "expected"), [("1", 1), ("200", 200), ("512", 512)])
def test_max_processing_rows_explicit(raw: str, expected: int) -> None:
    with capture_logs() as logs:
        assert knobs.max_processing_rows(16, {R: raw}) == (expected, True)
    assert warnings_of(logs) == []


def test_max_processing_rows_clamps_to_512_and_stays_explicit() -> None:
    with capture_logs() as logs:
        assert knobs.max_processing_rows(8, {R: "4096"}) == (512, True)
    assert warnings_of(logs) == [f"{PREFIX}{R}=4096 exceeds max 512; clamping"]


@pytest.mark.parametrize("raw", ["0", "-1", "lots", "1e3"])
def test_max_processing_rows_invalid_uses_derived_default(raw: str) -> None:
    with capture_logs() as logs:
        assert knobs.max_processing_rows(2, {R: raw}) == (105, False)
    assert warnings_of(logs) == [f'{PREFIX}invalid {R}="{raw}"; using default 105']


# --- queue_profile_mode -----------------------------------------------------------

Q = knobs.ENV_QUEUE_PROFILE


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, RESERVED),
        ("", RESERVED),
        ("reserved", RESERVED),
        (" RESERVED ", RESERVED),
        ("default-heavy", HEAVY),
        ("Default-Heavy", HEAVY),
    ],
)
def test_queue_profile_mode(raw: str | None, expected: str) -> None:
    with capture_logs() as logs:
        assert knobs.queue_profile_mode({} if raw is None else {Q: raw}) == expected
    assert warnings_of(logs) == []


def test_queue_profile_mode_invalid_falls_back_to_reserved() -> None:
    with capture_logs() as logs:
        assert knobs.queue_profile_mode({Q: " Bulk-Heavy "}) == RESERVED
    # the seed logs the trimmed, lower-cased value
    assert warnings_of(logs) == [f'{PREFIX}invalid {Q}="bulk-heavy"; using reserved']


# --- stage_timing -----------------------------------------------------------------

S = knobs.ENV_STAGE_TIMING


@pytest.mark.parametrize("raw", ["1", "t", "T", "TRUE", "true", "True", " true "])
def test_stage_timing_true(raw: str) -> None:
    assert knobs.stage_timing({S: raw}) is True


@pytest.mark.parametrize("raw", [None, "", "0", "f", "F", "FALSE", "false", "False"])
def test_stage_timing_false(raw: str | None) -> None:
    with capture_logs() as logs:
        assert knobs.stage_timing({} if raw is None else {S: raw}) is False
    assert warnings_of(logs) == []


@pytest.mark.parametrize("raw", ["yes", "on", "tRUE", "2", "TrUe"])
def test_stage_timing_invalid_is_off_with_warning(raw: str) -> None:
    with capture_logs() as logs:
        assert knobs.stage_timing({S: raw}) is False
    assert warnings_of(logs) == [f'{PREFIX}invalid {S}="{raw}"; stage timing disabled']


# --- flow_deadline ----------------------------------------------------------------

F = knobs.ENV_FLOW_DEADLINE_MS


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, timedelta(minutes=10)),
        ("", timedelta(minutes=10)),
        ("1500", timedelta(milliseconds=1500)),
        ("60000", timedelta(minutes=1)),
        ("0", None),
        ("-5", None),
    ],
)
def test_flow_deadline(raw: str | None, expected: timedelta | None) -> None:
    with capture_logs() as logs:
        assert knobs.flow_deadline({} if raw is None else {F: raw}) == expected
    assert warnings_of(logs) == []


@pytest.mark.parametrize("raw", ["soon", "1.5", "10s", "9223372036855"])
def test_flow_deadline_invalid_uses_default_with_warning(raw: str) -> None:
    with capture_logs() as logs:
        assert knobs.flow_deadline({F: raw}) == timedelta(minutes=10)
    assert warnings_of(logs) == [f'{PREFIX}invalid {F}="{raw}"; using default flow deadline 10m0s']


def test_flow_deadline_largest_go_duration_is_kept() -> None:
    assert knobs.flow_deadline({F: "9223372036854"}) == timedelta(milliseconds=9223372036854)


# --- queue profiles ---------------------------------------------------------------

LAT = QueueProfile((I, D), (), 5)
BULK = QueueProfile((B,), (), 100)
ALL = QueueProfile((I, D, B), (), 25)
ALL_PREF_LAT = QueueProfile((I, D, B), (I, D), 25)
ALL_PREF_BULK = QueueProfile((I, D, B), (B,), 25)
LONE = QueueProfile((), (), 100)

# Worked out by hand from connectorInboundWorkerQueueProfile:
#   latency = max(1, n // 4); reserved: bulk = max(1, n // 4).
RESERVED_EXPECTED = {
    1: [LONE],
    2: [LAT, BULK],
    3: [LAT, BULK, ALL],
    4: [LAT, BULK, ALL, ALL],
    8: [LAT] * 2 + [BULK] * 2 + [ALL] * 4,
    16: [LAT] * 4 + [BULK] * 4 + [ALL] * 8,
}
HEAVY_EXPECTED = {
    1: [LONE],
    2: [LAT, ALL],
    3: [LAT, ALL, ALL],
    4: [LAT, ALL, ALL, ALL],
    8: [LAT] * 2 + [ALL] * 6,
    16: [LAT] * 4 + [ALL] * 12,
}
# connectorInboundWorkItemWorkerQueueProfile adds preferred classes, default-heavy only:
# n == 2 -> the all-class worker prefers interactive+default; else the last
# max(1, n // 4) ordinals prefer bulk.
HEAVY_WORK_ITEM_EXPECTED = {
    1: [LONE],
    2: [LAT, ALL_PREF_LAT],
    3: [LAT, ALL, ALL_PREF_BULK],
    4: [LAT, ALL, ALL, ALL_PREF_BULK],
    8: [LAT] * 2 + [ALL] * 4 + [ALL_PREF_BULK] * 2,
    16: [LAT] * 4 + [ALL] * 8 + [ALL_PREF_BULK] * 4,
}


@pytest.mark.parametrize("n", sorted(RESERVED_EXPECTED))
def test_worker_queue_profile_reserved(n: int) -> None:
    got = [knobs.worker_queue_profile(n, i, RESERVED) for i in range(n)]
    assert got == RESERVED_EXPECTED[n]
    # reserved mode never sets preferred classes
    assert [knobs.work_item_worker_queue_profile(n, i, RESERVED) for i in range(n)] == got


@pytest.mark.parametrize("n", sorted(HEAVY_EXPECTED))
def test_worker_queue_profile_default_heavy(n: int) -> None:
    assert [knobs.worker_queue_profile(n, i, HEAVY) for i in range(n)] == HEAVY_EXPECTED[n]
    got = [knobs.work_item_worker_queue_profile(n, i, HEAVY) for i in range(n)]
    assert got == HEAVY_WORK_ITEM_EXPECTED[n]


def test_sixteen_default_heavy_workers_split_4_8_4() -> None:
    profiles = [knobs.work_item_worker_queue_profile(16, i, HEAVY) for i in range(16)]
    latency_only = [p for p in profiles if p.queue_classes == (I, D)]
    affinity_free = [
        p for p in profiles if len(p.queue_classes) == 3 and not p.preferred_queue_classes
    ]
    bulk_preferred = [p for p in profiles if p.preferred_queue_classes == (B,)]
    assert (len(latency_only), len(affinity_free), len(bulk_preferred)) == (4, 8, 4)
    assert profiles[12:] == bulk_preferred  # the bulk floor sits at the top ordinals


def test_unknown_mode_lays_out_like_reserved() -> None:
    for i in range(8):
        assert knobs.worker_queue_profile(8, i, "whatever") == RESERVED_EXPECTED[8][i]


def test_queue_profile_labels() -> None:
    assert LONE.queue_classes_label == "all"
    assert LONE.preferred_queue_classes_label == "none"
    assert LONE.effective_queue_classes == (I, D, B)
    assert ALL_PREF_LAT.queue_classes_label == "interactive,default,bulk"
    assert ALL_PREF_LAT.preferred_queue_classes_label == "interactive,default"


@pytest.mark.parametrize(("n", "ordinal"), [(4, 4), (4, -1), (1, 1), (0, 1)])
def test_queue_profile_ordinal_out_of_range(n: int, ordinal: int) -> None:
    with pytest.raises(ValueError, match=f"ordinal {ordinal}"):
        knobs.worker_queue_profile(n, ordinal, RESERVED)


@given(
    st.integers(min_value=1, max_value=128).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(min_value=0, max_value=n - 1))
    ),
    st.sampled_from([RESERVED, HEAVY]),
)
def test_queue_profile_properties(n_and_ordinal: tuple[int, int], mode: str) -> None:
    n, ordinal = n_and_ordinal
    profile = knobs.work_item_worker_queue_profile(n, ordinal, mode)
    assert profile.effective_queue_classes  # never empty
    assert set(profile.effective_queue_classes) <= set(knobs.QUEUE_CLASSES)
    if n == 1:
        assert profile.queue_classes == ()  # the seed's "all" (lone worker)
    else:
        assert len(profile.queue_classes) >= 1
    assert profile.batch_size in (5, 25, 100)
    assert set(profile.preferred_queue_classes) <= set(profile.effective_queue_classes)
    if mode == RESERVED:
        assert profile.preferred_queue_classes == ()


@given(st.integers(min_value=2, max_value=128), st.sampled_from([RESERVED, HEAVY]))
def test_every_class_is_served_by_every_pool(n: int, mode: str) -> None:
    profiles = [knobs.work_item_worker_queue_profile(n, i, mode) for i in range(n)]
    served = {c for p in profiles for c in p.queue_classes}
    assert served == set(knobs.QUEUE_CLASSES)
    latency = sum(1 for p in profiles if p.queue_classes == (I, D))
    assert latency == max(1, n // 4)


# --- restart backoff --------------------------------------------------------------


def seconds(values: list[timedelta]) -> list[float]:
    return [v.total_seconds() for v in values]


def test_restart_backoff_sequence() -> None:
    backoff = RestartBackoff()
    quick = timedelta(seconds=1)
    assert seconds([backoff.next(quick) for _ in range(7)]) == [1, 2, 4, 8, 16, 30, 30]


def test_restart_backoff_resets_after_healthy_run() -> None:
    backoff = RestartBackoff()
    for _ in range(5):
        backoff.next(timedelta(0))
    assert backoff.current_seconds == 30
    # a run of exactly the threshold (30 s) counts as healthy
    assert backoff.next(timedelta(seconds=30)) == timedelta(seconds=1)
    assert backoff.next(timedelta(seconds=29.9)) == timedelta(seconds=2)
    assert backoff.next(timedelta(hours=1)) == timedelta(seconds=1)


def test_restart_backoff_constructor_normalization() -> None:
    b = RestartBackoff(min_seconds=0, max_seconds=-1)
    assert (b.min_seconds, b.max_seconds, b.current_seconds) == (1, 1, 1)
    no_reset = RestartBackoff(healthy_run_threshold_seconds=0)
    waits = [no_reset.next(timedelta(days=1)) for _ in range(3)]
    assert seconds(waits) == [1, 2, 4]


def test_restart_backoff_round_trips_as_json() -> None:
    backoff = RestartBackoff()
    backoff.next(timedelta(0))
    backoff.next(timedelta(0))
    restored = RestartBackoff(**json.loads(json.dumps(dataclasses.asdict(backoff))))
    assert restored == backoff
    assert restored.next(timedelta(0)) == timedelta(seconds=4)


def test_state_round_trips_through_temporal_converter() -> None:
    # tests may import temporalio; nexuscrm may not
    from temporalio.converter import DataConverter

    converter = DataConverter.default.payload_converter
    backoff = RestartBackoff(current_seconds=8)
    knobs_value = ConnectorKnobs.from_env({R: "64", F: "0"})
    payloads = converter.to_payloads([backoff, knobs_value])
    got = converter.from_payloads(payloads, [RestartBackoff, ConnectorKnobs])
    assert got == [backoff, knobs_value]


# --- worker key / fingerprint -----------------------------------------------------


def test_worker_key_trims() -> None:
    assert knobs.worker_key(" acme ", " 0Ap1\n") == "acme/0Ap1"


BASE: dict[str, Any] = {
    "namespace": "acme",
    "install_id": "0Ap1",
    "status": "active",
    "payload_hash": "sha256:abc",
    "drain_only": False,
    "projection_fingerprint": "proj",
    "worker_count": 8,
    "max_processing_rows": 310,
    "explicit_budget": False,
    "queue_profile_mode": RESERVED,
    "generation": 3,
    "scheduler_owner_id": "owner-1",
    "fencing_token": "tok-1",
}
CHANGED: dict[str, Any] = {
    "namespace": "acme2",
    "install_id": "0Ap2",
    "status": "draining",
    "payload_hash": "sha256:abd",
    "drain_only": True,
    "projection_fingerprint": "proj2",
    "worker_count": 9,
    "max_processing_rows": 311,
    "explicit_budget": True,
    "queue_profile_mode": HEAVY,
    "generation": 4,
    "scheduler_owner_id": "owner-2",
    "fencing_token": "tok-2",
}


def test_fingerprint_is_sha256_of_nul_joined_seed_fields() -> None:
    material = "\x00".join(
        [
            *["acme", "0Ap1", "active", "sha256:abc", "false", "proj", "8", "310", "false"],
            *["reserved", "3", "owner-1", "tok-1"],
        ]
    )
    expected = hashlib.sha256(material.encode()).hexdigest()
    assert knobs.worker_fingerprint(**BASE) == expected
    assert len(expected) == 64


def test_fingerprint_trims_strings() -> None:
    padded: dict[str, Any] = {k: f"  {v} " if isinstance(v, str) else v for k, v in BASE.items()}
    assert knobs.worker_fingerprint(**padded) == knobs.worker_fingerprint(**BASE)


def test_fingerprint_defaults_for_trailing_fields() -> None:
    trailing = {"generation", "scheduler_owner_id", "fencing_token"}
    head = {k: v for k, v in BASE.items() if k not in trailing}
    explicit = {**head, "generation": 0, "scheduler_owner_id": "", "fencing_token": ""}
    assert knobs.worker_fingerprint(**head) == knobs.worker_fingerprint(**explicit)


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_fingerprint_changes_when_any_input_changes(field: str) -> None:
    assert knobs.worker_fingerprint(**{**BASE, field: CHANGED[field]}) != knobs.worker_fingerprint(
        **BASE
    )


def test_fingerprint_fields_do_not_bleed_into_each_other() -> None:
    # NUL separation: moving text between adjacent fields changes the fingerprint
    a = knobs.worker_fingerprint(**{**BASE, "namespace": "ac", "install_id": "me0Ap1"})
    b = knobs.worker_fingerprint(**{**BASE, "namespace": "acme", "install_id": "0Ap1"})
    assert a != b


# --- ConnectorKnobs ---------------------------------------------------------------


def test_connector_knobs_defaults_from_empty_env() -> None:
    with capture_logs() as logs:
        value = ConnectorKnobs.from_env({})
    assert warnings_of(logs) == []
    assert value == ConnectorKnobs()
    assert value == ConnectorKnobs(
        workers_per_pack=8,
        max_processing_rows=310,
        explicit_processing_budget=False,
        queue_profile_mode=RESERVED,
        stage_timing=False,
        flow_deadline_ms=600_000,
    )
    assert value.flow_deadline == timedelta(minutes=10)
    assert value.queue_profiles() == tuple(RESERVED_EXPECTED[8])


def test_connector_knobs_from_env() -> None:
    env = {W: "16", R: "200", Q: "default-heavy", S: "1", F: "0"}
    with capture_logs() as logs:
        value = ConnectorKnobs.from_env(env)
    assert value.workers_per_pack == 16
    assert (value.max_processing_rows, value.explicit_processing_budget) == (200, True)
    assert value.queue_profile_mode == HEAVY
    assert value.stage_timing is True
    assert value.flow_deadline_ms == 0
    assert value.flow_deadline is None
    assert value.queue_profiles() == tuple(HEAVY_WORK_ITEM_EXPECTED[16])
    # only the unsafe-high worker warning: the budget is explicit
    assert len(warnings_of(logs)) == 1
    assert "unsafe high" in warnings_of(logs)[0]


def test_connector_knobs_derived_budget_follows_worker_count() -> None:
    value = ConnectorKnobs.from_env({W: "4"})
    assert (value.max_processing_rows, value.explicit_processing_budget) == (155, False)


def test_connector_knobs_fingerprint_uses_its_fields() -> None:
    value = ConnectorKnobs.from_env({W: "8", R: "310"})
    got = value.fingerprint(
        "acme", "0Ap1", "active", "sha256:abc", False, "proj", 3, "owner-1", "tok-1"
    )
    assert got == knobs.worker_fingerprint(**{**BASE, "explicit_budget": True})
    # the explicit flag is part of the fingerprint even when the number is the same
    assert got != knobs.worker_fingerprint(**BASE)


def test_knobs_module_does_not_import_temporalio() -> None:
    import ast
    from pathlib import Path

    for name in ("knobs.py", "serving.py"):
        tree = ast.parse((Path(knobs.__file__).parent / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("temporalio") for a in node.names)
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("temporalio")


def test_go_trim_space_matches_go_set() -> None:
    assert knobs.go_trim_space("\u3000\xa0 x \t\n\u2028") == "x"
    # Go's unicode.IsSpace excludes the ASCII separators str.strip() would remove
    assert knobs.go_trim_space("\x1cx\x1f") == "\x1cx\x1f"
    with capture_logs() as logs:
        assert knobs.workers_per_pack({W: "\x1c4"}) == 8
    assert len(warnings_of(logs)) == 1
