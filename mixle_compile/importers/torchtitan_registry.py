"""torchtitan 0.3's Python configs: a ``config_registry`` function returning ``Trainer.Config``.

``check --torchtitan module:function`` imports the module (torchtitan must be installed: the
``torchtitan`` extra), calls the function and reads the ``Trainer.Config`` it returns through the
same rules as a job TOML: ``parallelism`` (``ParallelismConfig``), ``training`` (``TrainingConfig``),
``activation_checkpoint`` (``FullAC`` / ``SelectiveAC`` / ``MemoryBudgetAC`` configs, or none),
``optimizer`` (its ``lr``), the model spec's ``name`` and ``flavor``, sized from the flavor table, its
multi-token prediction layers (deepseek_v3's ``mtp_layers``) and ``MTPLoss``'s ``mtp_scale``.
Diagnostics point at the line of the function that sets the field (or at its ``def``), and name the
``Trainer.Config`` field.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

from mixle_compile.importers.builder import ImportOptions, unreadable
from mixle_compile.importers.torchtitan import PARALLELISM_KEYS
from mixle_compile.spec.source import Position, SourceDocument, SourceError

# A Trainer.Config's parallelism fields: the job TOML's, less async tensor parallelism, which 0.3
# holds in CompileConfig (read with the compile fields below).
PARALLELISM = tuple(k for k in PARALLELISM_KEYS if k != "enable_async_tensor_parallel")
TRAINING = ("local_batch_size", "global_batch_size", "seq_len", "steps", "mixed_precision_param")
AC_MODES = {"FullAC": "full", "SelectiveAC": "selective", "MemoryBudgetAC": "memory_budget", "NoAC": "none"}


#: torchtitan after 0.3 (73aed7f, "fold batch dim", August 2026) counts batches in tokens: the
#: field each table key is read from then, to point at it.
TOKEN_FIELDS = {
    ("training", "seq_len"): "max_context_length",
    ("training", "local_batch_size"): "num_tokens_per_microbatch_per_dp_rank",
    ("training", "global_batch_size"): "num_tokens_per_train_step",
    ("parallelism", "pipeline_parallel_microbatch_size"): "num_tokens_per_microbatch_per_dp_rank",
}


def _token_counts(config: Any, tables: dict) -> None:
    """Fill the batch keys from a config that counts them in tokens (torchtitan's trainer.py after
    73aed7f: a data-parallel rank runs ``num_pp_microbatches`` micro-batches of
    ``num_tokens_per_microbatch_per_dp_rank`` tokens, sequences of ``max_context_length``;
    ``num_tokens_per_train_step``, -1 by default, sets the accumulation); nothing for one that
    counts them in sequences."""
    training, parallelism = getattr(config, "training", None), getattr(config, "parallelism", None)
    tokens = getattr(training, "num_tokens_per_microbatch_per_dp_rank", None)
    context = getattr(training, "max_context_length", None)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (tokens, context)):
        return
    step = getattr(training, "num_tokens_per_train_step", -1)
    for name, count in (("num_tokens_per_microbatch_per_dp_rank", tokens), ("num_tokens_per_train_step", step)):
        if isinstance(count, int) and count > 0 and count % context:
            raise ValueError(
                f"training.{name} = {count} is not a whole number of sequences of max_context_length {context}"
            )
    micro = tokens // context
    pp = tables["parallelism"].get("pipeline_parallel_degree", 1)
    rounds = getattr(parallelism, "num_pp_microbatches", None) if pp > 1 else 1
    rounds = rounds if isinstance(rounds, int) and not isinstance(rounds, bool) and rounds > 0 else 1
    tables["training"].update(seq_len=context, local_batch_size=micro * rounds)
    if pp > 1:
        tables["parallelism"]["pipeline_parallel_microbatch_size"] = micro
    if isinstance(step, int) and step > 0:
        tables["training"]["global_batch_size"] = step // context


def trainer_config_tables(config: Any) -> dict:
    """The fields of a ``Trainer.Config`` that the spec reads, as a job TOML's tables."""
    tables: dict[str, dict] = {"parallelism": {}, "training": {}, "model": {}, "optimizer": {}}
    for table, fields in (("parallelism", PARALLELISM), ("training", TRAINING)):
        section = getattr(config, table, None)
        for key in fields:
            if section is not None and hasattr(section, key) and getattr(section, key) is not None:
                tables[table][key] = getattr(section, key)
    _token_counts(config, tables)
    spec = getattr(config, "model_spec", None)
    if spec is not None:
        tables["model"] = {"name": getattr(spec, "name", None), "flavor": getattr(spec, "flavor", None)}
        # 0.3.0's deepseek_v3 model config (MTPDecoder.Config, torchtitan/models/deepseek_v3/mtp.py) lists
        # its multi-token prediction layers in mtp_layers, model_registry(flavor, num_mtp_layers=N)'s N
        mtp_layers = getattr(getattr(spec, "model", None), "mtp_layers", None)
        if isinstance(mtp_layers, (list, tuple)) and mtp_layers:
            tables["model"]["num_mtp_layers"] = len(mtp_layers)
    # MTPLoss.Config.mtp_scale (models/deepseek_v3/mtp.py): the multi-token prediction loss's weight
    scale = getattr(getattr(config, "loss", None), "mtp_scale", None)
    if scale is not None:
        tables["loss"] = {"mtp_scale": scale}
    ac = getattr(config, "activation_checkpoint", None)
    owner = type(ac).__qualname__.split(".")[0] if ac is not None else "NoAC"
    tables["activation_checkpoint"] = {"mode": AC_MODES.get(owner, "selective")}
    optimizer = getattr(config, "optimizer", None)
    lr, name = getattr(optimizer, "lr", None), "AdamW"
    # 0.3.0's OptimizersContainer.Config holds param_groups of ParamGroupConfig(optimizer_name, optimizer_kwargs)
    # (torchtitan/components/optimizer/optimizer.py; default_adamw makes one catch-all AdamW group).
    groups = getattr(optimizer, "param_groups", None)
    if lr is None and isinstance(groups, list) and len(groups) == 1:
        kwargs = getattr(groups[0], "optimizer_kwargs", None) or {}
        lr, name = kwargs.get("lr"), str(getattr(groups[0], "optimizer_name", name))
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        tables["optimizer"] = {"name": name, "lr": lr}
    compile_ = getattr(config, "compile", None)  # CompileConfig (torchtitan/config/configs.py)
    if compile_ is not None and isinstance(getattr(compile_, "enable", None), bool):
        tables["compile"] = {"enable": compile_.enable, "components": list(getattr(compile_, "components", []) or [])}
        if isinstance(getattr(compile_, "enable_async_tensor_parallel", None), bool):
            tables["compile"]["enable_async_tensor_parallel"] = compile_.enable_async_tensor_parallel
    seed = getattr(getattr(config, "debug", None), "seed", None)  # DebugConfig.seed
    if isinstance(seed, int) and not isinstance(seed, bool):
        tables["debug"] = {"seed": seed}
    return tables


