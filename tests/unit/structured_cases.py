"""Schemas, regexes, choices and grammars the structured-output tests run (engine and proxy)."""

from __future__ import annotations

SCHEMAS: dict[str, dict] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    "integer_range": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}},
        "required": ["age"],
        "additionalProperties": False,
    },
    "number": {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "tag": {"type": "string", "maxLength": 4},
                },
                "required": ["id", "tag"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "int_array": {
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}
        },
        "required": ["xs"],
        "additionalProperties": False,
    },
    "object_array": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 3}},
            "required": ["k"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "string", "maxLength": 5},
            "c": {"type": "boolean"},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {"v": {"const": "v1"}, "n": {"type": "integer"}},
        "required": ["v", "n"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}},
        "required": ["id"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"], "maxLength": 5}},
        "required": ["note"],
        "additionalProperties": False,
    },
    "nested_arrays": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        "minItems": 1,
        "maxItems": 2,
    },
    "number_enum": {
        "type": "object",
        "properties": {"level": {"enum": [1, 2, 3, 5, 8]}},
        "required": ["level"],
        "additionalProperties": False,
    },
    "date_pattern": {
        "type": "object",
        "properties": {"day": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["day"],
        "additionalProperties": False,
    },
    "enum_array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "deep": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/point"}},
        "required": ["p"],
        "additionalProperties": False,
    },
    "exclusive_bounds": {
        "type": "object",
        "properties": {"t": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["t"],
        "additionalProperties": False,
    },
    "string_lengths": {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}},
        "required": ["s"],
        "additionalProperties": False,
    },
    "bare_string": {"type": "string", "maxLength": 6},
    "bare_integer": {"type": "integer", "minimum": -5, "maximum": 5},
    "free_object": {"type": "object"},
}

REGEXES = [r"[A-Z]{2}[0-9]{3}", r"(yes|no)", r"-?[0-9]{1,3}\.[0-9]{2}"]
CHOICES = [["positive", "negative", "neutral"], ["A", "B", "C", "D"]]
# A Lark grammar and a GBNF grammar (llguidance converts GBNF to Lark).
LARK = 'start: expr\nexpr: NUM | NUM OP expr\nNUM: /[0-9]{1,2}/\nOP: "+" | "-" | "*"'
GBNF = 'root ::= "(" item ("," item)? ")"\nitem ::= [a-c] [0-9]'
LARK_CHECK = r"[0-9]{1,2}([-+*][0-9]{1,2})*"
GBNF_CHECK = r"\([a-c][0-9](,[a-c][0-9])?\)"
