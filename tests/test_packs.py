"""Packs: native and Salesforce DX loaders, ordering, payload hash, shipped packs.

No mocks: real files (the shared corpus and files written to ``tmp_path``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from nexuscrm.errors import ManifestError, PackError, PackProblems
from nexuscrm.packs.builtin import PACKS_DIR_ENV, PLATFORM_PACKS_DIR, platform_packs
from nexuscrm.packs.hashing import canonical_payload, payload_hash
from nexuscrm.packs.loader import load_native, load_pack_source
from nexuscrm.packs.model import (
    STANDARD_COLUMNS,
    Category,
    FieldSpec,
    FieldType,
    ObjectSpec,
    PackManifest,
)
from nexuscrm.packs.ordering import order_packs, plan_order
from nexuscrm.packs.sfdx import load_sfdx, sanitize_pack_name

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "sfdx"
DREAMHOUSE = CORPUS / "dreamhouse-lwc"
EBIKES = CORPUS / "ebikes-lwc"

needs_corpus = pytest.mark.skipif(
    not (DREAMHOUSE.is_dir() and EBIKES.is_dir()),
    reason=f"shared corpus not found at {CORPUS} (expected ../shared/corpus/sfdx beside the repo)",
)

NS = "http://soap.sforce.com/2006/04/metadata"


# ---------------------------------------------------------------------------
# helpers


def _obj(pack: PackManifest, api_name: str) -> ObjectSpec:
    for o in pack.objects:
        if o.api_name == api_name:
            return o
    raise AssertionError(
        f"{pack.name} has no object {api_name}: {[o.api_name for o in pack.objects]}"
    )


def _field(obj: ObjectSpec, api_name: str) -> FieldSpec:
    for f in obj.fields:
        if f.api_name == api_name:
            return f
    raise AssertionError(f"{obj.api_name} has no field {api_name}")


def _field_xml(full_name: str, body: str) -> str:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<CustomField xmlns="{NS}">\n'
        f"    <fullName>{full_name}</fullName>\n{body}\n</CustomField>\n"
    )


def _object_xml(label: str, extra: str = "") -> str:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<CustomObject xmlns="{NS}">\n    <label>{label}</label>\n{extra}\n'
        "    <nameField><label>Name</label><type>Text</type></nameField>\n"
        "</CustomObject>\n"
    )


def _sfdx_project(root: Path, objects: dict[str, dict[str, str]], with_meta: bool = True) -> Path:
    """Write ``force-app/main/default/objects/<obj>/...`` files; ``objects`` maps
    object -> {field file stem: xml text}."""
    for obj, fields in objects.items():
        folder = root / "force-app" / "main" / "default" / "objects" / obj
        (folder / "fields").mkdir(parents=True, exist_ok=True)
        if with_meta:
            (folder / f"{obj}.object-meta.xml").write_text(_object_xml(obj.removesuffix("__c")))
        for stem, xml in fields.items():
            (folder / "fields" / f"{stem}.field-meta.xml").write_text(xml)
    return root


def _pack(
    name: str, category: Category = Category.AppPack, deps: tuple[str, ...] = ()
) -> PackManifest:
    return PackManifest(name=name, category=category, depends_on=deps)


TINY_PACK = PackManifest(
    name="tiny",
    category=Category.AppPack,
    version="1.0.0",
    description="Tiny é",
    depends_on=("platform-core",),
    objects=(
        ObjectSpec(
            api_name="Thing__c",
            label="Thing",
            fields=(
                FieldSpec(api_name="Size__c", type=FieldType.Number, precision=5, scale=0),
                FieldSpec(
                    api_name="Double__c",
                    type=FieldType.Number,
                    precision=6,
                    scale=0,
                    formula="Size__c * 2",
                ),
            ),
        ),
    ),
)
# Pinned: a change here means the canonical serialization changed, which would
# make every installed AppPack look modified. Change it only on purpose.
TINY_PACK_HASH = "1c8544f782322ed1dda2c5331b32ee15cbba2967c23785dd8e8fd6bb34792a2a"


# ---------------------------------------------------------------------------
# Salesforce DX: the corpus


@needs_corpus
def test_dreamhouse_loads() -> None:
    pack = load_pack_source(DREAMHOUSE)
    assert pack.name == "dreamhouse-lwc"
    assert pack.category == Category.AppPack
    assert pack.depends_on == ("platform-core",)
    assert pack.source == str(DREAMHOUSE.resolve())
    assert [o.api_name for o in pack.objects] == ["Broker__c", "Property__c"]

    broker = _obj(pack, "Broker__c")
    assert (broker.label, broker.plural_label, broker.name_field_label) == (
        "Broker",
        "Brokers",
        "Broker Name",
    )
    assert broker.kind == "table" and not broker.extends
    assert _field(broker, "Broker_Id__c").external_id
    assert _field(broker, "Email__c").type == FieldType.Email
    assert _field(broker, "Title__c").length == 30

    prop = _obj(pack, "Property__c")
    names = [f.api_name for f in prop.fields]
    assert names == sorted(names)
    assert len(names) == 25

    dom = _field(prop, "Days_On_Market__c")
    assert dom.type == FieldType.Number
    assert dom.formula == "TODAY() - Date_Listed__c"
    assert dom.formula_treat_blanks_as == "BlankAsZero"
    assert dom.is_formula and not dom.is_stored
    assert (dom.precision, dom.scale) == (18, 0)

    loc = _field(prop, "Location__c")
    assert loc.type == FieldType.Location and loc.scale == 7
    assert loc.column_names() == ("Location__Latitude__s", "Location__Longitude__s")

    broker_ref = _field(prop, "Broker__c")
    assert broker_ref.type == FieldType.Lookup
    assert broker_ref.reference_to == "Broker__c"
    assert broker_ref.relationship_name == "Properties"

    status = _field(prop, "Status__c")
    assert status.type == FieldType.Picklist
    assert status.picklist_values == (
        "Contracted",
        "Pre Market",
        "Available",
        "Under Agreement",
        "Closed",
    )
    assert status.default_value is None

    assert _field(prop, "Date_Listed__c").default_value == "TODAY() - 10"
    assert _field(prop, "Description__c").type == FieldType.LongTextArea
    assert _field(prop, "Description__c").length == 500
    assert _field(prop, "Price__c").type == FieldType.Currency
    record_link = _field(prop, "Record_Link__c")
    assert record_link.formula is not None and record_link.formula.startswith("LEFT($Api.")


@needs_corpus
def test_ebikes_loads() -> None:
    pack = load_sfdx(EBIKES)
    assert pack.name == "ebikes-lwc"
    assert [o.api_name for o in pack.objects] == [
        "Case",
        "Manufacturing_Event__e",
        "Order_Item__c",
        "Order__c",
        "Product_Family__c",
        "Product__c",
    ]
    case = _obj(pack, "Case")
    assert case.extends and case.kind == "table" and case.label == ""
    assert [f.api_name for f in case.fields] == ["Case_Category__c", "Product__c"]
    assert _field(case, "Product__c").reference_to == "Product__c"

    event = _obj(pack, "Manufacturing_Event__e")
    assert event.kind == "event" and not event.extends
    assert _field(event, "Order_Id__c").required

    item = _obj(pack, "Order_Item__c")
    assert item.name_field_type == "AutoNumber"
    assert item.name_field_label == "Order Item Number"
    master = _field(item, "Order__c")
    assert master.type == FieldType.MasterDetail and master.reference_to == "Order__c"
    assert master.relationship_name == "Order_Items"
    assert _field(item, "Qty_S__c").default_value == "1"

    order = _obj(pack, "Order__c")
    assert order.label == "Reseller Order"
    status = _field(order, "Status__c")
    assert status.required
    assert status.picklist_values[0] == "Draft"
    assert status.default_value == '"Draft"'  # <default>true</default> as a text literal
    assert _field(order, "Account__c").reference_to == "Account"

    product = _obj(pack, "Product__c")
    assert _field(product, "Product_Family__c").reference_to == "Product_Family__c"
    assert _field(product, "Frame_Color__c").picklist_values == ("white", "red", "blue", "green")
    assert _field(_obj(pack, "Product_Family__c"), "Description__c").type == FieldType.TextArea


@needs_corpus
def test_sfdx_load_is_deterministic_and_named() -> None:
    a = load_sfdx(EBIKES)
    b = load_sfdx(EBIKES, name="bikes", version="2.0.0")
    assert payload_hash(a) == payload_hash(load_sfdx(EBIKES))
    assert (b.name, b.version) == ("bikes", "2.0.0")
    assert payload_hash(a) != payload_hash(b)


def test_sfdx_project_file_names_pack_and_limits_package_dirs(tmp_path: Path) -> None:
    root = tmp_path / "Some Folder"
    _sfdx_project(root, {"Widget__c": {"Size__c": _field_xml("Size__c", "<type>Number</type>")}})
    # a stray objects folder outside the package directory is not read
    stray = root / "other" / "objects" / "Stray__c"
    stray.mkdir(parents=True)
    (stray / "Stray__c.object-meta.xml").write_text("not xml at all")
    (root / "sfdx-project.json").write_text(
        json.dumps({"name": "My Cool App!", "packageDirectories": [{"path": "force-app"}]})
    )
    pack = load_pack_source(str(root))
    assert pack.name == "my-cool-app"
    assert [o.api_name for o in pack.objects] == ["Widget__c"]


def test_sfdx_name_from_folder_is_sanitized(tmp_path: Path) -> None:
    root = tmp_path / "My_App Source"
    _sfdx_project(root, {"Widget__c": {}})
    assert load_sfdx(root).name == "my_app-source"
    assert sanitize_pack_name("  --Hello  World!!--  ") == "hello-world"
    assert sanitize_pack_name("!!!") == ""


def test_sfdx_global_value_set_and_summary(tmp_path: Path) -> None:
    fields = {
        "Region__c": _field_xml(
            "Region__c",
            "<type>Picklist</type><valueSet><valueSetName>Regions</valueSetName></valueSet>",
        ),
        "Total__c": _field_xml(
            "Total__c",
            "<type>Summary</type><summaryOperation>sum</summaryOperation>"
            "<summarizedField>Line__c.Amount__c</summarizedField>"
            "<summaryForeignKey>Line__c.Widget__c</summaryForeignKey>",
        ),
        "Label__c": _field_xml(
            "Label__c",
            '<type>Text</type><formula>Name &amp; "!"</formula>'
            "<formulaTreatBlanksAs>BlankAsBlank</formulaTreatBlanksAs>",
        ),
    }
    pack = load_sfdx(_sfdx_project(tmp_path / "app", {"Widget__c": fields}))
    widget = _obj(pack, "Widget__c")
    assert _field(widget, "Region__c").picklist_values == ()
    total = _field(widget, "Total__c")
    assert total.summary is not None
    assert total.summary.operation == "sum"
    assert total.summary.summarized_field == "Line__c.Amount__c"
    assert total.summary.foreign_key_field == "Line__c.Widget__c"
    label = _field(widget, "Label__c")
    assert label.formula == 'Name & "!"' and label.formula_treat_blanks_as == "BlankAsBlank"


def test_sfdx_custom_object_without_definition_extends(tmp_path: Path) -> None:
    root = _sfdx_project(
        tmp_path / "app",
        {"Other__c": {"X__c": _field_xml("X__c", "<type>Checkbox</type>")}},
        with_meta=False,
    )
    other = _obj(load_sfdx(root), "Other__c")
    assert other.extends and other.kind == "table"


# ---------------------------------------------------------------------------
# Salesforce DX: errors


def test_sfdx_unknown_field_type_names_file_and_element(tmp_path: Path) -> None:
    root = _sfdx_project(
        tmp_path / "app",
        {"Widget__c": {"Secret__c": _field_xml("Secret__c", "<type>Hologram</type>")}},
    )
    with pytest.raises(ManifestError) as exc:
        load_sfdx(root)
    msg = str(exc.value)
    assert "Secret__c.field-meta.xml" in msg
    assert "<type>" in msg and "'Hologram'" in msg


def test_sfdx_broken_xml_names_file(tmp_path: Path) -> None:
    root = _sfdx_project(
        tmp_path / "app",
        {"Widget__c": {"Bad__c": _field_xml("Bad__c", "<type>Text</type><label>oops</labl>")}},
    )
    with pytest.raises(ManifestError, match=r"(?s)Bad__c\.field-meta\.xml.*does not parse.*line 4"):
        load_sfdx(root)


def test_sfdx_refuses_entity_declarations(tmp_path: Path) -> None:
    laughs = (
        '<?xml version="1.0"?>\n'
        "<!DOCTYPE lolz [\n"
        '  <!ENTITY lol "lol">\n'
        '  <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">\n'
        '  <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">\n'
        "]>\n"
        f'<CustomField xmlns="{NS}"><fullName>Boom__c</fullName>'
        "<label>&lol3;</label><type>Text</type></CustomField>\n"
    )
    root = _sfdx_project(tmp_path / "app", {"Widget__c": {"Boom__c": laughs}})
    with pytest.raises(ManifestError, match=r"(?s)Boom__c\.field-meta\.xml.*refused"):
        load_sfdx(root)


def test_sfdx_refuses_external_entities(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    xxe = (
        '<?xml version="1.0"?>\n'
        f'<!DOCTYPE x [<!ENTITY s SYSTEM "file://{secret}">]>\n'
        f'<CustomField xmlns="{NS}"><fullName>X__c</fullName>'
        "<label>&s;</label><type>Text</type></CustomField>\n"
    )
    root = _sfdx_project(tmp_path / "app", {"Widget__c": {"X__c": xxe}})
    with pytest.raises(ManifestError, match="refused"):
        load_sfdx(root)


@pytest.mark.parametrize(
    ("stem", "xml", "pattern"),
    [
        ("Bad_Name__c", _field_xml("Bad_Name__c", "<label>x</label>"), r"<type>:? is missing"),
        (
            "No_Name__c",
            f'<?xml version="1.0"?><CustomField xmlns="{NS}"><type>Text</type></CustomField>',
            r"<fullName> is missing",
        ),
        (
            "Other__c",
            _field_xml("Renamed__c", "<type>Text</type>"),
            r"does not match the file name",
        ),
        (
            "Bad___c",
            _field_xml("Bad___c", "<type>Text</type>"),
            r"<fullName>.*not a valid API name",
        ),
        ("Len__c", _field_xml("Len__c", "<type>Text</type><length>ten</length>"), r"<length>"),
        ("Big__c", _field_xml("Big__c", "<type>Text</type><length>999999</length>"), r"<length>"),
        (
            "Ref__c",
            _field_xml("Ref__c", "<type>Lookup</type><referenceTo>Bad Target</referenceTo>"),
            r"<referenceTo>.*not a valid API name",
        ),
        ("Lk__c", _field_xml("Lk__c", "<type>Lookup</type>"), r"needs reference_to"),
        (
            "Req__c",
            _field_xml("Req__c", "<type>Text</type><required>maybe</required>"),
            r"<required>: 'maybe'",
        ),
        (
            "Wrong__c",
            '<?xml version="1.0"?><CustomObject xmlns="x">'
            "<fullName>Wrong__c</fullName></CustomObject>",
            r"root element",
        ),
        (
            "Sum__c",
            _field_xml("Sum__c", "<type>Summary</type><summaryOperation>avg</summaryOperation>"),
            r"<summaryOperation>: 'avg'",
        ),
    ],
)
def test_sfdx_field_errors_name_file_and_element(
    tmp_path: Path, stem: str, xml: str, pattern: str
) -> None:
    root = _sfdx_project(tmp_path / "app", {"Widget__c": {stem: xml}})
    with pytest.raises(ManifestError) as exc:
        load_sfdx(root)
    msg = str(exc.value)
    assert f"{stem}.field-meta.xml" in msg, msg
    assert re.search(pattern, msg), msg


def test_sfdx_invalid_object_api_name(tmp_path: Path) -> None:
    root = _sfdx_project(
        tmp_path / "app", {"Bad-Object__c": {"X__c": _field_xml("X__c", "<type>Text</type>")}}
    )
    with pytest.raises(ManifestError, match=r"Bad-Object__c.*not a valid API name"):
        load_sfdx(root)


def test_sfdx_unsupported_object_suffix(tmp_path: Path) -> None:
    root = _sfdx_project(tmp_path / "app", {"Archive__b": {}, "Remote__x": {}})
    with pytest.raises(ManifestError, match=r"(?s)big objects.*external objects"):
        load_sfdx(root)


def test_sfdx_bad_name_field_type(tmp_path: Path) -> None:
    folder = tmp_path / "app" / "objects" / "Widget__c"
    folder.mkdir(parents=True)
    (folder / "Widget__c.object-meta.xml").write_text(
        f'<CustomObject xmlns="{NS}"><label>W</label>'
        "<nameField><type>Number</type></nameField></CustomObject>"
    )
    with pytest.raises(ManifestError, match=r"(?s)Widget__c\.object-meta\.xml.*<nameField><type>"):
        load_sfdx(tmp_path / "app")


def test_sfdx_metadata_api_format_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "app" / "objects" / "Widget__c"
    folder.mkdir(parents=True)
    (folder / "Widget__c.object-meta.xml").write_text(
        _object_xml("Widget", "<fields><fullName>X__c</fullName><type>Text</type></fields>")
    )
    with pytest.raises(
        ManifestError, match=r"(?s)Widget__c\.object-meta\.xml.*Metadata API format"
    ):
        load_sfdx(tmp_path / "app")


def test_sfdx_skips_node_modules_and_hidden_folders(tmp_path: Path) -> None:
    root = _sfdx_project(tmp_path / "app", {"Widget__c": {}})
    for junk in ("node_modules/pkg", ".sfdx/tools"):
        bad = root / junk / "objects" / "Junk__c"
        bad.mkdir(parents=True)
        (bad / "Junk__c.object-meta.xml").write_text("<not-xml")
    assert [o.api_name for o in load_sfdx(root).objects] == ["Widget__c"]


def test_sfdx_field_defined_twice_across_package_dirs(tmp_path: Path) -> None:
    root = tmp_path / "app"
    for pkg in ("one", "two"):
        fields = root / pkg / "objects" / "Account" / "fields"
        fields.mkdir(parents=True)
        (fields / "Tier__c.field-meta.xml").write_text(_field_xml("Tier__c", "<type>Text</type>"))
    (root / "sfdx-project.json").write_text(
        json.dumps({"packageDirectories": [{"path": "one"}, {"path": "two"}]})
    )
    with pytest.raises(ManifestError, match=r"Account\.Tier__c is also defined in"):
        load_sfdx(root)


def test_sfdx_bad_project_file(tmp_path: Path) -> None:
    root = _sfdx_project(tmp_path / "app", {"Widget__c": {}})
    (root / "sfdx-project.json").write_text('{"packageDirectories": [{"path": "../elsewhere"}]}')
    with pytest.raises(ManifestError, match=r"(?s)sfdx-project\.json.*outside the project"):
        load_sfdx(root)
    (root / "sfdx-project.json").write_text('{"name": "x",')
    with pytest.raises(ManifestError, match=r"(?s)sfdx-project\.json.*JSON syntax error at line 1"):
        load_sfdx(root)
    (root / "sfdx-project.json").write_text('{"name": "x", "namespace": "a", "namespace": "b"}')
    with pytest.raises(ManifestError, match=r"(?s)sfdx-project\.json.*'namespace' appears twice"):
        load_sfdx(root)


@pytest.mark.parametrize(
    ("kind", "text", "key"),
    [
        ("json", '{"a": 1, "b": {"c": 1, "c": 2}}', "'c'"),
        ("yaml", "a: 1\nb:\n  c: 1\n  c: 2\n", "'c'"),
    ],
)
def test_every_document_reader_refuses_a_key_named_twice(kind: str, text: str, key: str) -> None:
    """JSON and YAML both keep the last of two equal keys silently; candidate
    files, serving selections, data plans and sfdx-project.json refuse it."""
    from nexuscrm.inputs import InputLimitError, parse_document

    with pytest.raises(InputLimitError, match=rf"{key}"):
        parse_document(text.encode(), kind)
    # merge keys are not duplicates
    assert parse_document(b"base: &b {x: 1}\nother: {<<: *b, y: 2}\n", "yaml") == {
        "base": {"x": 1},
        "other": {"x": 1, "y": 2},
    }


def test_sfdx_metadata_names_that_are_not_files_are_refused_not_skipped(tmp_path: Path) -> None:
    """A directory named like a field file, a broken symlink in its place, a
    directory named like an object, a record or a labels file: each would
    drop an object or field without a word; each is listed, all at once."""
    number = "<type>Number</type><precision>5</precision><scale>0</scale>"
    root = _sfdx_project(
        tmp_path / "app", {"Widget__c": {"Size__c": _field_xml("Size__c", number)}}
    )
    default = root / "force-app" / "main" / "default"
    fields = default / "objects" / "Widget__c" / "fields"
    (fields / "Folder__c.field-meta.xml").mkdir()
    (fields / "Gone__c.field-meta.xml").symlink_to(tmp_path / "nowhere.xml")
    gadget = default / "objects" / "Gadget__c"
    (gadget / "Gadget__c.object-meta.xml").mkdir(parents=True)
    (default / "customMetadata" / "Cfg.One.md-meta.xml").mkdir(parents=True)
    (default / "labels" / "CustomLabels.labels-meta.xml").mkdir(parents=True)
    with pytest.raises(PackProblems) as info:
        load_sfdx(root)
    found = {(Path(p.file).name, p.message) for p in info.value.problems}
    assert (
        "Folder__c.field-meta.xml",
        "a metadata file is expected here, found a directory",
    ) in found
    assert any(n == "Gone__c.field-meta.xml" and "broken symlink" in m for n, m in found)
    assert (
        "Gadget__c.object-meta.xml",
        "a metadata file is expected here, found a directory",
    ) in found
    assert any(n == "Cfg.One.md-meta.xml" and "directory" in m for n, m in found)
    assert any(n == "CustomLabels.labels-meta.xml" and "directory" in m for n, m in found)
    assert len(info.value.problems) == 5, info.value.problems


def test_a_relative_source_names_every_file_the_same_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loader problems and the plan's problems used to name files relative and
    absolute in one report; every file is now named by its resolved path."""
    root = _sfdx_project(tmp_path / "app", {"Widget__c": {"Bad__c": _field_xml("Bad__c", "")}})
    fields = root / "force-app" / "main" / "default" / "objects" / "Widget__c" / "fields"
    (fields / "D__c.field-meta.xml").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PackProblems) as info:
        load_pack_source("app")
    files = {p.file for p in info.value.problems}
    assert len(files) == 2 and all(f.startswith(str(tmp_path.resolve())) for f in files), files