def model_sizes(model: Any) -> tuple[dict, dict] | None:
    """A dense decoder's sizes read off torchtitan 0.3's model config (``Decoder.Config``: ``dim``,
    ``vocab_size``, ``layers[i].attention``/``feed_forward``, ``enable_weight_tying``); None when its
    layers are not all alike or have experts (the flavor table sizes those)."""
    layers = getattr(model, "layers", None)
    if not layers or any(getattr(layer, "moe", None) is not None for layer in layers):
        return None
    first = layers[0]
    att, ffn = getattr(first, "attention", None), getattr(first, "feed_forward", None)
    w1 = getattr(ffn, "w1", None)
    try:
        sizes = {
            "family": "transformer",
            "vocab_size": int(model.vocab_size),
            "hidden_size": int(model.dim),
            "num_layers": len(layers),
            "num_heads": int(att.n_heads),
            "ffn_hidden_size": int(w1.out_features),
            "tie_embeddings": bool(getattr(model, "enable_weight_tying", False)),
        }
    except (AttributeError, TypeError, ValueError):
        return None
    for layer in layers[1:]:
        if (layer.attention.n_heads, layer.feed_forward.w1.out_features) != (
            sizes["num_heads"],
            sizes["ffn_hidden_size"],
        ):
            return None
    where = "Trainer.Config.model_spec.model"
    origins = {
        "vocab_size": f"{where}.vocab_size",
        "hidden_size": f"{where}.dim",
        "num_layers": f"len({where}.layers)",
        "num_heads": f"{where}.layers[0].attention.n_heads",
        "ffn_hidden_size": f"{where}.layers[0].feed_forward.w1.out_features",
        "tie_embeddings": f"{where}.enable_weight_tying",
        "family": f"{where} (a decoder)",
    }
    kv = getattr(att, "n_kv_heads", None)
    if kv:
        sizes["num_kv_heads"], origins["num_kv_heads"] = int(kv), f"{where}.layers[0].attention.n_kv_heads"
    head_dim = getattr(att, "head_dim", None)
    if head_dim and int(head_dim) != sizes["hidden_size"] // sizes["num_heads"]:
        sizes["head_dim"], origins["head_dim"] = int(head_dim), f"{where}.layers[0].attention.head_dim"
    return sizes, origins


