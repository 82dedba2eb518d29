"""Diagnostic codes of the importers (I0xx): reading another tool's file into a spec."""

from __future__ import annotations

from mixle_compile.diagnostics import Code, Severity, register_code

UNSUPPORTED_FORMAT = register_code(
    Code(
        "I001",
        "unsupported-format",
        "The file is not a spec and not an engine config that `check` reads.",
        "`check`, `compile`, `explain` and `diff` read spec files (YAML or JSON) and, detected by content "
        "and extension, torchtitan job TOMLs, Megatron-LM launch scripts and argument files, and DeepSpeed "
        "JSON configs (with the model from an HF `config.json`). The message says what the file looks like "
        "and which formats are read; see docs/importers.md.",
    )
)
UNMODELLED_KEY = register_code(
    Code(
        "I002",
        "unmodelled-engine-key",
        "An engine key that the spec does not model (it is ignored).",
        "An imported config may set keys that change nothing `check` verifies (logging, data paths) or that "
        "the spec has no field for. Each one is named in a warning, never dropped in silence, so that a "
        "setting that matters to memory or correctness is not missed; docs/importers.md lists what is modelled.",
        severity=Severity.warning,
    )
)
ASSUMED_VALUE = register_code(
    Code(
        "I003",
        "assumed-value",
        "The imported config does not say something the spec needs; a stated value is assumed.",
        "Engine configs rarely say how many devices run them or how much memory each has, and some leave the "
        "model's vocabulary to a tokenizer file. Where the importer has to assume a value it says which and "
        "how to give the real one (`--devices`, `--device-memory`, `--model config.json`).",
        severity=Severity.warning,
    )
)
CANNOT_IMPORT = register_code(
    Code(
        "I004",
        "cannot-import",
        "An engine config's value cannot be expressed as a spec.",
        "The value is read but has no counterpart in the spec (an HF architecture outside the transformer "
        "family, a mixle model class the distribution spec cannot express, a DeepSpeed `auto` left for another "
        "tool to fill in, a batch identity that does not hold, a flavor the package's table does not list). The "
        "message names the key (or the mixle class and where it is in the model's JSON) and what would make it "
        "importable.",
    )
)
ENGINE_REFUSES = register_code(
    Code(
        "I005",
        "engine-refuses-arguments",
        "The engine's own argument validation refuses this combination of settings.",
        "Some checks are the engine front end's rather than the plan's: Megatron-LM's `validate_args` raises "
        "for `--step-batch-size-schedule` together with `--global-batch-size`, for example. Such a config never "
        "starts, so it is reported (exit 1) before the plan is verified; fix it and check again.",
        engine_reference="megatron/training/arguments.py validate_args",
    )
)