def test_a_utf8_byte_order_mark_is_not_content(tmp_path: Path) -> None:
    """Editors on Windows start files with a BOM: JSON documents (data plans,
    sfdx-project.json, candidate files) and pack manifests read past it."""
    from nexuscrm.inputs import parse_document

    bom = b"\xef\xbb\xbf"
    assert parse_document(bom + b'{"a": 1}', "json") == {"a": 1}
    assert parse_document(bom + b"a: 1\n", "yaml") == {"a": 1}
    path = tmp_path / "pack.json"
    path.write_bytes(bom + b'{"name": "demo", "category": "AppPack"}')
    assert load_native(path).name == "demo"


def test_sfdx_no_objects(tmp_path: Path) -> None:
    (tmp_path / "sfdx-project.json").write_text("{}")
    with pytest.raises(ManifestError, match="no objects"):
        load_sfdx(tmp_path)


# ---------------------------------------------------------------------------
# native loader


NATIVE_YAML = """\
name: demo
category: AppPack
version: 1.0
description: A demo
depends_on: [platform-core]
objects:
  - api_name: Thing__c
    label: Thing
    fields:
      - {api_name: Flag__c, type: Checkbox, required: true}
      - {api_name: Size__c, type: Number, precision: 5, scale: 0}
      - api_name: Answer__c
        type: Picklist
        picklist_values: [Yes, No, On, 2024-01-01]
      - {api_name: Note__c, type: Text, default_value: ~}
"""


