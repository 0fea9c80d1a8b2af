"""Hostile names in pack manifests and Salesforce DX projects (issue 17 item 4).

Quotes, backticks, ``;``, ``--``, ``%``, emoji and 300 characters, in every
place a name or a text reaches the database, on SQLite and MariaDB:

- where the text is free (labels, plural and name-field labels, descriptions,
  picklist values, default values, a pack's version, relationship names,
  custom label values, formula string literals): ApplyAll through Temporal
  completes, every row stores the text exactly (read back), the views build
  and answer with it, and nothing of it was run as SQL (the table a label
  says to drop is still there);
- where it is not (object and field API names, lookup targets, pack names,
  and any text longer than its column): the load refuses it naming the file
  and the element, ``packs import-sfdx`` and ``apply-all --wait`` exit 1 with
  no traceback, and the database equals its state before the run (schema,
  metadata rows, installed packs, row counts of every ``_System_*`` table),
  the good pack given in the same run included.

The name rules themselves are properties (hypothesis, derandomized): any name
is loaded exactly as written or refused naming where.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, inspect, select, text

from nexuscrm import catalog
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import quote
from nexuscrm.db.engine import make_engine
from nexuscrm.errors import PackProblems
from nexuscrm.formulas import view_name
from nexuscrm.packs.loader import load_native
from nexuscrm.packs.model import IDENTIFIER_RE, LABEL_MAX_CHARS
from nexuscrm.packs.sfdx import load_sfdx
from nexuscrm.settings import Settings
from nexusctl.worker import build_worker
from tests.builders import (
    apply_all,
    cli_env,
    db_state,
    invoke,
    invoke_async,
    write_sfdx,
    write_small_pack,
)

# Free text, legal wherever a label goes (none over 255 characters, none
# blank or with leading/trailing blanks, which XML reading trims).
HOSTILE = {
    "quote": "x'); DROP TABLE Victim__c; --",
    "backtick": "`Victim__c`; DROP TABLE `Victim__c`; --",
    "double-quote": 'say "hi" \\ back\\slash \\" end',
    "comment": "a; b -- c /* d */ # e",
    "percent": "100% %s %(x)s _x_ :name",
    "emoji": "🚀 ünïcødé 日本語 ✓ \u200b!",
    "255": "L" * 254 + "Z",
}
# Names that are not API names (a letter, then letters, digits and '_', at
# most 63 characters, no '___', no trailing '_').
BAD_NAMES = {
    "quote": "Bad'x__c",
    "backtick": "Bad`x__c",
    "semicolon": "Bad;x__c",
    "dashes": "Bad--x__c",
    "injection": "x__c; DROP TABLE Victim__c; --",
    "300": "A" * 297 + "__c",
}
TOO_LONG = "T" * 300


def lit(value: str) -> str:
    """``value`` as a formula text literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def xml(value: str) -> str:
    return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _crashed(res: Any) -> bool:
    return res.exception is not None and not isinstance(res.exception, SystemExit)


def _refused(res: Any) -> str:
    """The output of a run that exited 1 with an ``error:`` line and no traceback."""
    assert res.exit_code == 1, res.output
    assert not _crashed(res) and "Traceback" not in res.output, res.output
    assert any(line.startswith("error: ") for line in res.output.splitlines()), res.output
    return " ".join(res.output.split())


# --------------------------------------------------------------------------------------
# the packs


def victim_pack(path: Path) -> Path:
    return write_small_pack(path, "victim-app", "Victim__c")


