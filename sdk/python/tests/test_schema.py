"""Every dataclass of gpuplane.models against the contract it mirrors, so
the SDK cannot drift from the platform: the same properties (JSON names),
the same required ones, the same types.

A class's ``__schema__`` names a definition. It is looked up among the
``$defs`` of contracts/schema/*.json (the bus's messages, generated from the
Go types by `make schemas`), then among the components of the gateway's
OpenAPI document, contracts/openapi/gateway.openapi.json (the API's own
answers: JobStatus, SubmitResponse, UsageSummary, JobDescription, ...).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import typing
import unittest
from datetime import datetime
from typing import Any

from gpuplane import models

CONTRACTS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "contracts"))

# What every property of a contract must be, as a comparable shape:
# "int", "float", "str", "bool", "time", a class name, ("list", shape) or
# ("map", shape).
Shape = Any


def schema_defs() -> dict[str, dict[str, Any]]:
    """Every $defs entry of contracts/schema/*.json, by name. A definition
    that appears in several files must be the same in each."""
    defs: dict[str, dict[str, Any]] = {}
    files = sorted(glob.glob(os.path.join(CONTRACTS, "schema", "*.json")))
    if not files:
        raise AssertionError(f"no JSON Schemas under {CONTRACTS}/schema")
    for path in files:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        for name, d in doc.get("$defs", {}).items():
            if name in defs and defs[name] != d:
                raise AssertionError(f"$defs {name} differs between schema files ({path})")
            defs[name] = d
    return defs


def schema_shape(prop: dict[str, Any], defs: dict[str, dict[str, Any]]) -> Shape:
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[1]
        target = defs[name]
        if target.get("type") == "object" or "properties" in target:
            return name
        return schema_shape(target, defs)  # a named scalar (Duration)
    t = prop.get("type")
    if t == "array":
        return ("list", schema_shape(prop["items"], defs))
    if t == "object":
        return ("map", schema_shape(prop["additionalProperties"], defs))
    if t == "string":
        return "time" if prop.get("format") == "date-time" else "str"
    return {"integer": "int", "number": "float", "boolean": "bool"}[str(t)]


def openapi_components() -> dict[str, dict[str, Any]]:
    """components/schemas of the gateway's OpenAPI document."""
    with open(os.path.join(CONTRACTS, "openapi", "gateway.openapi.json"), encoding="utf-8") as f:
        comps: dict[str, dict[str, Any]] = json.load(f)["components"]["schemas"]
    return comps


def py_shape(tp: Any) -> Shape:
    tp = models.unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if origin is list:
        return ("list", py_shape(typing.get_args(tp)[0]))
    if origin is dict:
        key, val = typing.get_args(tp)
        assert key is str
        return ("map", py_shape(val))
    if tp is datetime:
        return "time"
    if dataclasses.is_dataclass(tp):
        return str(getattr(tp, "__schema__"))
    return {int: "int", float: "float", str: "str", bool: "bool"}[tp]


def py_properties(cls: type) -> dict[str, tuple[Shape, bool]]:
    hints = models._hints(cls)
    return {models.json_name(f): (py_shape(hints[f.name]), models.is_required(f)) for f in models.wire_fields(cls)}


class SchemaTest(unittest.TestCase):
    def test_models_match_the_contracts(self) -> None:
        sources = {"schema": schema_defs(), "openapi": openapi_components()}
        source_of: dict[str, str] = {}
        for cls in models.MODELS:
            name = cls.__schema__  # type: ignore[attr-defined]
            with self.subTest(name):
                src = next((k for k, defs in sources.items() if name in defs), None)
                self.assertIsNotNone(src, f"{name}: in no schema file and not in the OpenAPI document")
                assert src is not None
                source_of[name] = src
                defs = sources[src]
                d = defs[name]
                want = {p: (schema_shape(s, defs), p in d.get("required", [])) for p, s in d["properties"].items()}
                got = py_properties(cls)
                self.assertEqual(sorted(got), sorted(want), f"{cls.__name__}: properties differ from {src} {name}")
                for prop in want:
                    self.assertEqual(got[prop][0], want[prop][0], f"{cls.__name__}.{prop}: type")
                    self.assertEqual(got[prop][1], want[prop][1], f"{cls.__name__}.{prop}: required")
        # The messages the SDK sends and streams are held to the bus's
        # published schemas; the answers to the OpenAPI document.
        for name in ("JobRequest", "JobEvent", "UsageRecord", "Placement", "FieldError"):
            self.assertEqual(source_of.get(name), "schema", name)
        for name in ("JobStatus", "SubmitResponse", "UsageSummary", "JobDescription", "APIErrorBody"):
            self.assertEqual(source_of.get(name), "openapi", name)

    def test_every_object_reached_is_a_dataclass(self) -> None:
        # A nested object left as a raw dict would escape the check above.
        named = {c.__schema__ for c in models.MODELS}  # type: ignore[attr-defined]
        for cls in models.MODELS:
            for prop, (shape, _) in py_properties(cls).items():
                while isinstance(shape, tuple):
                    shape = shape[1]
                if shape not in ("int", "float", "str", "bool", "time"):
                    self.assertIn(shape, named, f"{cls.__name__}.{prop}")

    def test_check_catches_drift(self) -> None:
        # The comparison itself: a renamed, a dropped and a retyped property
        # are each seen.
        @dataclasses.dataclass(kw_only=True)
        class Drifted:
            __schema__ = "FieldError"
            field: str
            code: str
            message: int
        got = py_properties(Drifted)
        want = {p: (schema_shape(s, schema_defs()), True) for p, s in schema_defs()["FieldError"]["properties"].items()}
        self.assertNotEqual(sorted(got), sorted(want))
        self.assertNotEqual(got["message"], want["message"])

    def test_round_trip(self) -> None:
        req = models.JobRequest(id="j1", name="n", resources=models.Resources(
            gpu=models.GPURequest(count=2, model="H100-80GB", share=None), memory_mib=1024),
            run=models.RunSpec(command=["sh", "-c", "true"], env={"A": "1"}),
            tolerations=[models.Toleration(key="k", operator="Exists")])
        doc = models.to_dict(req)
        # Required properties always, optional ones only when set.
        self.assertEqual(doc, {"id": "j1", "name": "n",
                               "resources": {"gpu": {"count": 2, "model": "H100-80GB"}, "memoryMiB": 1024},
                               "run": {"command": ["sh", "-c", "true"], "env": {"A": "1"}},
                               "tolerations": [{"key": "k", "operator": "Exists"}]})
        self.assertEqual(models.from_dict(models.JobRequest, json.loads(json.dumps(doc))), req)

    def test_decode_times_and_unknown_properties(self) -> None:
        ev = models.from_dict(models.JobEvent, {
            "schemaVersion": 1, "type": "running", "tenant": "acme", "jobId": "j", "attempt": 1,
            "state": "running", "time": "2026-11-26T17:38:37.010709358Z", "aPropertyOfTomorrow": True,
            "exitCode": 0})
        self.assertEqual(ev.time, datetime.fromisoformat("2026-11-26T17:38:37.010709+00:00"))
        self.assertEqual(ev.exit_code, 0)
        self.assertFalse(ev.terminal)
        with self.assertRaises(ValueError):
            models.from_dict(models.JobEvent, {"type": "running"})


if __name__ == "__main__":
    unittest.main()