def test_native_yaml_loads_with_string_scalars(tmp_path: Path) -> None:
    path = tmp_path / "pack.yaml"
    path.write_text(NATIVE_YAML)
    pack = load_native(path)
    assert pack.source == str(path.resolve())
    assert pack.version == "1.0"  # not the float 1.0
    thing = _obj(pack, "Thing__c")
    assert _field(thing, "Flag__c").required is True
    assert _field(thing, "Size__c").precision == 5
    assert _field(thing, "Answer__c").picklist_values == ("Yes", "No", "On", "2024-01-01")
    assert _field(thing, "Note__c").default_value is None
    # the directory dispatches to the same loader
    assert load_pack_source(tmp_path) == pack


def test_native_json_equals_yaml(tmp_path: Path) -> None:
    y = tmp_path / "a" / "pack.yaml"
    y.parent.mkdir()
    y.write_text(NATIVE_YAML)
    from_yaml = load_native(y)
    j = tmp_path / "b.json"
    j.write_text(json.dumps(from_yaml.model_dump(mode="json")))
    from_json = load_pack_source(j)
    assert from_json.source == str(j.resolve())
    assert from_json == from_yaml.model_copy(update={"source": from_json.source})
    assert payload_hash(from_json) == payload_hash(from_yaml)


def test_native_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "pack.yaml"
    path.write_text("name: demo\ncategory: AppPack\nobjects:\n  - api_name: [unclosed\n")
    with pytest.raises(ManifestError) as exc:
        load_native(path)
    msg = str(exc.value)
    assert str(path) in msg
    assert re.search(r"YAML syntax error at line \d+, column \d+", msg), msg