def legal_native(path: Path) -> Path:
    """Every free-text place of a native manifest holding hostile text."""
    values = list(HOSTILE.values())
    formulas = [
        {"api_name": f"F{i}__c", "type": "Text", "label": v, "formula": lit(v)}
        for i, v in enumerate(values)
    ]
    doc = {
        "name": "hostile-native",
        "category": "AppPack",
        "version": HOSTILE["comment"],
        "description": "\n".join(values),
        "depends_on": ["platform-core", "victim-app"],
        "labels": [{"name": "Hostile_Label", "value": HOSTILE["backtick"]}],
        "objects": [
            {
                "api_name": "Hostile__c",
                "label": HOSTILE["quote"],
                "plural_label": HOSTILE["backtick"],
                "name_field_label": HOSTILE["emoji"],
                "description": "\n".join(values),
                "fields": [
                    {
                        "api_name": "Kind__c",
                        "type": "Picklist",
                        "label": HOSTILE["double-quote"],
                        "description": HOSTILE["percent"],
                        "picklist_values": values,
                        "default_value": lit(HOSTILE["quote"]),
                    },
                    {
                        "api_name": "Note__c",
                        "type": "Text",
                        "length": 255,
                        "label": HOSTILE["255"],
                        "default_value": lit(HOSTILE["backtick"]),
                    },
                    {
                        "api_name": "Victim__c",
                        "type": "Lookup",
                        "reference_to": "Victim__c",
                        "label": HOSTILE["comment"],
                        "relationship_name": HOSTILE["quote"],
                    },
                    *formulas,
                    {"api_name": "Pick__c", "type": "Text", "formula": "TEXT(Kind__c)"},
                    {
                        "api_name": "Is__c",
                        "type": "Checkbox",
                        "formula": f"ISPICKVAL(Kind__c, {lit(HOSTILE['quote'])})",
                    },
                    {"api_name": "Lab__c", "type": "Text", "formula": "$Label.Hostile_Label"},
                ],
            }
        ],
    }
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    return path


def legal_sfdx(root: Path) -> Path:
    """Every free-text place of a Salesforce DX project holding hostile text."""
    values = list(HOSTILE.values())
    picklist = "".join(
        f"<value><fullName>{xml(v)}</fullName><default>{str(i == 1).lower()}</default>"
        f"<label>{xml(v)}</label></value>"
        for i, v in enumerate(values)
    )
    fields = {
        "Kind__c": f"<label>{xml(HOSTILE['double-quote'])}</label><type>Picklist</type>"
        f"<description>{xml(HOSTILE['emoji'])}</description>"
        f"<valueSet><valueSetDefinition>{picklist}</valueSetDefinition></valueSet>",
        "Note__c": f"<label>{xml(HOSTILE['255'])}</label><type>Text</type><length>255</length>"
        f"<description>{xml(HOSTILE['comment'])}</description>"
        f"<inlineHelpText>{xml(HOSTILE['quote'])}</inlineHelpText>"
        f"<defaultValue>{xml(lit(HOSTILE['percent']))}</defaultValue>",
        "Is__c": "<label>Is</label><type>Checkbox</type>"
        f"<formula>{xml('ISPICKVAL(Kind__c, ' + lit(HOSTILE['backtick']) + ')')}</formula>",
        "Lab__c": "<label>Lab</label><type>Text</type><formula>$Label.Hostile_Label2</formula>",
        **{
            f"F{i}__c": f"<label>{xml(v)}</label><type>Text</type><formula>{xml(lit(v))}</formula>"
            for i, v in enumerate(values)
        },
    }
    write_sfdx(root, fields, obj="Hostile2__c", label=xml(HOSTILE["backtick"]),
               project="hostile-sfdx")  # fmt: skip
    labels = root / "force-app" / "main" / "default" / "labels"
    labels.mkdir()
    (labels / "CustomLabels.labels-meta.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<CustomLabels xmlns="http://soap.sforce.com/2006/04/metadata"><labels>'
        f"<fullName>Hostile_Label2</fullName><value>{xml(HOSTILE['emoji'])}</value>"
        "</labels></CustomLabels>",
        encoding="utf-8",
    )
    return root


