"""DeepSpeed's pydantic config models as JSON, and back as equivalent pydantic models that need no DeepSpeed.

`model_spec` (run where DeepSpeed is imported, by trainer/ds/learned.py) writes each field of a model as its name,
alias, whether it is required or deprecated, and its type as a small JSON tree: bool, int, float, str, path, none,
list/dict/tuple (bare or of an element type), literal and enum values, unions, nested models, "instance" (a class
JSON cannot hold: torch.dtype), and "any" where the type cannot be written down (a validator that runs before the
type check, a constraint we do not know) - there the light check accepts every value and the live check (run
wherever DeepSpeed is imported anyway: train, preflight, ...) is the judge. After-validators (cross-field checks)
are not mirrored either, for the same reason; the type checks stay valid since they run first.

`mirror_models` turns the JSON back into pydantic models with the same names, types, constraints and settings
(extra keys forbidden, fields by name or alias, lax coercion), so pydantic gives the same errors, word for word,
as DeepSpeed's models for the values it can judge. pydantic is light; torch and DeepSpeed are not.
"""
from __future__ import annotations

import enum
import pathlib
import types
import typing
from typing import Any

CONSTRAINTS = ("Gt", "Ge", "Lt", "Le", "MultipleOf", "MinLen", "MaxLen")  # annotated_types, copied as they are
ANY = {"kind": "any"}
_BARE = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict", tuple: "tuple",
         type(None): "none", pathlib.Path: "path"}


# --- learning (DeepSpeed imported) --------------------------------------------------------------------------

def model_spec(model: type, models: dict[str, dict]) -> str:
    """Write `model` (and the models its fields use) into `models`; return its key (module.Class)."""
    key = f"{model.__module__}.{model.__qualname__}"
    if key in models:
        return key
    models[key] = {}  # a model that refers to itself stops here
    decorators = model.__pydantic_decorators__
    opaque_fields = {field for v in decorators.field_validators.values() if v.info.mode != "after"
                     for field in v.info.fields}
    fields = {}
    for name, info in model.model_fields.items():
        opaque = name in opaque_fields or "*" in opaque_fields or _has_unknown_metadata(info)
        field = {"type": ANY if opaque else _with_constraints(type_spec(info.annotation, models), info.metadata),
                 "required": info.is_required()}
        if info.alias and info.alias != name:
            field["alias"] = info.alias
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get("deprecated"):
            field["deprecated"] = {"new_param": str(extra.get("new_param") or "")}
        fields[name] = field
    models[key] = {"name": model.__name__, "module": model.__module__, "class": model.__qualname__,
                   "fields": fields,
                   # a validator that runs before pydantic's own checks can accept what the types refuse
                   "opaque": any(v.info.mode in ("before", "wrap") for v in decorators.model_validators.values())}
    return key


def type_spec(annotation: Any, models: dict[str, dict]) -> dict:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in (Any, object):
        return ANY
    if annotation in _BARE:
        return {"kind": _BARE[annotation]}
    if origin is typing.Literal and all(isinstance(a, (bool, int, float, str, type(None))) for a in args):
        return {"kind": "literal", "values": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"kind": "union", "of": [type_spec(a, models) for a in args]}
    if origin is list and len(args) == 1:
        return {"kind": "list", "of": type_spec(args[0], models)}
    if origin is dict and len(args) == 2:
        return {"kind": "dict", "key": type_spec(args[0], models), "value": type_spec(args[1], models)}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _enum_spec(annotation)
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        nested = model_spec(annotation, models)
        return ANY if models[nested].get("opaque") else {"kind": "model", "model": nested}
    if isinstance(annotation, type) and origin is None and not args:
        return {"kind": "instance", "name": annotation.__name__}  # arbitrary_types_allowed: an isinstance check
    return ANY


def _enum_spec(cls: type) -> dict:
    values = [member.value for member in cls.__members__.values()]
    if not all(isinstance(v, (bool, int, float, str)) for v in values):
        return ANY
    base = "int" if issubclass(cls, int) else "str" if issubclass(cls, str) else ""
    return {"kind": "enum", "name": cls.__name__, "base": base,
            "members": [[name, member.value] for name, member in cls.__members__.items()]}  # aliases included


def _has_unknown_metadata(info) -> bool:
    return any(type(m).__name__ not in CONSTRAINTS or type(m).__module__ != "annotated_types" for m in info.metadata)


def _with_constraints(spec: dict, metadata: list) -> dict:
    if not metadata or spec == ANY:
        return spec
    return {**spec, "constraints": [[type(m).__name__, getattr(m, _constraint_attribute(m))] for m in metadata]}


def _constraint_attribute(constraint) -> str:
    return {"MinLen": "min_length", "MaxLen": "max_length", "MultipleOf": "multiple_of"}.get(
        type(constraint).__name__, type(constraint).__name__.lower())


# --- mirroring (no DeepSpeed) -------------------------------------------------------------------------------

def mirror_models(models: dict[str, dict]) -> dict[str, type]:
    """Every model of `models` as a pydantic model of the same name, types and settings: key -> class."""
    built: dict[str, type] = {}
    for key in models:
        _mirror(key, models, built)
    return built


def _mirror(key: str, models: dict[str, dict], built: dict[str, type]) -> type:
    if key in built:
        return built[key]
    import pydantic
    spec = models[key]
    fields = {}
    for name, field in spec["fields"].items():
        annotation = _annotation(field["type"], models, built)
        default = ... if field["required"] else None
        fields[name] = (annotation, pydantic.Field(default, alias=field.get("alias")))
    config = pydantic.ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True,
                                 use_enum_values=True, protected_namespaces=())
    built[key] = pydantic.create_model(spec["name"], __config__=config, **fields)
    return built[key]


def _annotation(spec: dict, models: dict[str, dict], built: dict[str, type]) -> Any:
    kind = spec["kind"]
    if kind == "any":
        return Any
    plain = {v: k for k, v in _BARE.items()}
    if kind == "list" and "of" in spec:
        annotation = list[_annotation(spec["of"], models, built)]
    elif kind == "dict" and "key" in spec:
        annotation = dict[_annotation(spec["key"], models, built), _annotation(spec["value"], models, built)]
    elif kind in plain:
        annotation = plain[kind]
    elif kind == "literal":
        annotation = typing.Literal[tuple(spec["values"])]
    elif kind == "union":
        annotation = typing.Union[tuple(_annotation(s, models, built) for s in spec["of"])]
    elif kind == "enum":
        mixin = {"int": int, "str": str}.get(spec["base"])
        annotation = enum.Enum(spec["name"], [tuple(m) for m in spec["members"]], **({"type": mixin} if mixin else {}))
    elif kind == "model":
        annotation = _mirror(spec["model"], models, built)
    elif kind == "instance":
        annotation = type(spec["name"], (), {})  # nothing JSON holds is an instance of it, as with the real class
    else:
        return Any  # a kind this trainer does not know (a newer learned file): accept, the live check judges
    return _constrained(annotation, spec.get("constraints"))


def _constrained(annotation: Any, constraints: list | None) -> Any:
    if not constraints:
        return annotation
    import annotated_types
    metadata = [getattr(annotated_types, name)(value) for name, value in constraints if name in CONSTRAINTS]
    return typing.Annotated[(annotation, *metadata)]