def test_native_yaml_duplicate_key(tmp_path: Path) -> None:
    path = tmp_path / "pack.yaml"
    path.write_text("name: demo\ncategory: AppPack\nname: other\n")
    with pytest.raises(ManifestError, match=r"line 3.*duplicate key 'name'"):
        load_native(path)


def test_native_yaml_merge_keys_and_safe_loader_untouched(tmp_path: Path) -> None:
    path = tmp_path / "pack.yaml"
    path.write_text(
        "name: demo\ncategory: AppPack\nobjects:\n  - api_name: Thing__c\n    fields:\n"
        "      - &base {api_name: A__c, type: Number, precision: 5, scale: 0}\n"
        "      - {<<: *base, api_name: B__c}\n"
    )
    b = _field(_obj(load_native(path), "Thing__c"), "B__c")
    assert (b.type, b.precision) == (FieldType.Number, 5)
    # the manifest loader's string-only scalars do not leak into yaml.safe_load
    assert yaml.safe_load("a: yes\nb: 1.5") == {"a": True, "b": 1.5}


def test_native_json_duplicate_key(tmp_path: Path) -> None:
    path = tmp_path / "pack.json"
    path.write_text('{"name": "a", "category": "AppPack", "name": "b"}')
    with pytest.raises(ManifestError, match=r"pack\.json.*duplicate key 'name'"):
        load_native(path)