def illegal_native(path: Path) -> tuple[Path, list[tuple[str, str]]]:
    """A manifest with a bad name (or a text too long) in every place; and the
    (element, message part) of each problem it must be refused with."""
    objects: list[dict[str, Any]] = [
        {"api_name": name, "label": "ok"} for name in BAD_NAMES.values()
    ]
    fields: list[dict[str, Any]] = [
        {"api_name": name, "type": "Text", "length": 10} for name in BAD_NAMES.values()
    ]
    fields += [
        {"api_name": f"Ref{i}__c", "type": "Lookup", "reference_to": name}
        for i, name in enumerate(BAD_NAMES.values())
    ]
    fields += [
        {"api_name": "LongLabel__c", "type": "Text", "label": TOO_LONG},
        {"api_name": "LongPick__c", "type": "Picklist", "picklist_values": ["ok", TOO_LONG]},
        {"api_name": "LongRel__c", "type": "Lookup", "reference_to": "Account",
         "relationship_name": TOO_LONG},
    ]  # fmt: skip
    objects.append(
        {"api_name": "Fine__c", "label": TOO_LONG, "name_field_label": TOO_LONG, "fields": fields}
    )
    doc = {
        "name": "x'); drop table victim__c; --",
        "category": "AppPack",
        "version": TOO_LONG,
        "depends_on": ["platform-core"],
        "objects": objects,
    }
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    n = len(BAD_NAMES)
    fine = f"objects[{n}](Fine__c)"
    expected = [("name", "must be lower-case letters"), ("version", "300 characters long")]
    expected += [
        (f"objects[{i}]({name}).api_name", "is not a valid API name")
        for i, name in enumerate(BAD_NAMES.values())
    ]
    expected += [(f"{fine}.label", "300 characters long"), (f"{fine}.name_field_label", "300")]
    expected += [
        (f"{fine}.fields[{i}]({name}).api_name", "is not a valid API name")
        for i, name in enumerate(BAD_NAMES.values())
    ]
    expected += [
        (f"{fine}.fields[{n + i}](Ref{i}__c).reference_to", "is not a valid API name")
        for i in range(n)
    ]
    expected += [
        (f"{fine}.fields[{2 * n}](LongLabel__c).label", "300 characters long"),
        (f"{fine}.fields[{2 * n + 1}](LongPick__c).picklist_values", "over 255 characters"),
        (f"{fine}.fields[{2 * n + 2}](LongRel__c).relationship_name", "at most 128"),
    ]
    return path, expected


# A file name holds 255 bytes: 300 characters are tried in <referenceTo>, and
# as long a name as fits in folder and file names.
SFDX_BAD_FOLDERS = [v for k, v in BAD_NAMES.items() if k != "300"] + ["B" * 230 + "__c"]
SFDX_BAD_FIELDS = [v for k, v in BAD_NAMES.items() if k != "300"] + ["C" * 230 + "__c"]


def illegal_sfdx(root: Path) -> tuple[Path, list[tuple[str, str, str]]]:
    """A project with a bad name (or a text too long) in every place; and the
    (file, element, message part) of each problem it must be refused with."""
    base = root / "force-app" / "main" / "default" / "objects"
    fields = {
        f"Ref{i}__c": f"<label>R</label><type>Lookup</type><referenceTo>{xml(name)}</referenceTo>"
        for i, name in enumerate(BAD_NAMES.values())
    } | {
        "LongLabel__c": f"<label>{TOO_LONG}</label><type>Text</type><length>10</length>",
        "LongPick__c": "<label>P</label><type>Picklist</type><valueSet><valueSetDefinition>"
        f"<value><fullName>{TOO_LONG}</fullName></value></valueSetDefinition></valueSet>",
        **{
            name: "<label>N</label><type>Text</type><length>10</length>" for name in SFDX_BAD_FIELDS
        },
    }
    write_sfdx(root, {}, obj="Fine__c", label=TOO_LONG, project="bad-sfdx")
    for name, body in fields.items():
        (base / "Fine__c" / "fields" / f"{name}.field-meta.xml").write_text(
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            '<CustomField xmlns="http://soap.sforce.com/2006/04/metadata">'
            f"<fullName>{xml(name)}</fullName>{body}</CustomField>"
        )
    for name in SFDX_BAD_FOLDERS:
        write_sfdx(root / "ignored", {}, obj=name)  # the same files, moved into the project
        (root / "ignored" / "force-app" / "main" / "default" / "objects" / name).rename(base / name)
    fields_dir = base / "Fine__c" / "fields"
    expected = [(str(base / name), "", "is not a valid API name") for name in SFDX_BAD_FOLDERS]
    expected += [
        (str(fields_dir / f"{name}.field-meta.xml"), "<fullName>", "is not a valid API name")
        for name in SFDX_BAD_FIELDS
    ]
    expected += [
        (str(fields_dir / f"Ref{i}__c.field-meta.xml"), "<referenceTo>", "is not a valid API name")
        for i in range(len(BAD_NAMES))
    ]
    expected += [
        (str(fields_dir / "LongLabel__c.field-meta.xml"), "<label>", "300 characters long"),
        (str(fields_dir / "LongPick__c.field-meta.xml"), "<valueSet>", "over 255 characters"),
        (str(base / "Fine__c" / "Fine__c.object-meta.xml"), "", "300 characters long"),
    ]
    return root, expected


def _assert_problems(problems: list[Any], expected: list[tuple[str, str, str]]) -> None:
    for file, element, part in expected:
        assert any(
            p.file == file and p.element == element and part in p.message for p in problems
        ), (file, element, part, [p for p in problems if p.file == file])