def document_for(function: Any, config: Any, display: str) -> tuple[SourceDocument, str]:
    """The tables with positions: the line in the function's source that names each field, else its ``def``."""
    try:
        lines, start = inspect.getsourcelines(function)
        file = inspect.getsourcefile(function) or display
    except (OSError, TypeError):
        lines, start, file = [], 1, display
    try:
        file = str(Path(file).resolve().relative_to(Path.cwd()))
    except ValueError:
        pass
    try:
        tables = trainer_config_tables(config)
    except ValueError as exc:
        raise unreadable(display, str(exc), "the spec counts batches in sequences: use a multiple of it") from exc
    doc = SourceDocument(file=f"{file}", data=tables)
    tokens = hasattr(getattr(config, "training", None), "num_tokens_per_microbatch_per_dp_rank")
    top = Position(start, 1)
    doc.values[()] = top  # the function: where a finding that names no field of it is placed
    for table, section in doc.data.items():
        doc.keys[(table,)] = top
        for key in section:
            pos = top
            written = TOKEN_FIELDS.get((table, key), key) if tokens else key
            for offset, line in enumerate(lines):
                m = re.search(rf"\b{written}\s*=", line)
                if m:
                    pos = Position(start + offset, m.start() + 1)
                    break
            doc.keys[(table, key)] = doc.values[(table, key)] = pos
    return doc, "".join(lines)


def load_registry_function(target: str) -> tuple[Any, Any]:
    """Import ``module:function`` and call it; refuses clearly when that cannot be done."""
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise unreadable(
            target,
            f"--torchtitan {target!r} must name MODULE:FUNCTION",
            "e.g. `--torchtitan torchtitan.models.llama3.config_registry:llama3_8b`",
        )
    try:
        with contextlib.redirect_stdout(sys.stderr):  # what the module prints is not part of the report
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise unreadable(
            target,
            f"cannot import {module_name} for --torchtitan: {exc}",
            "install torchtitan where the check runs (`pip install 'mixle-compile[torchtitan]'`) and run "
            "from the directory the module is importable from",
        ) from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise unreadable(
            target,
            f"{module_name} has no function {function_name!r}",
            "name a function of the config registry that returns a Trainer.Config",
        )
    try:
        with contextlib.redirect_stdout(sys.stderr):
            config = function()
    except Exception as exc:  # the user's function: its failure is bad input, not ours
        if isinstance(exc, ImportError):
            hint = (
                f"install what the config imports{f' ({exc.name})' if exc.name else ''} where the check runs, "
                "or check a job TOML or spec of the same run"
            )
        else:
            # Building a config can check the machine: torchtitan's float8 and mxfp8 converters refuse
            # a host without an SM89+ GPU while the config is built.
            hint = (
                "fix the config function so that it returns a Trainer.Config; if what it configures checks "
                "the machine (a float8 converter asks for an SM89 or newer GPU), run the check where that "
                "holds, or check a job TOML or spec of the same run"
            )
        raise unreadable(
            target,
            f"{target}() raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            hint,
        ) from exc
    if not hasattr(config, "parallelism") or not hasattr(config, "training"):
        raise unreadable(
            target,
            f"{target}() returned {type(config).__name__}, not a torchtitan Trainer.Config",
            "name a function that returns Trainer.Config",
        )
    return function, config


def read_trainer_config(
    function: Any, config: Any, display: str, options: ImportOptions
) -> tuple[SourceDocument, list]:
    from mixle_compile.importers.torchtitan import import_job

    src, text = document_for(function, config, display)
    spec = getattr(config, "model_spec", None)
    model = model_sizes(getattr(spec, "model", None)) if spec is not None else None
    return import_job(src, text, Path.cwd(), options, version="0.3", source_format="torchtitan-python", model=model)


def check_registry_function(target: str, options: ImportOptions, *, suggest: bool = False, lint=None):
    """``check --torchtitan module:function``: the CheckResult of the config that function returns
    (``lint``: the rule selection, a :class:`~mixle_compile.config.LintConfig`)."""
    from mixle_compile.check import check_loaded
    from mixle_compile.spec.load import LoadedSpec, validate_document

    try:
        function, config = load_registry_function(target)
        doc, diags = read_trainer_config(function, config, target, options)
        if any(d.severity.value == "error" for d in diags):
            raise SourceError(diags, unreadable=True)
    except SourceError as exc:
        return check_loaded(LoadedSpec(target, None, None, list(exc.diagnostics), unreadable=exc.unreadable))
    return check_loaded(validate_document(doc, diags), suggest=suggest, config=lint)