def test_native_json_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "pack.json"
    path.write_text('{\n  "name": "demo",\n  "category": }\n')
    with pytest.raises(ManifestError, match=r"pack\.json.*JSON syntax error at line 3"):
        load_native(path)


def test_native_validation_error_names_location(tmp_path: Path) -> None:
    path = tmp_path / "pack.yaml"
    path.write_text(
        "name: demo\ncategory: AppPack\nobjects:\n"
        "  - api_name: Thing__c\n    fields:\n"
        "      - {api_name: Ok__c, type: Text}\n"
        "      - {api_name: Bad__c, type: Txet}\n"
        "      - {api_name: Typo__c, type: Text, lenght: 5}\n"
    )
    with pytest.raises(ManifestError) as exc:
        load_native(path)
    msg = str(exc.value)
    assert str(path) in msg
    assert "objects[0](Thing__c).fields[1](Bad__c).type" in msg
    assert "'Txet') (line 7)" in msg
    assert "objects[0](Thing__c).fields[2](Typo__c).lenght: Extra inputs" in msg
    assert "(got '5') (line 8)" in msg


def test_native_validation_errors_give_the_line_of_each_culprit(tmp_path: Path) -> None:
    """Every problem at once, each with the line it is on (a missing field: its parent's)."""
    path = tmp_path / "pack.yaml"
    path.write_text(
        "name: sync\ncategory: ConnectorPack\ndepends_on: [platform-core]\n"
        "inbound_routes:\n"
        "  - event_kind: a.b\n    route_version: 1\n    invocation_mode: flow\n"
        "    queue_class: default\n    flow: no_such_flow\n    extra_field: 3\n"
        "  - event_kind: c.d\n    route_version: 1\n    invocation_mode: bogus\n"
        "    queue_class: default\n    flow: upsert_record\n"
        "objects:\n  - label: No api name\n"
    )
    with pytest.raises(ManifestError) as exc:
        load_native(path)
    msg = str(exc.value)
    assert "inbound_routes[0].flow: Input should be" in msg, msg
    assert "(got 'no_such_flow') (line 9)" in msg, msg
    assert (
        "inbound_routes[0].extra_field: Extra inputs are not permitted (got '3') (line 10)" in msg
    )
    assert "(got 'bogus') (line 13)" in msg, msg
    assert "objects[0].api_name: Field required (line 17)" in msg, msg


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("", "manifest is empty"),
        ("- a\n- b\n", "must be a mapping"),
        ("name: Bad Name\ncategory: AppPack\n", r"name: pack name 'Bad Name'"),
        ("name: x\ncategory: Nope\n", r"category: Input should be"),
        ("name: x\n", r"category: Field required"),
        ("name: x\ncategory: AppPack\nsource: /tmp\n", "source"),
        (
            "name: x\ncategory: AppPack\nobjects:\n  - api_name: Contact\n    fields:\n"
            "      - {api_name: OwnerId, type: Text}\n",
            r"objects\[0\]\(Contact\).*collides with a system column",
        ),
        (
            "name: x\ncategory: AppPack\nobjects:\n  - api_name: 1Bad\n",
            r"objects\[0\]\(1Bad\)\.api_name: object api_name '1Bad' is not a valid API name",
        ),
    ],
)
def test_native_errors(tmp_path: Path, text: str, pattern: str) -> None:
    path = tmp_path / "pack.yaml"
    path.write_text(text)
    with pytest.raises(ManifestError) as exc:
        load_native(path)
    assert str(path) in str(exc.value)
    assert re.search(pattern, str(exc.value)), str(exc.value)