# --------------------------------------------------------------------------------------
# the rules, at load: every bad name refused naming the file and the element


def test_bad_names_in_a_manifest_are_each_refused_naming_the_element(tmp_path: Path) -> None:
    path, expected = illegal_native(tmp_path / "bad.yaml")
    with pytest.raises(PackProblems) as info:
        load_native(path)
    _assert_problems(info.value.problems, [(str(path), e, m) for e, m in expected])
    assert len(info.value.problems) == len(expected), info.value


def test_bad_names_in_a_sfdx_project_are_each_refused_naming_file_and_element(
    tmp_path: Path,
) -> None:
    root, expected = illegal_sfdx(tmp_path / "bad-sfdx")
    with pytest.raises(PackProblems) as info:
        load_sfdx(root)
    _assert_problems(info.value.problems, expected)
    assert len(info.value.problems) == len(expected), info.value


def test_a_custom_metadata_record_name_or_label_too_long_is_a_problem_naming_it(
    tmp_path: Path,
) -> None:
    """Found here: a record file named with a DeveloperName over 40 characters, or
    with a ``<label>`` over 255, ended ``packs import-sfdx`` (and ApplyAll's
    plan-packs) in a bare pydantic ``ValidationError`` traceback naming no file."""
    root = write_sfdx(tmp_path / "mdt", {"Size__c": "<label>S</label><type>Text</type>"
                                         "<length>10</length>"}, obj="Cfg__mdt")  # fmt: skip
    records = root / "force-app" / "main" / "default" / "customMetadata"
    records.mkdir()
    body = '<?xml version="1.0"?><CustomMetadata xmlns="http://soap.sforce.com/2006/04/metadata">'
    long_name = records / f"Cfg.{'N' * 60}.md-meta.xml"
    long_name.write_text(body + "<label>x</label></CustomMetadata>")
    long_label = records / "Cfg.Fine.md-meta.xml"
    long_label.write_text(body + f"<label>{TOO_LONG}</label></CustomMetadata>")
    injected = records / f"Cfg.{xml(HOSTILE['quote'])}.md-meta.xml"
    injected.write_text(body + f"<label>{xml(HOSTILE['backtick'])}</label></CustomMetadata>")
    with pytest.raises(PackProblems) as info:
        load_sfdx(root)
    _assert_problems(
        info.value.problems,
        [
            (str(long_name), "", "DeveloperName (in the file name): is 60 characters long"),
            (str(long_label), "", "<label>: is 300 characters long"),
        ],
    )
    assert len(info.value.problems) == 2, info.value  # the hostile one is free text
    res = invoke(["packs", "import-sfdx", str(root)], cli_env())
    output = _refused(res)
    assert f"{long_name}: - DeveloperName (in the file name): is 60 characters" in output


# Names and labels drawn at random, and the hostile ones: a name loads exactly as
# written when it is an API name, else it is refused naming the file and the element.
NAMES = st.one_of(
    st.text(max_size=70),
    st.from_regex(IDENTIFIER_RE, fullmatch=True),
    st.sampled_from([*BAD_NAMES.values(), *HOSTILE.values(), "A" * 63, "A" * 64, "a___b", "a_"]),
)
RULES = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _api_name_ok(name: str) -> bool:
    return bool(IDENTIFIER_RE.fullmatch(name)) and "___" not in name and not name.endswith("_")


