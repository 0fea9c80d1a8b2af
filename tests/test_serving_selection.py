"""nexuscrm.connectors.serving: normalization and errors of the Runtime serving selection.

Messages are the seed's (``normalizeRuntimeServingPacks``,
``runtimeServingPackLister``, ``runtimeServingProfileLoader``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from nexuscrm.connectors import serving
from nexuscrm.connectors.serving import (
    RouteCoordinate,
    RuntimeServingCalloutProfile,
    RuntimeServingInboundRoute,
    RuntimeServingPack,
    RuntimeServingSelection,
    ServingSelectionError,
)
from nexuscrm.errors import NexusError

PREFIX = "connector inbound supervisor: "


def pack(**overrides: Any) -> dict[str, Any]:
    """A valid raw pack document; overrides replace top-level keys."""
    value: dict[str, Any] = {
        "namespace": "acme",
        "installed_pack_id": "0Ap1",
        "payload_digest": "sha256:abc",
        "inbound_routes": [{"event_kind": "account.upsert", "route_version": 3}],
        "callout_profiles": [{"name": "crm", "credential_refs": ["cred-a"]}],
    }
    value.update(overrides)
    return value


def select(*packs: dict[str, Any]) -> RuntimeServingSelection:
    return RuntimeServingSelection.model_validate({"packs": list(packs)})


def expect_error(message: str, *packs: dict[str, Any]) -> None:
    with pytest.raises(ServingSelectionError) as info:
        select(*packs)
    assert str(info.value) == PREFIX + message
    assert not isinstance(info.value, ValidationError)


# --- normalization ------------------------------------------------------------------


def test_normalization_trims_lowercases_and_sorts() -> None:
    selection = select(
        pack(
            namespace="  zeta ",
            installed_pack_id=" 0Ap9 ",
            payload_digest=" sha256:zzz\n",
            inbound_routes=[
                {"event_kind": " Contact.Delete ", "route_version": 2},
                {"event_kind": "ACCOUNT.upsert", "route_version": 7},
            ],
            callout_profiles=[
                {"name": " Warehouse ", "credential_refs": [" cred-b ", "cred-a"]},
                {"name": "CRM", "credential_refs": []},
            ],
        ),
        pack(namespace="alpha", installed_pack_id="0Ap2"),
    )
    assert [p.worker_key for p in selection.packs] == ["alpha/0Ap2", "zeta/0Ap9"]
    zeta = selection.packs[1]
    assert (zeta.namespace, zeta.installed_pack_id, zeta.payload_digest) == (
        "zeta",
        "0Ap9",
        "sha256:zzz",
    )
    assert zeta.inbound_routes == [
        RuntimeServingInboundRoute(event_kind="account.upsert", route_version=7),
        RuntimeServingInboundRoute(event_kind="contact.delete", route_version=2),
    ]
    assert zeta.callout_profiles == [
        RuntimeServingCalloutProfile(name="crm", credential_refs=[]),
        RuntimeServingCalloutProfile(name="warehouse", credential_refs=["cred-a", "cred-b"]),
    ]


def test_namespace_and_install_id_keep_case() -> None:
    # only event kinds and profile names are lower-cased, as in the seed
    selection = select(pack(namespace="Acme", installed_pack_id="0ApX"))
    assert selection.packs[0].worker_key == "Acme/0ApX"


def test_packs_sort_by_worker_key_not_namespace_alone() -> None:
    selection = select(
        pack(namespace="a", installed_pack_id="2"),
        pack(namespace="a", installed_pack_id="10"),
        pack(namespace="a-b", installed_pack_id="1"),
    )
    # "a/10" < "a/2" < "a-b/1"? "-" (0x2d) sorts before "/" (0x2f)
    assert selection.worker_keys() == ["a-b/1", "a/10", "a/2"]


def test_normalization_is_idempotent_and_accepts_model_instances() -> None:
    first = select(pack(namespace=" acme "), pack(namespace="beta"))
    again = RuntimeServingSelection(packs=first.packs)
    assert again == first
    raw = RuntimeServingPack(
        namespace=" ns ",
        installed_pack_id="1",
        payload_digest="d",
        inbound_routes=[RuntimeServingInboundRoute(event_kind="E", route_version=1)],
    )
    assert raw.namespace == " ns "  # a lone pack is not normalized
    assert RuntimeServingSelection(packs=[raw]).packs[0].namespace == "ns"


def test_profiles_are_optional_and_empty_selection_is_allowed() -> None:
    selection = select(pack(callout_profiles=[]))
    assert selection.packs[0].callout_profiles == []
    assert RuntimeServingSelection().packs == []
    assert RuntimeServingSelection().route_coordinates() == []


def test_max_route_version_is_accepted() -> None:
    selection = select(pack(inbound_routes=[{"event_kind": "x", "route_version": 2**63 - 1}]))
    assert selection.packs[0].inbound_routes[0].route_version == 2**63 - 1


def test_route_coordinates() -> None:
    selection = select(
        pack(
            namespace="beta",
            installed_pack_id="0Ap2",
            inbound_routes=[
                {"event_kind": "b", "route_version": 1},
                {"event_kind": "a", "route_version": 5},
            ],
        ),
        pack(namespace="acme", installed_pack_id="0Ap1"),
    )
    assert selection.route_coordinates() == [
        RouteCoordinate("acme", "0Ap1", "account.upsert", 3),
        RouteCoordinate("beta", "0Ap2", "a", 5),
        RouteCoordinate("beta", "0Ap2", "b", 1),
    ]


def test_error_type() -> None:
    assert issubclass(ServingSelectionError, NexusError)


# --- every normalizeRuntimeServingPacks error ------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"namespace": "  "},
        {"installed_pack_id": ""},
        {"payload_digest": "\t"},
    ],
)
def test_incomplete_identity(overrides: dict[str, Any]) -> None:
    expect_error("Runtime serving pack identity is incomplete", pack(**overrides))


def test_duplicate_pack_after_trimming() -> None:
    expect_error(
        "duplicate Runtime serving pack acme (0Ap1)",
        pack(),
        pack(namespace=" acme", installed_pack_id="0Ap1 ", payload_digest="other"),
    )


def test_duplicate_pack_is_reported_before_the_duplicate_own_errors() -> None:
    # seed order: identity, then duplicate, then routes
    expect_error("duplicate Runtime serving pack acme (0Ap1)", pack(), pack(inbound_routes=[]))


@pytest.mark.parametrize(
    "route",
    [
        {"event_kind": "  ", "route_version": 1},
        {"event_kind": "x", "route_version": 0},
        {"event_kind": "x", "route_version": -1},
        {"event_kind": "x", "route_version": 2**63},
    ],
)
def test_invalid_route_coordinate(route: dict[str, Any]) -> None:
    expect_error(
        "Runtime serving pack acme has an invalid inbound route coordinate",
        pack(inbound_routes=[route]),
    )


def test_duplicate_route_after_lowercasing() -> None:
    expect_error(
        "Runtime serving pack acme has duplicate inbound route account.upsert",
        pack(
            inbound_routes=[
                {"event_kind": "account.upsert", "route_version": 1},
                {"event_kind": " Account.Upsert", "route_version": 2},
            ]
        ),
    )


def test_no_selected_routes() -> None:
    expect_error(
        "Runtime serving pack acme has no selected inbound routes", pack(inbound_routes=[])
    )
    without_key = pack()
    del without_key["inbound_routes"]
    expect_error("Runtime serving pack acme has no selected inbound routes", without_key)


def test_blank_callout_profile() -> None:
    expect_error(
        "Runtime serving pack acme has a blank callout profile",
        pack(callout_profiles=[{"name": " ", "credential_refs": []}]),
    )


def test_duplicate_callout_profile_after_lowercasing() -> None:
    expect_error(
        "Runtime serving pack acme has duplicate callout profile crm",
        pack(callout_profiles=[{"name": "crm"}, {"name": " CRM "}]),
    )


def test_blank_credential_ref() -> None:
    expect_error(
        "Runtime serving profile acme/crm has a blank credential reference",
        pack(callout_profiles=[{"name": "CRM", "credential_refs": ["a", " "]}]),
    )


def test_duplicate_credential_ref_after_trimming() -> None:
    expect_error(
        "Runtime serving profile acme/crm has duplicate credential reference cred-a",
        pack(callout_profiles=[{"name": "crm", "credential_refs": ["cred-a", " cred-a "]}]),
    )


def test_shape_errors_stay_pydantic_validation_errors() -> None:
    with pytest.raises(ValidationError):
        select(pack(inbound_routes=[{"event_kind": "x", "route_version": "3"}]))
    with pytest.raises(ValidationError):
        select(pack(surprise=True))


# --- pack lister / profile loader checks ----------------------------------------------


@pytest.fixture
def selection() -> RuntimeServingSelection:
    return select(
        pack(
            callout_profiles=[
                {"name": "crm", "credential_refs": ["cred-a", "cred-b"]},
                {"name": "open", "credential_refs": []},
            ]
        )
    )


def test_check_pack_row_accepts_matching_row(selection: RuntimeServingSelection) -> None:
    selection.check_pack_row(" acme ", "0Ap1", True, "sha256:abc")


def test_check_pack_row_not_active(selection: RuntimeServingSelection) -> None:
    with pytest.raises(ServingSelectionError) as info:
        selection.check_pack_row("acme", "0Ap1", False, "")
    assert str(info.value) == (
        PREFIX + "selected Runtime serving pack acme (0Ap1) is not an active ready generation"
    )


def test_check_pack_row_digest_mismatch(selection: RuntimeServingSelection) -> None:
    with pytest.raises(ServingSelectionError) as info:
        selection.check_pack_row("acme", "0Ap1", True, "sha256:abd")
    assert str(info.value) == (
        PREFIX + "selected Runtime serving pack acme (0Ap1) payload digest does not match "
        "(selected sha256:abc, installed sha256:abd)"
    )


def test_check_pack_row_outside_selection(selection: RuntimeServingSelection) -> None:
    with pytest.raises(ServingSelectionError) as info:
        selection.check_pack_row("acme", "0Ap2", True, "sha256:abc")
    assert str(info.value) == PREFIX + "pack is outside Runtime serving selection"


def test_check_profile_credentials_ok(selection: RuntimeServingSelection) -> None:
    selection.check_profile_credentials("acme", "0Ap1", "CRM", ["cred-b", " cred-a ", ""])
    selection.check_profile_credentials("acme", "0Ap1", "open", [])


def test_check_profile_credentials_unauthorized(selection: RuntimeServingSelection) -> None:
    with pytest.raises(ServingSelectionError) as info:
        selection.check_profile_credentials("acme", "0Ap1", "crm", ["cred-a", "cred-z"])
    assert str(info.value) == (
        PREFIX + "Runtime serving profile acme/crm credential is not authorized by its selection"
    )
    with pytest.raises(ServingSelectionError, match="not authorized"):
        selection.check_profile_credentials("acme", "0Ap1", "open", ["cred-a"])


def test_check_profile_credentials_pack_outside(selection: RuntimeServingSelection) -> None:
    with pytest.raises(ServingSelectionError) as info:
        selection.check_profile_credentials("other", "0Ap1", "crm", [])
    assert str(info.value) == PREFIX + "pack is outside Runtime serving selection"


def test_check_profile_credentials_profile_outside(selection: RuntimeServingSelection) -> None:
    with pytest.raises(ServingSelectionError) as info:
        selection.check_profile_credentials("acme", "0Ap1", "billing", [])
    assert str(info.value) == (
        PREFIX + "Runtime serving profile acme/billing is outside Runtime serving selection"
    )


def test_refuse_drain_only(selection: RuntimeServingSelection) -> None:
    message = PREFIX + "Runtime serving selection cannot start a drain-only generation"
    with pytest.raises(ServingSelectionError) as info:
        serving.refuse_drain_only()
    assert str(info.value) == message
    with pytest.raises(ServingSelectionError, match=re.escape(message)):
        selection.refuse_drain_only(True)
    serving.refuse_drain_only(False)


# --- load -----------------------------------------------------------------------


DOCUMENT = {
    "packs": [
        pack(namespace="beta", installed_pack_id="0Ap2"),
        pack(
            inbound_routes=[
                {"event_kind": "Contact.Delete", "route_version": 2},
                {"event_kind": "account.upsert", "route_version": 3},
            ]
        ),
    ]
}


def test_load_json(tmp_path: Path) -> None:
    path = tmp_path / "selection.json"
    path.write_text(json.dumps(DOCUMENT))
    selection = serving.load(path)
    assert selection == RuntimeServingSelection.model_validate(DOCUMENT)
    assert selection.worker_keys() == ["acme/0Ap1", "beta/0Ap2"]
    assert [r.event_kind for r in selection.packs[0].inbound_routes] == [
        "account.upsert",
        "contact.delete",
    ]


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".YAML"])
def test_load_yaml(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"selection{suffix}"
    path.write_text(yaml.safe_dump(DOCUMENT))
    assert RuntimeServingSelection.load(str(path)) == RuntimeServingSelection.model_validate(
        DOCUMENT
    )


def load_error(path: Path) -> ServingSelectionError:
    with pytest.raises(ServingSelectionError) as info:
        serving.load(path)
    assert str(info.value).startswith(f"Runtime serving selection file {path}: ")
    assert info.value.path == path
    return info.value


def test_load_missing_file_names_it(tmp_path: Path) -> None:
    error = load_error(tmp_path / "absent.json")
    assert "cannot read" in str(error)


def test_load_unsupported_suffix(tmp_path: Path) -> None:
    path = tmp_path / "selection.toml"
    path.write_text("packs = []")
    assert "unsupported file type '.toml'" in str(load_error(path))


def test_load_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "selection.json"
    path.write_text('{"packs": [')
    assert "not valid JSON" in str(load_error(path))


def test_load_bad_yaml(tmp_path: Path) -> None:
    path = tmp_path / "selection.yaml"
    path.write_text("packs: [\n  - namespace: acme\n   bad: indent")
    assert "not valid YAML" in str(load_error(path))


def test_load_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "selection.yaml"
    path.write_text("- just\n- a list\n")
    assert "expected a mapping with a 'packs' list, got a list" in str(load_error(path))


def test_load_shape_error_lists_field(tmp_path: Path) -> None:
    path = tmp_path / "selection.json"
    broken = pack()
    del broken["payload_digest"]
    path.write_text(json.dumps({"packs": [broken]}))
    assert "packs.0.payload_digest: Field required" in str(load_error(path))


def test_load_yaml_boolean_event_kind_is_a_shape_error(tmp_path: Path) -> None:
    # YAML 1.1 reads a bare `on` as true; the str field refuses it
    path = tmp_path / "selection.yaml"
    path.write_text(
        "packs:\n- namespace: acme\n  installed_pack_id: '1'\n  payload_digest: d\n"
        "  inbound_routes:\n  - {event_kind: on, route_version: 1}\n"
    )
    assert "packs.0.inbound_routes.0.event_kind" in str(load_error(path))


def test_load_keeps_seed_message(tmp_path: Path) -> None:
    path = tmp_path / "selection.json"
    path.write_text(json.dumps({"packs": [pack(), pack()]}))
    error = load_error(path)
    assert str(error) == (
        f"Runtime serving selection file {path}: "
        + PREFIX
        + "duplicate Runtime serving pack acme (0Ap1)"
    )
    assert isinstance(error.__cause__, ServingSelectionError)