def test_unknown_sources(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no such file or directory"):
        load_pack_source(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ManifestError, match="unknown pack source"):
        load_pack_source(tmp_path / "empty")
    txt = tmp_path / "pack.txt"
    txt.write_text("name: x")
    with pytest.raises(ManifestError, match="unsupported manifest file type"):
        load_pack_source(txt)


def test_readme_example_is_a_valid_pack(tmp_path: Path) -> None:
    text = (REPO / "packs" / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    assert blocks, "packs/README.md lost its YAML example"
    path = tmp_path / "pack.yaml"
    path.write_text(blocks[0])
    pack = load_native(path)
    assert pack.name == "acme-projects"
    project = _obj(pack, "Project__c")
    assert _field(project, "Remaining__c").is_formula
    assert _field(project, "Milestone_Count__c").type == FieldType.Summary
    assert _obj(pack, "Case").extends


# ---------------------------------------------------------------------------
# ordering


def test_order_by_category_then_dependencies_then_name() -> None:
    packs = [
        _pack("zeta-sample", Category.DevSample, ("platform-core",)),
        _pack("b-app", Category.AppPack, ("a-app",)),
        _pack("a-app", Category.AppPack, ("platform-core", "c-app")),
        _pack("c-app", Category.AppPack, ("tenant",)),
        _pack("d-app", Category.AppPack),
        _pack("tenant", Category.PlatformTenant, ("platform-core",)),
        _pack("platform-core", Category.PlatformCore),
        _pack("ux", Category.PlatformUX),
    ]
    ordered = [p.name for p in order_packs(packs)]
    assert ordered == [
        "platform-core",
        "tenant",
        "ux",
        "c-app",
        "a-app",
        "b-app",
        "d-app",
        "zeta-sample",
    ]
    # input order never matters
    assert [p.name for p in order_packs(list(reversed(packs)))] == ordered
    assert order_packs([]) == []


def test_order_missing_dependency() -> None:
    with pytest.raises(PackProblems, match=r"pack app depends on nowhere, which is not among"):
        order_packs([_pack("app", deps=("nowhere",))])


def test_order_cycle_reports_path() -> None:
    packs = [
        _pack("a", deps=("b",)),
        _pack("b", deps=("c",)),
        _pack("c", deps=("a",)),
        _pack("d", deps=("a",)),
    ]
    with pytest.raises(PackError, match=r"pack a: dependency cycle: a -> b -> c -> a"):
        order_packs(packs)
    with pytest.raises(PackError, match=r"dependency cycle: solo -> solo"):
        order_packs([_pack("solo", deps=("solo",))])


def test_order_duplicate_names() -> None:
    one = _pack("dup").model_copy(update={"source": "/one/pack.yaml"})
    two = _pack("dup").model_copy(update={"source": "/two/pack.yaml"})
    with pytest.raises(
        PackError, match=r"pack dup declared twice.*/one/pack\.yaml.*/two/pack\.yaml"
    ):
        order_packs([one, two])


def test_order_dependency_on_later_category() -> None:
    packs = [
        _pack("core", Category.PlatformCore, ("app",)),
        _pack("app", Category.AppPack),
    ]
    with pytest.raises(PackError, match=r"pack core: category PlatformCore cannot depend on app"):
        order_packs(packs)


def test_plan_order_reports_every_problem_and_still_orders_the_rest() -> None:
    """Each problem is reported (two cycles, a missing pack, a later category, a
    duplicate), and the order skips only the faulty edges."""
    packs = [
        _pack("core", Category.PlatformCore, ("app",)),
        _pack("app", Category.AppPack, ("core", "ghost")),
        _pack("a", deps=("b",)),
        _pack("b", deps=("a",)),
        _pack("solo", deps=("solo",)),
        _pack("x", deps=("app",)),
        _pack("x").model_copy(update={"source": "/two/x.yaml"}),
    ]
    ordered, problems = plan_order(packs)
    text = [p.message for p in problems]
    assert len(problems) == 5, text
    assert any("declared twice" in m for m in text)
    assert any("depends on ghost" in m for m in text)
    assert any("cannot depend on app" in m for m in text)
    assert any("a -> b -> a" in m for m in text)
    assert any("solo -> solo" in m for m in text)
    assert all(p.element in ("name", "depends_on") for p in problems)
    names = [p.name for p in ordered]
    assert sorted(names) == ["a", "app", "b", "core", "solo", "x"]
    assert names.index("app") < names.index("x")
    with pytest.raises(PackProblems) as info:
        order_packs(packs)
    assert len(info.value.problems) == 5


# ---------------------------------------------------------------------------
# payload hash


def test_hash_pinned_for_tiny_pack() -> None:
    assert payload_hash(TINY_PACK) == TINY_PACK_HASH
    # sorted keys, no whitespace, UTF-8 text
    assert canonical_payload(TINY_PACK).startswith(
        '{"category":"AppPack","depends_on":["platform-core"],"description":"Tiny é",'
    )


def test_hash_is_stable_and_ignores_source() -> None:
    copy = PackManifest.model_validate(TINY_PACK.model_dump(mode="json"))
    assert payload_hash(copy) == payload_hash(TINY_PACK)
    moved = TINY_PACK.model_copy(update={"source": "/somewhere/else"})
    assert payload_hash(moved) == payload_hash(TINY_PACK)
    assert '"source"' not in canonical_payload(TINY_PACK)
    assert "é" in canonical_payload(TINY_PACK)  # ensure_ascii=False


def _changes() -> list[dict[str, Any]]:
    thing = TINY_PACK.objects[0]
    size = thing.fields[0]
    double = thing.fields[1]

    def with_field(f: FieldSpec) -> dict[str, Any]:
        return {"objects": (thing.model_copy(update={"fields": (f, double)}),)}

    return [
        {"name": "tiny2"},
        {"version": "1.0.1"},
        {"description": "Tiny"},
        {"category": Category.ConnectorPack},
        {"depends_on": ()},
        {"objects": ()},
        {"objects": (thing.model_copy(update={"label": "Things"}),)},
        {"objects": (thing.model_copy(update={"fields": (double, size)}),)},
        with_field(size.model_copy(update={"precision": 6})),
        with_field(size.model_copy(update={"required": True})),
        with_field(size.model_copy(update={"label": "Size"})),
        {
            "objects": (
                thing.model_copy(
                    update={"fields": (size, double.model_copy(update={"formula": "Size__c * 3"}))}
                ),
            )
        },
    ]


@pytest.mark.parametrize("change", _changes())
def test_hash_changes_with_any_field(change: dict[str, Any]) -> None:
    assert payload_hash(TINY_PACK.model_copy(update=change)) != payload_hash(TINY_PACK)


# ---------------------------------------------------------------------------
# shipped platform packs


def test_platform_packs_load_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PACKS_DIR_ENV, raising=False)
    without = platform_packs(include_dev_sample=False)
    assert [p.name for p in without] == ["platform-core"]
    with_sample = platform_packs(include_dev_sample=True)
    assert [p.name for p in with_sample] == ["platform-core", "dev-sample"]
    core, sample = with_sample
    assert core.category == Category.PlatformCore and core.source == "builtin:platform-core"
    assert sample.category == Category.DevSample and sample.depends_on == ("platform-core",)
    assert {o.api_name for o in core.objects} == {
        "User",
        "Account",
        "Contact",
        "Lead",
        "Opportunity",
        "Case",
        "Campaign",
        "CampaignMember",
        "Task",
        "Event",
        "Product2",
        "Pricebook2",
        "Asset",
        "Contract",
        "Order",
    }
    assert PLATFORM_PACKS_DIR.is_dir()


def test_platform_core_fields() -> None:
    core = platform_packs(include_dev_sample=False)[0]
    for obj in core.objects:
        assert not obj.extends and obj.kind == "table"
        for f in obj.fields:
            assert not f.api_name.endswith("__c"), f"{obj.api_name}.{f.api_name}"
            assert f.api_name not in STANDARD_COLUMNS
    expected = {
        ("Contact", "AccountId"): FieldType.Lookup,
        ("Contact", "Email"): FieldType.Email,
        ("Contact", "MailingPostalCode"): FieldType.Text,
        ("Account", "AnnualRevenue"): FieldType.Currency,
        ("Account", "NumberOfEmployees"): FieldType.Number,
        ("Account", "Website"): FieldType.Url,
        ("Opportunity", "StageName"): FieldType.Picklist,
        ("Opportunity", "CloseDate"): FieldType.Date,
        ("Opportunity", "Probability"): FieldType.Percent,
        ("Case", "Description"): FieldType.LongTextArea,
        ("Case", "Origin"): FieldType.Picklist,
        ("User", "IsActive"): FieldType.Checkbox,
        ("Lead", "Company"): FieldType.Text,
    }
    for (obj_name, name), ftype in expected.items():
        assert _field(_obj(core, obj_name), name).type == ftype, f"{obj_name}.{name}"
    expected_revenue = _field(_obj(core, "Opportunity"), "ExpectedRevenue")
    assert expected_revenue.type == FieldType.Currency
    assert expected_revenue.formula == "Amount * Probability / 100"
    # every lookup points at an object of the pack
    names = {o.api_name for o in core.objects}
    for obj in core.objects:
        for f in obj.fields:
            if f.reference_to:
                assert f.reference_to in names, f"{obj.api_name}.{f.api_name}"

    sample = platform_packs(include_dev_sample=True)[1]
    task = _obj(sample, "Demo_Task__c")
    assert _field(task, "Due_In_Days__c").formula == "Due_Date__c - TODAY()"
    assert _field(task, "Account__c").reference_to == "Account"


def test_platform_packs_dir_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "pack.yaml").write_text("name: core\ncategory: PlatformCore\n")
    (tmp_path / ".hidden").mkdir()
    monkeypatch.setenv(PACKS_DIR_ENV, str(tmp_path))
    [core] = platform_packs(include_dev_sample=True)
    assert core.source == str((tmp_path / "core" / "pack.yaml").resolve())

    (tmp_path / "misnamed").mkdir()
    (tmp_path / "misnamed" / "pack.yaml").write_text("name: other\ncategory: AppPack\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "pack.yaml").write_text("name: broken\ncategory: Nope\n")
    with pytest.raises(PackProblems) as info:
        platform_packs(include_dev_sample=True)
    # every folder's problem at once
    text = str(info.value)
    assert "differs from its folder name" in text
    assert f"{tmp_path / 'empty'}" in text and "has no pack.yaml" in text
    assert "broken" in text and "category" in text
    assert len(info.value.problems) == 3, text

    monkeypatch.setenv(PACKS_DIR_ENV, str(tmp_path / "core" / "pack.yaml"))
    with pytest.raises(PackError, match=r"NEXUS_PACKS_DIR: platform packs folder is a file, not"):
        platform_packs(include_dev_sample=True)
    monkeypatch.setenv(PACKS_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(PackError, match=r"nowhere: NEXUS_PACKS_DIR: platform packs folder does"):
        platform_packs(include_dev_sample=True)


@needs_corpus
def test_corpus_data_fields_exist() -> None:
    """Every field the corpus data trees set exists: standard objects in
    platform-core, custom objects in the project's own pack."""
    core = platform_packs(include_dev_sample=False)[0]
    checked_standard = set()
    for project in (DREAMHOUSE, EBIKES):
        app = load_sfdx(project)
        owners = {o.api_name: o for o in core.objects}
        for o in app.objects:
            if not o.extends:
                owners[o.api_name] = o
        for data_file in sorted((project / "data").glob("*.json")):
            doc = json.loads(data_file.read_text())
            if not isinstance(doc, dict):
                continue  # the sample-data plan
            for record in doc["records"]:
                sobject = record["attributes"]["type"]
                assert sobject in owners, f"{data_file.name}: no object {sobject}"
                obj = owners[sobject]
                columns = {c.lower(): f for f in obj.fields for c in f.column_names()}
                for key, value in record.items():
                    if key == "attributes" or key in STANDARD_COLUMNS:
                        continue
                    f = columns.get(key.lower())
                    assert f is not None, f"{data_file.name}: {sobject}.{key} does not exist"
                    if isinstance(value, str) and value.startswith("@"):
                        assert f.type in (FieldType.Lookup, FieldType.MasterDetail), key
                    elif isinstance(value, int | float):
                        assert f.type in (
                            FieldType.Number,
                            FieldType.Currency,
                            FieldType.Percent,
                            FieldType.Location,
                        ), key
                    if "__" not in sobject:
                        checked_standard.add(f"{sobject}.{key}")
    assert {"Contact.Email", "Account.BillingCity"} <= checked_standard


# --- field attributes a field's type cannot have, and column sizes ----------------


def test_sfdx_field_rules_are_all_listed_at_once_per_element(tmp_path: Path) -> None:
    long_label = "x" * 100_000
    root = _sfdx_project(
        tmp_path / "app",
        {
            "Widget__c": {
                "Amt__c": _field_xml(
                    "Amt__c",
                    "<fullName>Amt__c</fullName><type>Number</type><precision>5</precision>"
                    f"<scale>7</scale><length>5</length><defaultValue>abc</defaultValue>"
                    f"<label>{long_label}</label>",
                ),
                "T__c": _field_xml(
                    "T__c",
                    "<type>Text</type><length>10</length><referenceTo>Account</referenceTo>"
                    "<summaryOperation>count</summaryOperation>",
                ),
                "C__c": _field_xml(
                    "C__c", "<type>Checkbox</type><defaultValue>maybe</defaultValue>"
                ),
                "P__c": _field_xml(
                    "P__c",
                    "<type>Picklist</type><valueSet><valueSetDefinition>"
                    "<value><fullName>X</fullName></value><value><fullName>X</fullName></value>"
                    "</valueSetDefinition></valueSet>",
                ),
                "Big__c": _field_xml("Big__c", "<type>Number</type><precision>19</precision>"),
                "Tx__c": _field_xml("Tx__c", "<type>Text</type><length>256</length>"),
                "Lt__c": _field_xml("Lt__c", "<type>LongTextArea</type><length>100</length>"),
            }
        },
    )
    with pytest.raises(PackProblems) as exc:
        load_sfdx(root)
    got = {(Path(p.file).name, p.element) for p in exc.value.problems}
    assert got >= {
        ("Amt__c.field-meta.xml", "<fullName>"),
        ("Amt__c.field-meta.xml", "<label>"),
        ("Amt__c.field-meta.xml", "<length>"),
        ("Amt__c.field-meta.xml", "<scale>"),
        ("Amt__c.field-meta.xml", "<defaultValue>"),
        ("T__c.field-meta.xml", "<referenceTo>"),
        ("T__c.field-meta.xml", "<summaryOperation>"),
        ("C__c.field-meta.xml", "<defaultValue>"),
        ("P__c.field-meta.xml", "<valueSet>"),
        ("Big__c.field-meta.xml", "<precision>"),
        ("Tx__c.field-meta.xml", "<length>"),
        ("Lt__c.field-meta.xml", "<length>"),
    }, got
    assert "at most 255 fit its column" in str(exc.value)


def test_a_system_column_field_hides_no_other_problem_of_its_object(tmp_path: Path) -> None:
    root = _sfdx_project(
        tmp_path / "app",
        {
            "Property__c": {
                "Id": _field_xml("Id", "<type>Text</type><length>10</length>"),
                "Broker__c": _field_xml(
                    "Broker__c", "<type>Lookup</type><referenceTo>1Bad</referenceTo>"
                ),
            },
            "Broker__c": {"N__c": _field_xml("N__c", "<type>Text</type><length>10</length>")},
        },
    )
    with pytest.raises(PackProblems) as exc:
        load_sfdx(root)
    text = str(exc.value)
    assert "Id collides with the system column" in text, text
    assert "Broker__c.field-meta.xml" in text and "<referenceTo>" in text, text
    assert isinstance(exc.value.partial, PackManifest)
    assert "Property__c" in {o.api_name for o in exc.value.partial.objects}


def test_native_yaml_null_lists_mean_not_set_and_rules_apply(tmp_path: Path) -> None:
    path = tmp_path / "pack.yaml"
    path.write_text(
        "name: nulls\ncategory: AppPack\ndepends_on:\nobjects:\n"
        "  - api_name: Thing__c\n    fields:\n"
        "  - api_name: Other__c\n    fields:\n"
        "      - {api_name: N__c, type: Number, precision: 5, scale: 7, length: 3,"
        " picklist_values: [A]}\n"
        "      - {api_name: P__c, type: Picklist, picklist_values: [X, X]}\n"
    )
    with pytest.raises(ManifestError) as exc:
        load_native(path)
    text = str(exc.value)
    assert "valid tuple" not in text, text
    for part in ("scale", "length", "picklist_values", "listed twice"):
        assert part in text, text
    path.write_text(
        "name: nulls\ncategory: AppPack\nobjects:\n  - api_name: Thing__c\n    fields:\n"
    )
    assert load_native(path).objects[0].fields == ()


def test_a_restricted_picklist_with_a_value_twice_is_one_problem(tmp_path: Path) -> None:
    """``Available`` and ``available`` in a restricted picklist: 'listed twice',
    not also "a restricted picklist needs its picklist_values" (it has them; a
    new user's trial got both)."""
    path = tmp_path / "pack.yaml"
    path.write_text(
        "name: twice\ncategory: AppPack\nobjects:\n  - api_name: Thing__c\n    fields:\n"
        "      - {api_name: S__c, type: Picklist, restricted: true,"
        " picklist_values: [Available, available, Sold]}\n"
    )
    with pytest.raises(ManifestError) as exc:
        load_native(path)
    text = str(exc.value)
    assert "'available' listed twice" in text, text
    assert "needs its picklist_values" not in text, text


def test_every_manifest_string_is_bounded_by_its_column() -> None:
    with pytest.raises(ValueError, match="at most 255"):
        ObjectSpec(api_name="A__c", label="x" * 256)
    with pytest.raises(ValueError, match="65,535"):
        FieldSpec(api_name="A__c", type=FieldType.Text, description="é" * 40_000)
    with pytest.raises(ValueError, match="at most 64"):
        PackManifest(name="a", category=Category.AppPack, version="1" * 65)
    FieldSpec(api_name="A__c", type=FieldType.Number, default_value="TODAY() - 1")


def test_missing_object_file_and_project_paths_say_what_is_wrong(tmp_path: Path) -> None:
    root = tmp_path / "app"
    root.mkdir()
    (root / "f").write_text("x")
    (root / "sfdx-project.json").write_text('{"packageDirectories": [{"path": "f"}]}')
    with pytest.raises(PackProblems, match="is a file, not a folder"):
        load_sfdx(root)
    (root / "sfdx-project.json").write_text('{"packageDirectories": [{"path": 5}]}')
    with pytest.raises(PackProblems, match="must be a string, not a number"):
        load_sfdx(root)
    with pytest.raises(ManifestError, match="not a folder nor a regular file"):
        load_pack_source("/dev/null")
    dashes = _sfdx_project(tmp_path / "---", {"A__c": {}})
    with pytest.raises(PackProblems) as exc:
        load_sfdx(dashes)
    assert len(exc.value.problems) == 1, exc.value.problems


def test_native_validation_errors_are_problems_one_per_key(tmp_path: Path) -> None:
    path = tmp_path / "pack.yaml"
    path.write_text(
        "name: many\ncategory: AppPack\nobjects:\n  - api_name: A__c\n"
        f"    label: {'y' * 100_000}\n    fields:\n"
        "      - {api_name: C__c, type: Checkbox, default_value: maybe}\n"
        "      - {api_name: T__c, type: Text, reference_to: Account}\n"
    )
    with pytest.raises(PackProblems) as exc:
        load_native(path)
    elements = [p.element for p in exc.value.problems]
    assert elements == [
        "objects[0](A__c).label",
        "objects[0](A__c).fields[0](C__c).default_value",
        "objects[0](A__c).fields[1](T__c).reference_to",
    ], exc.value.problems
    assert all(p.file == str(path) for p in exc.value.problems)
    assert len(str(exc.value)) < 2_000  # a 100,000-character value is not echoed whole


NATIVE_MISTAKES: dict[str, tuple[str, str]] = {
    # mistake -> (the field's YAML, what the report must say); each kind of check once
    "precision": ("{api_name: Amount__c, type: Number, precision: 40, scale: 2}", "equal to 18"),
    "no reference": ("{api_name: Ref__c, type: Lookup}", "field Ref__c: Lookup needs reference_to"),
    "text length": ("{api_name: Big__c, type: LongTextArea, length: 999999}", "131072"),
    "twice": ("{api_name: Amount__c, type: Text, length: 10}", "field Amount__c is declared twice"),
    "system column": ("{api_name: Id, type: Text, length: 10}", "field Id collides with a system"),
    "summary": ("{api_name: Sum__c, type: Summary}", "Summary needs a summary definition"),
    "formula on a lookup": (
        '{api_name: F__c, type: Lookup, formula: "1"}',
        "field F__c: a Lookup field cannot be a formula",
    ),
    "its reference too": ('{api_name: F2__c, type: Lookup, formula: "1"}', "F2__c: Lookup needs"),
    "bad type": ("{api_name: X__c, type: Nope}", "Input should be 'Text'"),
    "checkbox default": ("{api_name: C__c, type: Checkbox, default_value: maybe}", "'maybe'"),
    "empty formula": ('{api_name: E__c, type: Number, formula: " "}', "formula is empty"),
}


def test_a_native_manifest_reports_every_mistake_at_once(tmp_path: Path) -> None:
    """A fresh user's 12 mistakes took 5 rounds: pydantic checks a whole field,
    object or pack only once all its parts are valid, and each such check stopped
    at its first problem. Every mistake of each kind (field values, a field's
    shape, names twice or of a system column, objects twice) is reported in one
    load, each with its element and line; the precision bound is stated once (18)."""
    fields = "\n".join(f"      - {yaml_}" for yaml_, _ in NATIVE_MISTAKES.values())
    path = tmp_path / "pack.yaml"
    path.write_text(
        "name: bad-pack\ncategory: AppPack\ndepends_on: [platform-core]\nobjects:\n"
        f"  - api_name: Thing__c\n    fields:\n{fields}\n"
        "  - api_name: thing__c\n    fields:\n      - {api_name: Ok__c, type: Text, length: 5}\n"
    )
    with pytest.raises(PackProblems) as info:
        load_native(path)
    report = [f"{p.element}: {p.message}" for p in info.value.problems]
    missing = [k for k, (_, said) in NATIVE_MISTAKES.items() if not any(said in r for r in report)]
    assert not missing, (missing, report)
    assert any("object thing__c is declared twice" in r for r in report), report
    assert all(re.search(r"\(line \d+\)$", r) for r in report), report
    assert len(report) == len(set(report)), report  # nothing said twice
    assert not any("38" in r for r in report), report
    # the same file, each mistake fixed in turn, is accepted
    path.write_text(
        "name: bad-pack\ncategory: AppPack\ndepends_on: [platform-core]\nobjects:\n"
        "  - api_name: Thing__c\n    fields:\n      - {api_name: Ok__c, type: Text, length: 5}\n"
    )
    assert load_native(path).objects[0].api_name == "Thing__c"