@RULES
@given(name=NAMES, where=st.sampled_from(["object", "field", "reference", "label", "picklist"]))
@example(name=HOSTILE["quote"], where="object")
@example(name="Name", where="field")
@example(name="x\udc80", where="label")
def test_any_name_loads_exactly_or_is_refused_naming_the_element(name: str, where: str) -> None:
    field: dict[str, Any] = {"api_name": "F__c", "type": "Text", "length": 10}
    obj: dict[str, Any] = {"api_name": "G__c", "fields": [field]}
    element = {
        "object": "objects[0]",
        "field": "objects[0](G__c).fields[0]",
        "reference": "objects[0](G__c).fields[0](F__c).reference_to",
        "label": "objects[0](G__c).fields[0](F__c).label",
        "picklist": "objects[0](G__c).fields[0](F__c).picklist_values",
    }[where]
    if where == "object":
        obj["api_name"] = name
    elif where == "field":
        field["api_name"] = name
    elif where == "reference":
        field.update(type="Lookup", reference_to=name, length=None)
    elif where == "label":
        field["label"] = name
    else:
        field.update(type="Picklist", picklist_values=[name], length=None)
    doc = {"name": "rules", "category": "AppPack", "objects": [obj]}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "pack.json"
        path.write_text(json.dumps(doc))  # ASCII: a lone surrogate stays an escape
        try:
            pack = load_native(path)
        except PackProblems as exc:
            assert all(p.file == str(path) for p in exc.problems), exc.problems
            assert any(
                p.element.startswith(element)
                # a system column's name: the object's check names the field
                or (p.element == "objects[0](G__c)" and f"field {name} collides" in p.message)
                for p in exc.problems
            ), exc.problems
            return
        except Exception as exc:  # the document itself: a lone surrogate
            assert str(path) in str(exc) and "lone surrogate" in str(exc), exc
            return
    got = pack.objects[0]
    value = {
        "object": got.api_name,
        "field": got.fields[0].api_name,
        "reference": got.fields[0].reference_to,
        "label": got.fields[0].label,
        "picklist": (got.fields[0].picklist_values or ("",))[0],
    }[where]
    assert value == name  # never silently changed
    if where in ("object", "field", "reference"):
        assert _api_name_ok(name), name
    else:
        assert len(name) <= LABEL_MAX_CHARS and (where == "label" or name.strip())


# --------------------------------------------------------------------------------------
# through Temporal, on SQLite and MariaDB


def _view_row(engine: Engine, obj: str, row_id: str) -> dict[str, Any]:
    with engine.connect() as conn:
        view = quote(conn, view_name(obj))
        row = conn.execute(text(f"SELECT * FROM {view} WHERE {quote(conn, 'Id')} = :id"),
                           {"id": row_id}).mappings().one()  # fmt: skip
    return {k.lower(): v for k, v in row.items()}


