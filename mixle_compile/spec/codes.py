"""The spec's own diagnostic codes (reading and schema validation: S0xx)."""

from __future__ import annotations

from mixle_compile.diagnostics import Code, register_code
from mixle_compile.spec.source import MAX_DEPTH, MAX_INPUT_BYTES, MAX_NODES

SYNTAX = register_code(
    Code(
        "S001",
        "invalid-syntax",
        "The file is not valid YAML or JSON.",
        "The spec could not be parsed. The position points at the first character the parser could "
        "not accept. Files ending in `.json` are read as strict JSON (no comments, no trailing commas, "
        "no NaN); everything else is read as YAML with the safe loader.",
    )
)
DUPLICATE_KEY = register_code(
    Code(
        "S002",
        "duplicate-key",
        "A key (or a parameter name) is defined twice.",
        "YAML and JSON parsers silently keep the last of two equal keys, so a setting written twice "
        "changes meaning without a word. Both definitions are an error: keep one. The same code is used "
        "for two entries of a `modules` parameter list with the same name.",
    )
)
UNKNOWN_KEY = register_code(
    Code(
        "S003",
        "unknown-key",
        "A key that the spec does not define.",
        "Every section of the spec forbids unknown keys, because a misspelt key (`dp_shards`, "
        "`num_kv_head`) would otherwise be ignored and the default used instead. The message names the "
        "closest valid key.",
    )
)
WRONG_TYPE = register_code(
    Code(
        "S004",
        "wrong-type",
        "A value has the wrong type.",
        'Integers must be written as integers: `8`, not `8.0`, `"8"` or `true`. Booleans must be '
        "`true`/`false`. Sections must be mappings and lists must be lists. Keys must be strings "
        "(YAML 1.1 reads unquoted `yes`, `no`, `on`, `off` as booleans).",
    )
)
INVALID_VALUE = register_code(
    Code(
        "S005",
        "invalid-value",
        "A value is out of range or not one of the allowed choices.",
        "Degrees and sizes are integers >= 1 (counts >= 0 where zero means 'none'), choices come from "
        "a fixed list (the message names the closest one), memory sizes are written like `80GiB`, "
        "`80GB` or a number of bytes.",
    )
)
MISSING_FIELD = register_code(
    Code(
        "S006",
        "missing-field",
        "A required field is missing.",
        "The spec needs `model`, `mesh`, `training`, `backend` and `resources`; each model family has "
        "its own required fields (`model.family` selects it). The position points at the section that "
        "lacks the field.",
    )
)
UNKNOWN_REF = register_code(
    Code(
        "S007",
        "unknown-ref",
        "A `ref:` names no entry of `model.shared`.",
        "A distribution node written as `{ref: NAME}` stands for the node defined once under "
        "`model.shared.NAME`. The message names the closest defined name.",
    )
)
REF_CYCLE = register_code(
    Code(
        "S008",
        "ref-cycle",
        "Shared distribution nodes refer to each other in a cycle.",
        "A model is a tree (a DAG once shared nodes are reused); a node cannot contain itself. The "
        "message prints the cycle, e.g. `a -> b -> a`.",
    )
)
UNKNOWN_BACKEND = register_code(
    Code(
        "S009",
        "unknown-backend",
        "`backend` names no registered training backend.",
        "Backends are registered by name (`torch`, `megatron`, and any a plugin registers). Names are "
        "compared ignoring case, with `-` read as `_`.",
    )
)
LIMITS = register_code(
    Code(
        "S010",
        "input-limits",
        "The file is too large, nests too deeply or expands too far.",
        f"Spec files are limited to {MAX_INPUT_BYTES // 2**20} MiB, {MAX_DEPTH} levels of nesting and "
        f"{MAX_NODES:,} values after YAML alias expansion, so a hostile or broken file cannot exhaust "
        "memory or time. The expansion is counted on the composed document before anything is built, "
        "so an alias bomb is refused at once, naming the anchor that expands the most.",
    )
)
UNREADABLE = register_code(
    Code(
        "S011",
        "unreadable-file",
        "The file does not exist, is not a file, or is not UTF-8 text.",
        "Reported with exit status 2 (unreadable input) rather than 1 (violations).",
    )
)
AUTO_UNRESOLVABLE = register_code(
    Code(
        "S012",
        "auto-unresolvable",
        "`mesh.dp_shard: auto` cannot be filled from the devices.",
        "`dp_shard: auto` takes the ranks left over: devices / (dp_replicate * tp * pp * cp). When the "
        "devices are not a multiple of that product, no whole dp_shard exists.",
    )
)
INCONSISTENT = register_code(
    Code(
        "S013",
        "inconsistent-fields",
        "Fields of the spec contradict each other.",
        "Cross-field requirements of the spec itself, for example a transformer needs `training.seq_len`, "
        "`experts_per_token` cannot exceed `num_experts`, a parameter placed with `shard` needs that "
        "dimension, an HMM's shared transitions must have its number of states.",
    )
)