async def test_hostile_text_is_stored_exactly_and_never_runs_as_sql(
    temporal_env: Any, settings: Settings, tmp_path: Path
) -> None:
    native = legal_native(tmp_path / "hostile.yaml")
    project = legal_sfdx(tmp_path / "hostile-sfdx")
    victim = victim_pack(tmp_path / "victim.yaml")
    result = await apply_all(
        temporal_env, settings, app_pack_sources=[str(victim), str(native), str(project)]
    )
    assert result.status == "completed", result.reason
    detail = next(p.detail or "" for p in result.phases if p.name == "rebuild-derived")
    assert "left out" not in detail, detail  # every formula is in its view
    engine = make_engine(settings.database_url)
    try:
        values = list(HOSTILE.values())
        with engine.connect() as conn:
            objects = {
                r.ApiName: r
                for r in conn.execute(select(t.object_meta).where(
                    t.object_meta.c.ApiName.in_(["Hostile__c", "Hostile2__c"])))
            }  # fmt: skip
            fields = {
                (r.ObjectApiName, r.ApiName): r
                for r in conn.execute(select(t.field_meta).where(
                    t.field_meta.c.ObjectApiName.in_(["Hostile__c", "Hostile2__c"])))
            }  # fmt: skip
            packs = {
                r.Name: r
                for r in conn.execute(select(t.installed_pack).where(
                    t.installed_pack.c.Name.in_(["hostile-native", "hostile-sfdx"])))
            }  # fmt: skip
        # stored exactly, wherever the text goes
        native_obj = objects["Hostile__c"]
        assert (native_obj.Label, native_obj.PluralLabel) == (HOSTILE["quote"], HOSTILE["backtick"])
        assert native_obj.Description == "\n".join(values)
        kind = fields[("Hostile__c", "Kind__c")]
        assert kind.Label == HOSTILE["double-quote"] and kind.Description == HOSTILE["percent"]
        assert json.loads(kind.PicklistValues) == values
        assert kind.DefaultValue == lit(HOSTILE["quote"])
        note = fields[("Hostile__c", "Note__c")]
        assert note.Label == HOSTILE["255"] and note.DefaultValue == lit(HOSTILE["backtick"])
        ref = fields[("Hostile__c", "Victim__c")]
        assert ref.Label == HOSTILE["comment"] and ref.RelationshipName == HOSTILE["quote"]
        for i, v in enumerate(values):
            for obj in ("Hostile__c", "Hostile2__c"):
                assert fields[(obj, f"F{i}__c")].Label == v
                assert fields[(obj, f"F{i}__c")].Formula == lit(v)
        assert packs["hostile-native"].Version == HOSTILE["comment"]
        payload = json.loads(packs["hostile-native"].Payload)
        assert payload["description"] == "\n".join(values)
        assert payload["objects"][0]["name_field_label"] == HOSTILE["emoji"]
        assert payload["labels"] == [{"name": "Hostile_Label", "value": HOSTILE["backtick"]}]
        sfdx_obj = objects["Hostile2__c"]
        assert (sfdx_obj.Label, sfdx_obj.PluralLabel) == (
            HOSTILE["backtick"], HOSTILE["backtick"] + "s"
        )  # fmt: skip
        kind2 = fields[("Hostile2__c", "Kind__c")]
        assert kind2.Label == HOSTILE["double-quote"] and kind2.Description == HOSTILE["emoji"]
        assert json.loads(kind2.PicklistValues) == values
        assert kind2.DefaultValue == lit(values[1])  # the <default>true</default> value
        note2 = fields[("Hostile2__c", "Note__c")]
        assert (note2.Label, note2.Description) == (HOSTILE["255"], HOSTILE["comment"])
        assert note2.DefaultValue == lit(HOSTILE["percent"])
        sfdx_payload = json.loads(packs["hostile-sfdx"].Payload)
        assert sfdx_payload["labels"] == [{"name": "Hostile_Label2", "value": HOSTILE["emoji"]}]
        # nothing ran as SQL: the table the labels say to drop is there, and answers
        assert "Victim__c" in inspect(engine).get_table_names()
        with engine.begin() as conn:
            for obj, kind_value in (("Hostile__c", HOSTILE["quote"]),
                                    ("Hostile2__c", HOSTILE["backtick"])):  # fmt: skip
                conn.execute(
                    text(
                        f"INSERT INTO {quote(conn, obj)} ({quote(conn, 'Id')}, "
                        f"{quote(conn, 'Name')}, {quote(conn, 'Kind__c')}, "
                        f"{quote(conn, 'IsDeleted')}) VALUES (:i, :n, :k, :d)"
                    ),
                    {"i": f"{obj}-1", "n": HOSTILE["emoji"], "k": kind_value, "d": False},
                )
            conn.execute(text(f"SELECT * FROM {quote(conn, 'v_Victim__c')}")).all()
        # the views answer with the text exactly
        row = _view_row(engine, "Hostile__c", "Hostile__c-1")
        assert [row[f"f{i}__c"] for i in range(len(values))] == values
        assert row["name"] == HOSTILE["emoji"] and row["pick__c"] == HOSTILE["quote"]
        assert bool(row["is__c"]) and row["lab__c"] == HOSTILE["backtick"]
        row2 = _view_row(engine, "Hostile2__c", "Hostile2__c-1")
        assert [row2[f"f{i}__c"] for i in range(len(values))] == values
        assert bool(row2["is__c"]) and row2["lab__c"] == HOSTILE["emoji"]
    finally:
        engine.dispose()


async def test_bad_names_fail_the_run_naming_each_and_change_nothing(
    temporal_env: Any, settings: Settings, tmp_path: Path
) -> None:
    victim = victim_pack(tmp_path / "victim.yaml")
    result = await apply_all(temporal_env, settings, app_pack_sources=[str(victim)])
    assert result.status == "completed", result.reason
    engine = make_engine(settings.database_url)
    try:
        before = db_state(engine)
        good = write_small_pack(tmp_path / "good.yaml", "good-app", "Good__c")
        native, native_expected = illegal_native(tmp_path / "bad.yaml")
        project, sfdx_expected = illegal_sfdx(tmp_path / "bad-sfdx")
        env = cli_env(settings, temporal_env)
        # the dry run names every problem of the project, by file and element
        output = _refused(await invoke_async(["packs", "import-sfdx", str(project)], env))
        for file, element, part in sfdx_expected:
            assert f"{file}: - {element + ': ' if element else ''}" in output, (file, output)
            assert part in output
        catalog.CACHE.invalidate()
        async with build_worker(temporal_env.client, settings):
            args = ["apply-all", "--wait"]
            for source in (victim, good, native, project):
                args += ["--app-pack", str(source)]
            output = _refused(await invoke_async(args, env))
        assert "plan-packs" in output, output
        assert str(native) in output and str(project) in output, output
        for element, _part in native_expected[:3]:
            assert element in output, (element, output)
        catalog.CACHE.invalidate()
        assert db_state(engine) == before  # the good pack of the run too: nothing applied
        assert "Victim__c" in inspect(engine).get_table_names()
    finally:
        engine.dispose()
