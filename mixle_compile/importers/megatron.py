"""Megatron-LM arguments: a launch script (``torchrun ... pretrain_gpt.py --tensor-model-parallel-size 8
...``) or an arguments file, read into a spec for ``backend: {name: megatron, entry: arguments}``.

Defaults and derived values are Megatron-LM's own (megatron/training/arguments.py, ``validate_args``
and the argument definitions), each cited where it is applied. The script is read by
:mod:`mixle_compile.importers.shell` (never run), so every value keeps the position where the
script writes it: a degree set through ``TP_SIZE=8`` and ``--tensor-model-parallel-size $TP_SIZE``
is reported at ``TP_SIZE=8``.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from mixle_compile.importers import codes
from mixle_compile.importers.builder import ImportOptions, SpecBuilder, resources
from mixle_compile.importers.shell import Shell, ShellRun, Word, slurm_options
from mixle_compile.layer_split import LayoutError, megatron_accounted, megatron_layout, megatron_uneven
from mixle_compile.spec.source import Position, SourceDocument, compose_yaml

# Flags the spec reads: name -> "int", "float", "str" or "bool" (a store_true switch).
READ = {
    "--num-layers": "int",
    "--hidden-size": "int",
    "--num-attention-heads": "int",
    "--ffn-hidden-size": "int",
    "--group-query-attention": "bool",
    "--num-query-groups": "int",
    "--kv-channels": "int",
    "--swiglu": "bool",
    "--multi-latent-attention": "bool",
    "--q-lora-rank": "int",
    "--kv-lora-rank": "int",
    "--qk-head-dim": "int",
    "--qk-pos-emb-head-dim": "int",
    "--v-head-dim": "int",
    "--qk-layernorm": "bool",
    "--mtp-num-layers": "int",
    "--mtp-loss-scaling-factor": "float",
    "--normalization": "str",
    "--position-embedding-type": "str",
    "--max-position-embeddings": "int",
    "--use-rotary-position-embeddings": "bool",
    "--no-position-embedding": "bool",
    "--untie-embeddings-and-output-weights": "bool",
    "--vocab-size": "int",
    "--tokenizer-type": "str",
    "--make-vocab-size-divisible-by": "int",
    "--padded-vocab-size": "int",
    "--num-experts": "int",
    "--moe-router-topk": "int",
    "--moe-ffn-hidden-size": "int",
    "--moe-layer-freq": "str",
    "--moe-shared-expert-intermediate-size": "int",
    "--moe-shared-expert-gate": "bool",
    "--moe-expert-capacity-factor": "float",
    "--moe-token-dispatcher-type": "str",
    "--moe-enable-deepep": "bool",
    "--seq-length": "int",
    "--micro-batch-size": "int",
    "--global-batch-size": "int",
    "--bf16": "bool",
    "--fp16": "bool",
    "--fp8-format": "str",
    "--tensor-model-parallel-size": "int",
    "--pipeline-model-parallel-size": "int",
    "--context-parallel-size": "int",
    "--expert-model-parallel-size": "int",
    "--expert-tensor-parallel-size": "int",
    "--num-layers-per-virtual-pipeline-stage": "int",
    "--virtual-pipeline-model-parallel-size": "int",
    "--sequence-parallel": "bool",
    "--no-overlap-p2p-communication": "bool",
    "--tp-comm-overlap": "bool",
    "--use-distributed-optimizer": "bool",
    "--use-megatron-fsdp": "bool",
    "--use-torch-fsdp2": "bool",
    "--torch-fsdp2-no-reshard-after-forward": "bool",
    "--data-parallel-sharding-strategy": "str",
    "--num-distributed-optimizer-instances": "int",
    "--recompute-activations": "bool",
    "--recompute-granularity": "str",
    "--recompute-modules": "list",
    "--activations-checkpoint-method": "str",
    "--checkpoint-activations": "bool",
    "--lr": "float",
    "--optimizer": "str",
    "--train-iters": "int",
    "--seed": "int",
    "--use-tp-pp-dp-mapping": "bool",
    "--num-virtual-stages-per-pipeline-rank": "int",
    "--step-batch-size-schedule": "str",
    "--decoder-first-pipeline-num-layers": "int",
    "--decoder-last-pipeline-num-layers": "int",
    "--account-for-embedding-in-pipeline-split": "bool",
    "--account-for-loss-in-pipeline-split": "bool",
    "--pipeline-model-parallel-layout": "str",
    "--microbatch-group-size-per-virtual-pipeline-stage": "int",
}
#: Flags validate_args refuses as deprecated: (the flag to use now, how to rewrite the launch).
DEPRECATED = {
    "--model-parallel-size": ("--tensor-model-parallel-size", "--tensor-model-parallel-size N"),
    "--batch-size": ("--micro-batch-size", "--micro-batch-size N (and --global-batch-size)"),
}
#: A python interpreter run directly (``python``, ``python3``, ``python3.10``).
PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
#: The word that names the training script (``pretrain_gpt.py``, maybe with its directory).
ENTRY = re.compile(r"(^|/)pretrain_\w+\.py$")
#: Megatron-LM's GPT training scripts: pretrain_gpt2.py is the same GPT decoder's script before
#: Megatron-LM renamed it (152aab30, January 2021, "change gpt2 to gpt").
GPT_ENTRIES = ("pretrain_gpt.py", "pretrain_gpt2.py")
#: Megatron-LM's scripts for Mamba and hybrid Mamba/attention models (MambaModel, HybridModel).
HYBRID_ENTRIES = ("pretrain_mamba.py", "pretrain_hybrid.py")
#: Flags that make the model a hybrid of Mamba, attention and MLP/MoE layers: validate_args derives
#: num_layers from --hybrid-layer-pattern (--hybrid-override-pattern, its deprecated name, is copied
#: into it), overriding --num-layers; the ratios and --is-hybrid-model are pretrain_mamba.py's older ones.
HYBRID_FLAGS = (
    "--hybrid-layer-pattern",
    "--hybrid-override-pattern",
    "--hybrid-attention-ratio",
    "--hybrid-mlp-ratio",
    "--is-hybrid-model",
)
#: Flags that mark a command as a Megatron-LM training launch when its script is not pretrain_*.py
#: (examples/detxoify_lm/finetune_gpt.py, examples/multimodal/train.py).
MARKERS = re.compile(
    r"--(num-layers|hidden-size|num-attention-heads|micro-batch-size|global-batch-size|seq-length|"
    r"(tensor|pipeline)-model-parallel-size)(=.*)?"
)
#: torchrun's options (torch/distributed/run.py get_args_parser; --use-env from torch.distributed.launch):
#: a variable holding them is the launcher's (DISTRIBUTED_ARGS), never the training script's arguments.
TORCHRUN_OPTIONS = re.compile(
    r"--(nnodes|nproc[-_]per[-_]node|node[-_]rank|master[-_](addr|port)|rdzv[-_]\w+|standalone|max[-_]restarts|"
    r"monitor[-_]interval|start[-_]method|local[-_]addr|log[-_]dir|redirects|tee|role|run[-_]path|no[-_]python|"
    r"local[-_]ranks[-_]filter|logs[-_]specs|numa[-_]binding|use[-_]env)(=.*)?"
)
# Flags with no bearing on sizes, memory or communication as the spec models them (data, logging,
# checkpoint paths, learning-rate schedule, kernel fusions, initialisation, dropout): read quietly.
QUIET = re.compile(
    r"^--(data-path|data-cache-path|split|vocab-file|merge-file|tokenizer-model|tiktoken-pattern|mock-data|"
    r"save|load|save-interval|eval-interval|eval-iters|log-.*|tensorboard-.*|wandb-.*|exit-.*|"
    r"lr-.*|min-lr|weight-decay|adam-.*|clip-grad|init-method-std|.*-dropout|train-samples|"
    r"decoupled-.*|rotary-.*|use-rope-scaling|no-rope-fusion|attention-backend|"
    r"use-mcore-models|disable-bias-linear|no-masked-softmax-fusion|no-bias-.*-fusion|cross-entropy-.*|"
    r"overlap-.*|num-workers|no-mmap-bin-files|no-create-attention-mask-in-dataloader|distributed-timeout-minutes|"
    r"ckpt-format|no-load-.*|no-save-.*|profile.*|manual-gc.*|empty-unused-memory-level|calculate-per-token-loss|"
    r"grad-reduce-in-bf16|fp8-amax-.*|fp8-param-gather|moe-router-load-balancing-type|moe-aux-loss-coeff|"
    r"moe-grouped-gemm|moe-router-dtype|moe-z-loss-coeff|moe-router-pre-softmax|"
    r"moe-permute-fusion|moe-shared-expert-overlap|moe-router-score-function|moe-router-enable-expert-bias|moe-router-bias-update-rate|"
    r"apply-layernorm-1p|qk-layernorm|mscale|mscale-all-dim|eod-mask-loss|timing-log-level|timing-log-option|"
    r"distributed-backend|use-flash-attn|transformer-impl|accumulate-allreduce-grads-in-fp32|"
    r"bf16-.*|fp16-.*|loss-scale.*|initial-loss-scale|hysteresis|seq-length-.*|dataloader-type|"
    r"num-dataset-builder-threads|no-async-tensor-model-parallel-allreduce|"
    r"deterministic-mode|use-checkpoint-args|finetune|micro-batch-size-.*|"
    r"chat-template|trust-remote-code|untie-embeddings|no-gradient-accumulation-fusion|"
    r"ddp-.*|check-for-nan-in-loss-and-grad|"
    r"ckpt-.*|async-save|dist-ckpt-.*|auto-detect-ckpt-format|"
    r"rerun-mode|fp8-recipe|first-last-layers-bf16|num-layers-at-.*-in-bf16|export-.*|kd-.*|"
    r"reset-position-ids|reset-attention-mask|no-persist-layer-norm|use-distributed-checkpointing)$"
)


class PatternTooLong(ValueError):
    """A ``--moe-layer-freq`` pattern longer than the layers it may name (its length, not built)."""


def moe_layer_pattern(text: str, limit: int = 1_000_000) -> list[int] | None:
    """The per-layer list a ``--moe-layer-freq`` pattern names, as Megatron-LM's ``_eval_pattern``
    evaluates it (megatron/training/arguments.py: the characters ``,`` digits ``[ ] ( ) + *`` only, then
    a Python expression), evaluated here without ``eval``: lists of integers, ``+`` between lists and
    ``*`` between a list and an integer. None where the text is not such an expression;
    :class:`PatternTooLong` (before the list is built) where it would be longer than ``limit``."""
    import ast

    text = text.strip().strip("'\"")
    if re.search(r"[^,\d\[\]\(\)\+\*\s]", text):
        return None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [value(e) for e in node.elts]
            return items if all(type(i) is int for i in items) else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if left is None or right is None:
                return None
            if isinstance(node.op, ast.Add):
                if not (isinstance(left, list) and isinstance(right, list)):
                    return None
                if len(left) + len(right) > limit:
                    raise PatternTooLong
                return left + right
            if isinstance(left, list) != isinstance(right, list):  # a list repeated
                items, count = (left, right) if isinstance(left, list) else (right, left)
                if len(items) * max(count, 0) > limit:
                    raise PatternTooLong
                return items * count
            return None
        return None

    try:
        found = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, RecursionError, MemoryError):
        return None
    return found if isinstance(found, list) else None


def _moe_pattern(b, text: str, layers, set_, at) -> None:
    """A ``--moe-layer-freq`` list pattern as moe_first_layer and moe_layer_frequency (dense layers
    first, then every k-th layer an MoE one), or the reason it cannot be."""
    from mixle_compile.parameters import moe_spacing_of

    flag = "--moe-layer-freq"
    limit = layers if isinstance(layers, int) else 1_000_000
    try:
        pattern = moe_layer_pattern(text, limit)
    except PatternTooLong:
        b.refuse(
            f"`{flag} {text}` names more than {limit} layers"
            + (f", the model has {layers} (Megatron-Core asserts one entry per layer)" if limit == layers else ""),
            at(flag),
            "give one entry per layer",
        )
        return
    if pattern is None or any(v not in (0, 1) for v in pattern):
        b.refuse(
            f"`{flag} {text}` is neither an integer nor a list of 0s and 1s built with `+` and `*` (Megatron-LM's "
            "_eval_pattern)",
            at(flag),
            "write an integer N (layers 0, N, 2N, ... MoE) or a pattern such as ([0]*3+[1]*58)",
        )
        return
    if isinstance(layers, int) and len(pattern) != layers:
        b.refuse(
            f"`{flag} {text}` names {len(pattern)} layers, the model has {layers} (Megatron-Core asserts that the "
            "pattern's length is num_layers, gpt_layer_specs.py get_gpt_decoder_block_spec)",
            at(flag),
            f"give one entry per layer ({layers})",
        )
        return
    spacing = moe_spacing_of([i for i, v in enumerate(pattern) if v], len(pattern))
    if spacing is None:
        moe = [i for i, v in enumerate(pattern) if v]
        b.refuse(
            f"`{flag} {text}` makes layers {moe if moe else 'none'} MoE layers; the spec's MoE layers are evenly "
            "spaced after the dense ones (moe_first_layer, moe_layer_frequency)",
            at(flag),
            "use dense layers first and then every k-th layer an MoE one, e.g. ([0]*3+[1]*58) or ([0,1]*24)",
        )
        return
    first, frequency = spacing
    set_(("model", "moe_layer_frequency"), frequency, flag)
    if first:
        set_(("model", "moe_first_layer"), first, flag)


@dataclass
class _Arg:
    flag: Word
    value: Word | None
    values: tuple[Word, ...] = ()  # a flag of several values (argparse nargs="*"): all of them


def parse_arguments(words: list[Word]) -> tuple[dict[str, _Arg], list[_Arg]]:
    """Flags and their values, the last of a repeated flag winning (argparse), and flags seen twice."""
    args: dict[str, _Arg] = {}
    repeated: list[_Arg] = []
    i = 0
    while i < len(words):
        w = words[i]
        if not w.text.startswith("--"):
            i += 1
            continue
        flag, value, values = w.text, None, ()
        if "=" in flag:
            flag, _, text = flag.partition("=")
            value = w.tail(len(flag) + 1)  # where the value's text is written (a variable's assignment)
            values = (value,)
        elif READ.get(flag) == "list":
            while i + 1 < len(words) and not _is_flag(words[i + 1].text):
                values += (words[i + 1],)
                i += 1
            value = values[0] if values else None
        elif READ.get(flag) != "bool" and i + 1 < len(words) and not _is_flag(words[i + 1].text):
            value = words[i + 1]
            i += 1
        arg = _Arg(Word(flag, w.pos, w.spans[:1]), value, values)
        if flag in args:
            repeated.append(args[flag])
        args[flag] = arg
        i += 1
    return args, repeated


def _is_flag(text: str) -> bool:
    return text.startswith("--") or (text.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", text))


@dataclass
class Launch:
    """What a launch script or arguments file runs: the training script's arguments, the launcher's
    arguments (``torchrun --nproc_per_node 8``), what the reader could not decide, the training script's
    word and the reader's whole run (its variables)."""

    words: list[Word]
    launcher: list[Word]
    notes: list[tuple[str, Position, str]]
    entry: Word | None
    run: ShellRun


def test_config_words(root) -> tuple[list[Word], list[tuple[str, Position, str]]]:
    """The training script's arguments of a Megatron-LM functional-test config
    (tests/functional_tests/test_cases/<model>/<case>/model_config.yaml), each where it is written, from
    its composed YAML ``root`` (none where it holds no ``MODEL_ARGS`` mapping), and what is not read of
    them. Its ``MODEL_ARGS`` mapping is turned into arguments as Megatron-LM's
    tests/functional_tests/shell_test_utils/_run_training.sh does (core_v0.16.1): anchors and merges
    expanded (yq's ``explode``), an empty string dropped, each value passed through ``xargs`` (quotes
    and backslashes removed: a layout written ``Et\\\\|\\\\(tt\\\\|\\\\)*6mL`` is ``Et|(tt|)*6mL``),
    then ``true`` is the bare flag, a value in ``[...]`` its words without the brackets, one in
    ``(...)`` or holding spaces one word, any other value the words ``eval`` makes of it. The
    arguments of a checkpoint-resume run (``MODEL_ARGS_2``, ...) are not read, nor (noted) a flag the
    reader reads whose value names a variable the harness sets (``--seed: ${REPEAT}``)."""
    import yaml

    if not isinstance(root, yaml.MappingNode):
        return [], []
    node = next((v for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == "MODEL_ARGS"), None)
    if not isinstance(node, yaml.MappingNode):
        return [], []

    def entries(mapping: yaml.MappingNode):
        """Key and value nodes in order, merges (``<<: *anchor``) first as the YAML merge key has them."""
        for key, value in mapping.value:
            if key.tag == "tag:yaml.org,2002:merge":
                for merged in value.value if isinstance(value, yaml.SequenceNode) else [value]:
                    if isinstance(merged, yaml.MappingNode):
                        yield from entries(merged)
            else:
                yield key, value

    def at(n: yaml.Node) -> Position:
        return Position(n.start_mark.line + 1, n.start_mark.column + 1)

    last: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key, value in entries(node):
        if isinstance(key, yaml.ScalarNode):
            last.pop(key.value, None)  # a later key replaces an earlier one, in its place
            last[key.value] = (key, value)

    def shell_words(text: str) -> list[str]:
        """The words eval makes of unquoted text (quotes and backslashes removed), or the text split."""
        try:
            return shlex.split(text)
        except ValueError:
            return text.split()

    words: list[Word] = []
    notes: list[tuple[str, Position, str]] = []
    for flag, (key, value) in last.items():
        if not isinstance(value, yaml.ScalarNode):  # yq's tostring of a list or mapping: its YAML
            shown = yaml.safe_dump(yaml.safe_load(yaml.serialize(value)), default_flow_style=True).strip()
        else:
            loaded = yaml.safe_load(yaml.serialize(value))
            # yq's tostring of a YAML boolean or null (1 and 0 stay numbers)
            named = ((True, "true"), (False, "false"), (None, "null"))
            shown = next((text for v, text in named if loaded is v), value.value)
        if shown == "":  # dropped (yq: select(.value != ""))
            continue
        # `echo "$value" | xargs`: quotes and backslashes removed, blanks squeezed
        text = " ".join(shell_words(shown))
        if flag in READ and re.search(r"\$(\{\w+\}|\w+)", text):  # the harness's variables (${REPEAT})
            notes.append((flag, at(key), f"its value {text!r} names a variable the test harness sets when it runs"))
            continue
        words.append(Word(flag, at(key)))
        if text == "true":  # the bare flag
            continue
        if re.fullmatch(r"\[[^\]]+\]", text):  # the words inside the brackets
            words.extend(Word(part, at(value)) for part in shell_words(text[1:-1]))
        elif re.fullmatch(r"\([^)]+\)", text) or " " in text:  # one word, in double quotes for eval
            words.append(Word(re.sub(r'\\([$`"\\])', r"\1", text), at(value)))
        else:
            words.extend(Word(part, at(value)) for part in shell_words(text))
    return words, notes


#: The training script Megatron-LM's functional-test recipes run for the configs under
#: tests/functional_tests/test_cases/<model>/ (tests/test_utils/recipes/h100/<model>.yaml, core_v0.16.1:
#: TRAINING_SCRIPT_PATH, with TRAINING_PARAMS_PATH=.../test_cases/{model}/{test_case}/model_config.yaml).
TEST_CASE_SCRIPTS = {
    "gpt": "pretrain_gpt.py",
    "moe": "pretrain_gpt.py",
    "mixtral": "pretrain_gpt.py",
    "bert": "pretrain_bert.py",
    "t5": "pretrain_t5.py",
    "hybrid": "pretrain_mamba.py",
    "multimodal-llava": "pretrain_vlm.py",
    "mimo": "examples/mimo/train.py",
}


def test_config_entry(path: Path) -> str | None:
    """The training script a functional-test config runs, from the ``test_cases/<model>/<case>/``
    folders it sits in, as the recipes map them (an inference case runs examples/inference/gpt/*.py, a
    GRPO case train_rl.py); None where the file is not in that layout."""
    parts = path.resolve().parts
    if "test_cases" not in parts[:-1]:
        return None
    k = len(parts) - 1 - parts[::-1].index("test_cases")
    model = parts[k + 1] if k + 1 < len(parts) - 1 else None
    case = parts[k + 2] if k + 2 < len(parts) - 1 else ""
    if model is not None and "inference" in case:
        return "examples/inference/gpt/gpt_dynamic_inference.py"
    if model is not None and "grpo" in case:  # the gpt-grpo and moe-grpo recipes
        return "train_rl.py"
    return TEST_CASE_SCRIPTS.get(model)


def test_config_launch(text: str, name: str, path: Path) -> Launch:
    """The launch of a functional-test config (raises SourceError where its YAML breaks)."""
    words, notes = test_config_words(compose_yaml(text, name, unreadable=True))
    script = test_config_entry(path)
    return Launch(words, [], notes, None if script is None else Word(script, Position(1, 1)), ShellRun())


def launch_words(text: str, path: Path | None = None) -> Launch:
    """The launch of a launch script or arguments file (at ``path``, from which sourced files are found)."""
    run = Shell().execute(text, path=path)
    notes = [
        (f"[ {t} ]", p, "a test that cannot be decided without running the script; its branch is skipped")
        for t, p in run.undecided
    ]
    notes += [(what, p, why) for what, p, why in run.unsourced]
    notes += [(f"{k} ...", p, "a loop or case block is not run by the reader") for k, p in run.skipped]
    for command in run.commands:
        for k, w in enumerate(command):
            if ENTRY.search(w.text):
                return Launch(command[k + 1 :], command[:k], notes, w, run)
    # A command run as one string (`srun ... sh -c "${run_cmd}"`, `run_cmd="python pretrain_gpt.py
    # ${options}"`): its words are the string's, each where its text is written (in the string, or in
    # the assignment of the variable the string expands).
    strings = [
        command[:k] + w.split() for command in run.commands for k, w in enumerate(command) if len(w.text.split()) > 1
    ]
    for words in strings:
        for j, part in enumerate(words):
            if ENTRY.search(part.text):
                return Launch(words[j + 1 :], words[:j], notes, part, run)
    # Another Python script run with Megatron-LM's arguments (examples/detxoify_lm/finetune_gpt.py,
    # examples/multimodal/train.py): the launch, whose script read_megatron reads or refuses by name.
    for words in (*run.commands, *strings):
        for k, w in enumerate(words):
            if w.text.endswith(".py") and any(MARKERS.fullmatch(x.text) for x in words[k + 1 :]):
                return Launch(words[k + 1 :], words[:k], notes, w, run)

    # An arguments file: flags on their own lines, or in variables such as MODEL_ARGS="..."; never a
    # launcher's options (DISTRIBUTED_ARGS="--nproc_per_node 8 --nnodes 1 ...").
    def arguments(name: str, parts: list[Word]) -> bool:
        """Whether variable ``name``, holding ``parts``, holds the training script's arguments."""
        return (
            name.endswith("ARGS")
            and not name.startswith("DISTRIBUTED")
            and not any(TORCHRUN_OPTIONS.fullmatch(x.text) for x in parts)
        )

    words: list[Word] = []
    for command in run.commands:
        if command and command[0].text.startswith("--") and arguments("ARGS", command):
            words.extend(command)
    for name, w in run.scalars.items():
        if "--" in w.text and arguments(name, w.split()):
            words.extend(w.split())
    for name, items in run.arrays.items():
        parts = [part for x in items for part in x.split()]
        if arguments(name, parts):
            words.extend(parts)
    return Launch(words, [], notes, None, run)


#: The largest training script read to see which model it builds (as a sourced file).
MAX_ENTRY_BYTES = 1 << 20


def entry_model(entry: Word, path: Path | None) -> tuple[bool, str]:
    """Whether a training script other than pretrain_*.py trains Megatron's GPT model on Megatron-LM's
    standard arguments, and how that is known: (True, its file) where the script is found (next to the
    launch script, or in the working directory, where the launch runs it) and its code imports
    Megatron's ``pretrain`` (megatron/training/training.py: it parses and validates the standard
    arguments, initialize_megatron) and ``GPTModel`` and no other of Megatron's model classes; else
    (False, why not). The script is parsed, never run."""
    import ast

    try:
        written = Path(entry.text).expanduser()
        bases = [] if written.is_absolute() else [b for b in ((path.parent if path else None), Path.cwd()) if b]
        looked = [written] if written.is_absolute() else [(b / written).resolve() for b in bases]
        candidates = list(dict.fromkeys(looked))
        found = next((c for c in candidates if c.is_file()), None)
    except (OSError, ValueError, RuntimeError) as exc:  # a name no file can have, an unknown ~user
        return False, f"its path cannot be looked for ({exc})"
    if found is None:
        looked = " or ".join(str(c) for c in candidates)
        return False, f"the script is not found (looked for {looked}), so which model it trains is unknown"
    try:
        if found.stat().st_size > MAX_ENTRY_BYTES:
            raise ValueError(f"larger than {MAX_ENTRY_BYTES} bytes")
        tree = ast.parse(found.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError, SyntaxError, RecursionError, MemoryError) as exc:
        return False, f"{found} cannot be read as Python ({exc.__class__.__name__}: {exc})"
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "megatron"
        for alias in node.names
    }
    models = sorted(n for n in imported if n.endswith("Model") and n not in ("GPTModel", "ModelType"))
    if "pretrain" not in imported:
        return False, f"{found} does not train through Megatron-LM's pretrain() and its standard arguments"
    if models:
        return False, f"{found} builds {', '.join(models)}, not only Megatron's GPTModel"
    if "GPTModel" not in imported:
        return False, f"{found} does not build Megatron's GPTModel"
    return True, str(found)


#: What Megatron-FSDP's --data-parallel-sharding-strategy shards over the data-parallel ranks
#: (megatron/training/arguments.py: choices no_shard, optim, optim_grads, optim_grads_params, default
#: optim_grads_params; docs/user-guide/features/megatron_fsdp.md: ZeRO-1, -2 and -3 in that order).
FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def data_parallel(b: SpecBuilder, dp: int, cp: int, devices: int, has, at, text_of, num) -> None:
    """The data-parallel degree and what it shards.

    Megatron-LM's distributed optimizer (``--use-distributed-optimizer``) is ZeRO-1: it shards the
    optimizer state and the fp32 main weights over the data-parallel ranks and keeps the weights and
    the gradient buffer whole on every rank (DistributedDataParallelConfig.use_distributed_optimizer:
    reduce-scatter the gradients; Megatron-LM's docs/user-guide/features/dist_optimizer.md counts
    ``6 + 12/d`` bytes per parameter), which the spec says as ``dp_replicate`` with ``training.distributed_optimizer``.
    Megatron-FSDP (``--use-megatron-fsdp``) with the strategy ``optim_grads_params`` (the default)
    also shards the weights and gradients: ``dp_shard``. Its ``optim`` and ``optim_grads`` strategies
    shard less and read as the distributed optimizer (``optim_grads``' sharded gradients are priced
    whole), ``no_shard`` as plain data parallelism. Under ``optim_grads_params``
    ``training.distributed_optimizer`` says whether the launch passes ``--use-distributed-optimizer``
    (validate_args turns it on under Megatron-FSDP itself, megatron/training/arguments.py,
    ``use_megatron_fsdp``; with ``dp_shard`` the optimizer state is sharded either way).

    torch FSDP2 (``--use-torch-fsdp2``: training.py wraps the model in torch's fully_shard) is ZeRO-3
    over the data ranks: ``dp_shard``.

    ``--num-distributed-optimizer-instances K`` (default 1) splits the ``dp * cp`` data ranks into K
    contiguous blocks (megatron/core/parallel_state.py, ``intra_partial_data_parallel_size``; it asserts
    that K divides ``dp * cp``): Megatron-FSDP then shards within a block and replicates across the K
    (mcore_fsdp_adapter.py, ``enable_hsdp``), which is ``dp_replicate`` K over ``dp_shard`` dp / K (the
    shard ranks inner, as in the plan's grid); the distributed optimizer shards within a block; plain data
    parallelism reduces in two steps to the same sum."""
    origin = f"world {devices} / (tp * pp * cp)"
    dist_opt = has("--use-distributed-optimizer")
    flag = "--use-distributed-optimizer" if dist_opt else None
    sharded = False
    torch_fsdp2 = has("--use-torch-fsdp2")
    if torch_fsdp2 and has("--use-megatron-fsdp"):
        b.refuse(
            "`--use-torch-fsdp2` and `--use-megatron-fsdp` name two FSDP implementations",
            at("--use-torch-fsdp2"),
            "keep the one the run uses",
            field=("mesh", "dp_shard"),
        )
    if torch_fsdp2:
        # torch's fully_shard over the data ranks (training.py get_model: torch_FSDP), ZeRO-3
        sharded, flag = True, "--use-torch-fsdp2"
        origin += " under torch FSDP2"
        if has("--torch-fsdp2-no-reshard-after-forward"):
            b.assumed(
                "--torch-fsdp2-no-reshard-after-forward keeps each layer's gathered weights from its forward "
                "to its backward; the memory check prices two layers gathered at a time",
                at("--torch-fsdp2-no-reshard-after-forward"),
                "the gathered weights are under-stated by the rest of the stage's layers",
                field=("mesh", "dp_shard"),
            )
    elif has("--use-megatron-fsdp"):
        strategy_flag = "--data-parallel-sharding-strategy"
        strategy = text_of(strategy_flag, "optim_grads_params")
        if strategy not in FSDP_STRATEGIES:
            b.refuse(
                f"`{strategy_flag}` is {strategy!r}; Megatron-LM takes {', '.join(FSDP_STRATEGIES)}",
                at(strategy_flag),
                "write one of them (the default, optim_grads_params, shards weights, gradients and optimizer state)",
                field=("mesh", "dp_shard"),
            )
            strategy = "optim_grads_params"
        sharded = strategy == "optim_grads_params"
        if not sharded:  # optim and optim_grads shard the optimizer state; no_shard nothing
            dist_opt = strategy != "no_shard"
        flag = strategy_flag if has(strategy_flag) else "--use-megatron-fsdp"
        origin += f" under Megatron-FSDP, strategy {strategy}"
        if strategy == "optim_grads":
            b.assumed(
                "Megatron-FSDP's optim_grads (ZeRO-2) shards the gradients as well as the optimizer state; "
                "it is read as the distributed optimizer, whose gradients are priced whole",
                at(strategy_flag),
                "the memory check over-states the gradients' bytes by (d - 1)/d of them",
                field=("training", "distributed_optimizer"),
            )
    elif dist_opt:
        origin += ", the distributed optimizer (ZeRO-1) sharding the optimizer state over them"
    instances_flag = "--num-distributed-optimizer-instances"
    instances = num(instances_flag, 1)
    if instances is None or instances < 1:
        b.refuse(f"`{instances_flag}` must be at least 1", at(instances_flag), "write a positive count (default 1)")
        instances = 1
    if instances > 1 and (dp * cp) % instances:
        b.diagnostic(
            codes.ENGINE_REFUSES.code,
            f"Megatron-LM refuses {instances_flag} {instances}: it does not divide the {dp * cp} data ranks "
            "(dp * cp) into blocks (initialize_model_parallel asserts 'Data parallel size should be divisible by "
            "partial DistOpt shard factor')",
            at(instances_flag),
            hint="give a count that divides the data-parallel size times the context-parallel size",
        )
        instances = 1
    at_flag = at(flag) if flag else None
    # torch FSDP2's wrapper takes no instances (training.py: TorchFullyShardedDataParallelConfig)
    if sharded and instances > 1 and not torch_fsdp2:
        if dp % instances:
            b.refuse(
                f"`{instances_flag}` {instances} splits Megatron-FSDP's dp * cp = {dp * cp} ranks across the "
                f"context-parallel ranks (dp = {dp}); the spec's dp_replicate divides the data-parallel ranks alone",
                at(instances_flag),
                "give a count that divides the data-parallel size",
                field=("mesh", "dp_replicate"),
            )
        else:
            b.set(("mesh", "dp_replicate"), instances, at=at(instances_flag), origin=instances_flag)
            b.set(
                ("mesh", "dp_shard"),
                dp // instances,
                at=at_flag,
                origin=f"{origin}, sharded within each of {instances} replicas ({instances_flag})",
            )
    else:
        if dist_opt and instances > 1:
            b.assumed(
                f"{instances_flag} {instances}: the distributed optimizer shards within blocks of "
                f"{dp * cp // instances} data ranks and keeps {instances} copies; it is read as sharded over "
                f"all {dp}",
                at(instances_flag),
                f"the memory check under-states the optimizer state and main weights {instances} times",
                field=("training", "distributed_optimizer"),
            )
        b.set(("mesh", "dp_shard" if sharded else "dp_replicate"), dp, at=at_flag, origin=origin)
    b.set(("training", "distributed_optimizer"), dist_opt, at=at_flag, origin=flag)


def fsdp_refusals(b: SpecBuilder, has, at, text_of, pp: int, ep: int) -> None:
    """What validate_args (megatron/training/arguments.py) asserts of a launch under torch FSDP2 and
    under Megatron-FSDP, each an I005 at the flag that starts it."""
    ckpt = text_of("--ckpt-format", "torch_dist")  # TrainingConfig / CheckpointConfig default
    if has("--use-torch-fsdp2"):
        flag = "--use-torch-fsdp2"
        refusals = [
            (pp > 1, "is not supported with pipeline parallelism"),
            (ep > 1, "is not supported with expert parallelism"),
            (has("--use-distributed-optimizer"), "is not supported with MCore's distributed optimizer"),
            (
                not has("--no-gradient-accumulation-fusion"),
                "is not supported with gradient accumulation fusion (on unless --no-gradient-accumulation-fusion)",
            ),
            (ckpt not in ("torch_dist", "torch_dcp"), "requires --ckpt-format torch_dist or torch_dcp"),
            (not has("--untie-embeddings-and-output-weights"), "requires --untie-embeddings-and-output-weights"),
            (has("--fp16"), "is not supported with fp16 yet"),
        ]
    elif has("--use-megatron-fsdp"):
        flag = "--use-megatron-fsdp"
        optimizer = text_of("--optimizer", "adam")
        refusals = [
            (ckpt != "fsdp_dtensor", "requires the fsdp_dtensor checkpointing format (--ckpt-format)"),
            (optimizer not in ("sgd", "adam"), f"does not support the {optimizer} optimizer"),
        ]
    else:
        return
    for refused, why in refusals:
        if refused:
            b.diagnostic(
                codes.ENGINE_REFUSES.code,
                f"Megatron-LM refuses `{flag}` here: it {why} (validate_args asserts it)",
                at(flag),
                hint="change the launch as the assertion says, or drop the flag",
            )


def _batch_admits(num, model_parallel: int):
    """Whether a world of ``n`` devices runs the launch's batch: Megatron's micro-batch calculator
    asserts the global batch divides by micro-batch * data-parallel size
    (megatron/core/num_microbatches_calculator.py, ConstantNumMicroBatchesCalculator); a launch without
    --global-batch-size takes micro * dp (validate_args) and runs on any."""
    glob, micro = num("--global-batch-size"), num("--micro-batch-size", 1)
    if not isinstance(glob, int) or not isinstance(micro, int) or micro < 1:
        return None

    def admits(n: int) -> bool:
        return n % model_parallel == 0 and glob % (micro * (n // model_parallel)) == 0

    return admits


def read_megatron(
    text: str, name: str, options: ImportOptions, path: Path | None = None
) -> tuple[SourceDocument, list]:
    test_config = path is not None and path.suffix.lower() in (".yaml", ".yml")
    launch = test_config_launch(text, name, path) if test_config else launch_words(text, path)
    words, launcher, notes, entry = launch.words, launch.launcher, launch.notes, launch.entry
    b = SpecBuilder(name, "megatron")
    if test_config and not any(w.text.startswith("--") for w in words):
        # a MODEL_ARGS mapping without Megatron-LM flags: NeMo's test configs (`trainer.devices: 8`), or none
        b.diagnostic(
            codes.UNSUPPORTED_FORMAT.code,
            f"{name} is a functional-test config whose MODEL_ARGS holds no Megatron-LM arguments (`--num-layers: "
            "32` and the like); NeMo's overrides (`trainer.devices`, `model.*`) are not read",
            None,
            hint="check the Megatron-LM launch or arguments file, or write a spec",
        )
        return b.result()
    if entry is None and not words:
        # Detected by the files it reads (a `source` or `sbatch` line), which hold no launch either.
        b.diagnostic(
            codes.UNSUPPORTED_FORMAT.code,
            f"{name} is a shell script without Megatron-LM arguments, in it or in the files it sources or "
            "submits (no --num-layers, --micro-batch-size or --*-model-parallel-size, no pretrain_*.py)",
            None,
            hint="check the script that launches pretrain_gpt.py, or its arguments file",
        )
        return b.result()
    for what, pos, why in notes:
        b.unmodelled(what, pos, why)
    if test_config and entry is None:
        b.assumed(
            f"{name} is a functional-test config away from Megatron-LM's tests/functional_tests/test_cases/<model>/ "
            "folders, whose recipes name the training script: read as pretrain_gpt.py's arguments",
            None,
            "check the file in its place in Megatron-LM's tree (bert, t5 and hybrid cases run other scripts)",
        )
    if test_config and entry is not None and entry.text.startswith("examples/inference/"):
        b.refuse(
            f"{name} is an inference test (its recipe runs {entry.text}): it serves a trained model, with no "
            "training plan to check",
            None,
            "check the training cases (their recipes run pretrain_gpt.py)",
        )
        return b.result()
    script = entry.text.rsplit("/", 1)[-1] if entry is not None else None
    entry_origin = "pretrain_gpt.py (a GPT model)"
    if entry is not None and script not in GPT_ENTRIES:
        where = entry.at(entry.text.rfind("/") + 1)  # the script's name, where it is written
        if script in HYBRID_ENTRIES:
            b.refuse(
                f"{script} trains a Mamba or hybrid Mamba model (Mamba, attention and MLP layers), which is not "
                "modelled: the transformer family describes Megatron's GPT decoder",
                where,
                "the reader takes pretrain_gpt.py launches and their arguments",
            )
            return b.result()
        if ENTRY.search(entry.text):
            b.refuse(
                f"{script} trains a model other than Megatron's GPT decoder, which the transformer family describes",
                where,
                "the reader takes pretrain_gpt.py launches and their arguments",
            )
            return b.result()
        gpt, why = entry_model(entry, path)
        if not gpt:
            b.refuse(
                f"the launch runs {entry.text}, not pretrain_gpt.py, and {why}: its arguments are not read as a "
                "GPT model's",
                entry.pos,
                "check a pretrain_gpt.py launch; a script that trains Megatron's GPTModel through pretrain() is "
                "read where it is found (run the check from the directory the launch runs in)",
            )
            return b.result()
        entry_origin = f"{entry.text} (read: Megatron's pretrain() building GPTModel, {why})"
    args, repeated = parse_arguments(words)
    hybrid = next((args[flag] for flag in HYBRID_FLAGS if flag in args), None)
    if hybrid is not None:
        # validate_args: the layer count comes from --hybrid-layer-pattern (Mamba, attention, MLP and
        # MoE layers), whatever --num-layers says; the spec's transformer has attention layers only.
        b.refuse(
            f"`{hybrid.flag.text}` makes this a hybrid Mamba model (Mamba, attention and MLP/MoE layers in a "
            "pattern), which is not modelled: the transformer family describes attention layers only",
            hybrid.flag.pos,
            "the reader takes Megatron GPT (transformer) launches; hybrid Mamba models cannot be checked",
        )
        return b.result()
    for arg in repeated:
        b.unmodelled(arg.flag.text, arg.flag.pos, "given again later; the last value wins, as argparse does")
    for flag, (current, replacement) in DEPRECATED.items():
        if flag in args:
            # validate_args, "Deprecated arguments": each asserts the old flag is unset.
            b.diagnostic(
                codes.ENGINE_REFUSES.code,
                f"Megatron-LM refuses `{flag}` (validate_args: no longer valid, use {current}); it is the "
                "flag of Megatron-LM before 2.0",
                args[flag].flag.pos,
                hint=f"write {replacement} to check the launch against Megatron-LM 2.0 and later",
            )
            # Read as what it meant (the tensor-parallel size, the micro-batch size) so that the rest
            # of the launch reads, unless the launch also gives the current flag.
            args.setdefault(current, args[flag])

    def has(flag: str) -> bool:
        return flag in args

    def at(flag: str) -> Position | None:
        a = args.get(flag)
        return (a.value or a.flag).pos if a else None

    for flag in args:
        b.doc.engine_keys[flag] = at(flag)

    def num(flag: str, default=None, kind=int):
        a = args.get(flag)
        if a is None:
            return default
        if a.value is None:
            b.refuse(f"`{flag}` needs a value", a.flag.pos, f"write `{flag} N`")
            return default
        try:
            return kind(a.value.text)
        except ValueError:
            b.refuse(
                f"`{flag}` must be a number, got {a.value.text!r}",
                a.value.pos,
                "write a number, or define the variable it names",
            )
            return default

    def text_of(flag: str, default: str | None = None) -> str | None:
        a = args.get(flag)
        return a.value.text if a and a.value else default

    def set_(path, value, flag: str | None, origin: str | None = None) -> None:
        b.set(path, value, at=at(flag) if flag else None, origin=origin or flag)

    for flag, arg in args.items():
        if flag not in READ and flag not in DEPRECATED and not QUIET.match(flag):
            b.unmodelled(flag, arg.flag.pos)

    # ---- model
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads"):
        if not has(flag) and options.model is None:
            b.refuse(
                f"`{flag}` is not set: the model's size is unknown",
                None,
                f"add `{flag}` to the arguments, or give the model with `--model config.json`",
            )
    tp = num("--tensor-model-parallel-size", 1)
    sized = all(has(f) for f in ("--num-layers", "--hidden-size", "--num-attention-heads"))
    if options.model is not None and not sized:
        _hf_model(b, options)
    else:
        layers, hidden, heads = num("--num-layers"), num("--hidden-size"), num("--num-attention-heads")
        if b.failed:
            return b.result()
        set_(("model", "family"), "transformer", None, entry_origin)
        set_(("model", "num_layers"), layers, "--num-layers")
        set_(("model", "hidden_size"), hidden, "--hidden-size")
        set_(("model", "num_heads"), heads, "--num-attention-heads")
        if has("--multi-latent-attention"):
            _latent_attention(b, has, num, at, set_, text_of)
        else:
            if has("--group-query-attention") and has("--num-query-groups"):
                set_(("model", "num_kv_heads"), num("--num-query-groups"), "--num-query-groups")
            if has("--kv-channels"):
                set_(("model", "head_dim"), num("--kv-channels"), "--kv-channels")
        swiglu = has("--swiglu")
        if has("--ffn-hidden-size"):
            set_(("model", "ffn_hidden_size"), num("--ffn-hidden-size"), "--ffn-hidden-size")
        else:
            # validate_args: swiglu -> int((4 * h * 2 / 3) / 64) * 64, else 4 * h.
            ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
            set_(
                ("model", "ffn_hidden_size"),
                ffn,
                None,
                "4 * --hidden-size (--ffn-hidden-size unset; 2/3 of it with --swiglu)",
            )
        set_(
            ("model", "activation"),
            "swiglu" if swiglu else "gelu",
            "--swiglu" if swiglu else None,
            "--swiglu" if swiglu else "Megatron's default MLP activation (gelu)",
        )
        norm = text_of("--normalization", "LayerNorm")
        if norm not in ("LayerNorm", "RMSNorm"):
            b.refuse(
                f"`--normalization {norm}` is not modelled",
                at("--normalization"),
                "the spec models LayerNorm and RMSNorm",
            )
        set_(
            ("model", "norm"),
            "rmsnorm" if norm == "RMSNorm" else "layernorm",
            "--normalization" if has("--normalization") else None,
            "--normalization" if has("--normalization") else "--normalization default LayerNorm",
        )
        position = text_of("--position-embedding-type", "learned_absolute")
        rope = position in ("rope", "yarn", "mrope") or has("--use-rotary-position-embeddings")
        learned = position == "learned_absolute" and not rope and not has("--no-position-embedding")
        set_(
            ("model", "position_embedding"),
            "learned" if learned else "rope",
            "--position-embedding-type" if has("--position-embedding-type") else None,
            "--position-embedding-type"
            if has("--position-embedding-type")
            else "--position-embedding-type default learned_absolute",
        )
        # validate_args requires it and asserts it is at least --seq-length (rule Q008); a value the
        # reader cannot resolve (a variable defined elsewhere) is left out rather than refused, and
        # one equal to --seq-length is what the spec means by leaving it out.
        positions = text_of("--max-position-embeddings")
        if positions and positions.isdigit() and positions != text_of("--seq-length"):
            set_(("model", "max_position_embeddings"), int(positions), "--max-position-embeddings")
        # --untie-embeddings-and-output-weights: Megatron ties them unless it is given.
        set_(
            ("model", "tie_embeddings"),
            not has("--untie-embeddings-and-output-weights"),
            "--untie-embeddings-and-output-weights" if has("--untie-embeddings-and-output-weights") else None,
            "--untie-embeddings-and-output-weights"
            if has("--untie-embeddings-and-output-weights")
            else "tied (no --untie-embeddings-and-output-weights)",
        )
        _vocab(b, args, num, text_of, at, tp, options)
        experts = num("--num-experts", 0) or 0  # validate_args: 0 means dense
        if experts:
            set_(("model", "num_experts"), experts, "--num-experts")
            # TransformerConfig.moe_router_topk defaults to 2 (megatron/core/transformer/transformer_config.py).
            set_(
                ("model", "experts_per_token"),
                num("--moe-router-topk", 2),
                "--moe-router-topk" if has("--moe-router-topk") else None,
                "--moe-router-topk" if has("--moe-router-topk") else "--moe-router-topk default 2",
            )
            if has("--moe-ffn-hidden-size"):
                set_(("model", "moe_ffn_hidden_size"), num("--moe-ffn-hidden-size"), "--moe-ffn-hidden-size")
            # TransformerConfig.moe_shared_expert_intermediate_size: None means no shared expert (its
            # __post_init__ refuses a value <= 0); moe_shared_expert_gate defaults to False.
            shared = num("--moe-shared-expert-intermediate-size", None)
            if shared is not None and shared <= 0:
                b.refuse(
                    f"`--moe-shared-expert-intermediate-size {shared}`: Megatron-Core refuses a shared expert "
                    "width that is not positive (TransformerConfig.__post_init__)",
                    at("--moe-shared-expert-intermediate-size"),
                    "give the shared experts' summed width, or drop the flag for no shared expert",
                )
            elif shared is not None:
                set_(("model", "moe_shared_expert_hidden_size"), shared, "--moe-shared-expert-intermediate-size")
            if has("--moe-shared-expert-gate") and shared is not None and shared > 0:
                # MoELayer passes the gate to the shared experts it builds, only when there are some
                # (megatron/core/transformer/moe/moe_layer.py); without them the flag changes nothing
                set_(("model", "moe_shared_expert_gate"), True, "--moe-shared-expert-gate")
            elif has("--moe-shared-expert-gate") and shared is None:
                b.unmodelled(
                    "--moe-shared-expert-gate",
                    at("--moe-shared-expert-gate"),
                    "there is no shared expert to gate (no --moe-shared-expert-intermediate-size)",
                )
            # TransformerConfig.moe_expert_capacity_factor: None (and, after __post_init__, any negative
            # value) means dropless routing.
            capacity = num("--moe-expert-capacity-factor", None, float)
            if capacity is not None and capacity > 0:
                set_(("model", "expert_capacity_factor"), capacity, "--moe-expert-capacity-factor")
            # TransformerConfig.moe_token_dispatcher_type defaults to 'allgather' (megatron/core/transformer/
            # transformer_config.py; `--moe-enable-deepep`, deprecated, means 'flex'). The plan lists the
            # 'alltoall' dispatcher's exchange, one copy of a token per routed expert sent to that expert's
            # rank (token_dispatcher.py MoEAlltoAllTokenDispatcher); 'flex' (DeepEP, HybridEP) is
            # training.expert_dispatcher: flex, priced by the copies it sends; 'allgather' is not modelled.
            deepep = has("--moe-enable-deepep")
            dispatcher = "flex" if deepep else text_of("--moe-token-dispatcher-type", "allgather")
            flag = "--moe-enable-deepep" if deepep else "--moe-token-dispatcher-type"
            if dispatcher not in ("allgather", "alltoall", "alltoall_seq", "flex"):
                b.refuse(
                    f"`--moe-token-dispatcher-type {dispatcher}` is not a Megatron token dispatcher",
                    at("--moe-token-dispatcher-type"),
                    "write allgather, alltoall or flex",
                )
            elif dispatcher == "flex":
                set_(("training", "expert_dispatcher"), "flex", flag)
            elif dispatcher == "allgather":
                b.assumed(
                    "the `allgather` token dispatcher"
                    + ("" if has(flag) else " (Megatron's default, no --moe-token-dispatcher-type)")
                    + " is planned as `alltoall` (one copy of a token per routed expert); `allgather` gathers "
                    "every token of the tensor- and expert-parallel group on each rank: the plan's expert "
                    "traffic and the memory of the gathered tokens are under-stated once that group "
                    "(etp x ep ranks) outnumbers the top-k",
                    at(flag) if has(flag) else at("--num-experts"),
                    "write `--moe-token-dispatcher-type alltoall` (or flex) to run what the plan prices "
                    "(the export does)",
                    field=("model", "num_experts"),
                )
            freq = text_of("--moe-layer-freq")
            if freq is not None:
                if freq.isdigit():
                    set_(("model", "moe_layer_frequency"), int(freq), "--moe-layer-freq")
                else:
                    _moe_pattern(b, freq, num("--num-layers"), set_, at)
    _multi_token_prediction(b, has, num, at, set_, text_of, from_hf=options.model is not None and not sized)
    if b.failed:
        return b.result()

    # ---- world and mesh
    devices, devices_at, devices_origin = _world(launcher, launch.run)
    if devices is None and options.devices is None:  # the count is about to be assumed: say what was not read
        for name, w in launch.run.slurm.items():
            if name != "gpus-per-node" and not w.text.isdigit():
                b.unmodelled(f"--{name} {w.text}", w.pos, "not a number: the job's size is not read from it")
    pp = num("--pipeline-model-parallel-size", 1)
    cp = num("--context-parallel-size", 1)
    ep = num("--expert-model-parallel-size", 1)
    etp = num("--expert-tensor-parallel-size", tp)  # validate_args: defaults to tp
    kind, memory, memory_origin = _device_comment(text)
    if kind is not None:
        b.set(("resources", "kind"), kind, origin=memory_origin)
    devices = resources(
        b,
        options,
        devices,
        devices_at,
        devices_origin,
        what="a Megatron-LM launch",
        divisor=math.lcm(tp * pp * cp, etp * ep * pp),
        memory=memory,
        memory_origin=memory_origin,
        admits=_batch_admits(num, tp * pp * cp),
        admits_why="--global-batch-size over --micro-batch-size * data-parallel size",
    )
    dp = max(1, devices // (tp * pp * cp))
    set_(("mesh", "tp"), tp, "--tensor-model-parallel-size")
    set_(("mesh", "pp"), pp, "--pipeline-model-parallel-size")
    set_(("mesh", "cp"), cp, "--context-parallel-size")
    set_(("mesh", "ep"), ep, "--expert-model-parallel-size")
    set_(
        ("mesh", "etp"),
        etp,
        "--expert-tensor-parallel-size" if has("--expert-tensor-parallel-size") else "--tensor-model-parallel-size",
        None if has("--expert-tensor-parallel-size") else "--expert-tensor-parallel-size default (= tp)",
    )
    if has("--use-tp-pp-dp-mapping"):  # parallel_state.initialize_model_parallel: order tp-cp-ep-pp-dp
        set_(("mesh", "order"), "tp-cp-ep-pp-dp", "--use-tp-pp-dp-mapping")
    data_parallel(b, dp, cp, devices, has, at, text_of, num)
    fsdp_refusals(b, has, at, text_of, pp, ep)

    if has("--step-batch-size-schedule") and has("--global-batch-size"):
        # validate_args: "Cannot specify both --step-batch-size-schedule and --global-batch-size" (ValueError).
        b.diagnostic(
            codes.ENGINE_REFUSES.code,
            "Megatron-LM refuses --step-batch-size-schedule together with "
            "--global-batch-size (validate_args raises ValueError)",
            at("--step-batch-size-schedule"),
            hint="keep one of them; the check below uses --global-batch-size",
            field=("training", "global_batch_size"),
        )
    # ---- batch (validate_args: --global-batch-size defaults to micro * dp)
    mbs = num("--micro-batch-size", 1)
    gbs = num("--global-batch-size", mbs * dp)
    set_(("training", "micro_batch_size"), mbs, "--micro-batch-size")
    set_(
        ("training", "global_batch_size"),
        gbs,
        "--global-batch-size" if has("--global-batch-size") else None,
        "--global-batch-size" if has("--global-batch-size") else "--global-batch-size default (micro * dp)",
    )
    set_(
        ("mesh", "microbatches"),
        max(1, gbs // (mbs * dp)),
        "--global-batch-size" if has("--global-batch-size") else None,
        "global / (micro * dp): Megatron's number of micro-batches",
    )
    seq = num("--seq-length", options.seq_len)
    if seq is not None:
        set_(
            ("training", "seq_len"),
            seq,
            "--seq-length" if has("--seq-length") else None,
            "--seq-length" if has("--seq-length") else "--seq-len",
        )

    # ---- pipeline schedule
    layers = b.get(("model", "num_layers"))
    vpp = num("--virtual-pipeline-model-parallel-size") or num("--num-virtual-stages-per-pipeline-rank")
    per_stage = num("--num-layers-per-virtual-pipeline-stage")
    layout = _pipeline_layout(b, has, at, text_of, pp, layers, vpp, per_stage)
    if layout is False:
        return b.result()
    if layout is not None:
        vpp = layout.virtual_stages
        flag = "--pipeline-model-parallel-layout"
    elif per_stage is not None and isinstance(layers, int):
        if layers % (pp * per_stage):
            b.refuse(
                f"--num-layers {layers} is not pp {pp} * --num-layers-per-virtual-pipeline-stage "
                f"{per_stage} * a whole number",
                at("--num-layers-per-virtual-pipeline-stage"),
                "Megatron asserts the layers split evenly into virtual stages",
            )
        vpp = layers // (pp * per_stage)
        flag = "--num-layers-per-virtual-pipeline-stage"
    else:
        flag = (
            "--virtual-pipeline-model-parallel-size"
            if has("--virtual-pipeline-model-parallel-size")
            else "--num-virtual-stages-per-pipeline-rank"
        )
    if vpp is not None and vpp > 1:
        set_(("training", "virtual_pipeline_stages"), vpp, flag)
        set_(("training", "pipeline_schedule"), "interleaved_1f1b", flag)
    else:
        set_(("training", "pipeline_schedule"), "1f1b", None, "Megatron's non-interleaved 1F1B")

    if layout is not None:
        b.set(
            ("training", "pipeline_layers"),
            list(layout.counts),
            at=at("--pipeline-model-parallel-layout"),
            origin="--pipeline-model-parallel-layout (the decoder layers of each virtual stage)",
        )

    def listed_split(split, where, refusal: tuple[str, str], origin: str) -> bool:
        """Set training.pipeline_layers to Megatron's split, or refuse where Megatron refuses it (False)."""
        if split is None:
            b.refuse(refusal[0], where, refusal[1])
            return False
        b.set(("training", "pipeline_layers"), list(split), at=where, origin=origin)
        return True

    # Uneven pipeline: the first and last pipeline ranks' layers (over all their virtual stages), the
    # rest split evenly over the middle ranks (layer_split.megatron_uneven).
    first, last = num("--decoder-first-pipeline-num-layers"), num("--decoder-last-pipeline-num-layers")
    if (first is not None or last is not None) and isinstance(layers, int) and pp > 1:
        middle = pp - (first is not None) - (last is not None)
        if not listed_split(
            megatron_uneven(layers, pp, vpp or 1, first, last),
            at("--decoder-first-pipeline-num-layers") or at("--decoder-last-pipeline-num-layers"),
            (
                f"--num-layers {layers} does not split into first {first}, last {last} and {middle} even middle "
                f"pipeline ranks" + (f", each rank's layers over {vpp} virtual stages" if (vpp or 1) > 1 else ""),
                "Megatron's TransformerConfig asserts the first and last ranks' layers are above 0 and divide by "
                "the virtual stages, and the remaining layers divide evenly over the middle ranks (and their "
                "virtual stages)",
            ),
            "--decoder-first/last-pipeline-num-layers (the middle ranks even)",
        ):
            return b.result()

    # The embedding and/or the loss counted as a layer in the split (TransformerConfig
    # account_for_embedding/loss_in_pipeline_split; layer_split.megatron_accounted).
    embedding = has("--account-for-embedding-in-pipeline-split")
    loss = has("--account-for-loss-in-pipeline-split")
    if (embedding or loss) and isinstance(layers, int) and pp > 1:
        where = at("--account-for-embedding-in-pipeline-split") or at("--account-for-loss-in-pipeline-split")
        if first is not None or last is not None:
            b.refuse(
                "--account-for-embedding/loss-in-pipeline-split is given with --decoder-first/last-pipeline-num-layers",
                where,
                "Megatron's TransformerConfig raises for both at once: keep one way of splitting the layers",
            )
            return b.result()
        if not listed_split(
            megatron_accounted(layers, pp, vpp or 1, embedding, loss),
            where,
            (
                f"--num-layers {layers} with the embedding/loss counted is {layers + embedding + loss} layers, "
                f"which pp {pp} * virtual stages {vpp or 1} does not divide",
                "Megatron's TransformerConfig asserts the counted layers divide by pp and by the virtual stages: "
                "change --num-layers, the pipeline size or the virtual stages",
            ),
            "--account-for-embedding/loss-in-pipeline-split (each counted as a layer)",
        ):
            return b.result()

    # Megatron's interleaved micro-batch group (ModelParallelConfig.microbatch_group_size_per_vp_stage,
    # default pp; its flag through ArgumentGroupFactory's argparse_meta)
    group_flag = "--microbatch-group-size-per-virtual-pipeline-stage"
    group = num(group_flag)
    if group is not None:
        if group < 1:
            b.refuse(
                f"`{group_flag}` must be at least 1, got {group}",
                at(group_flag),
                "Megatron's interleaved schedule needs the group within [pp, micro-batches]: leave it out for pp",
            )
            return b.result()
        set_(("training", "microbatch_group_size"), group, group_flag)

    # ---- the rest of training
    if has("--sequence-parallel"):
        set_(("training", "sequence_parallel"), True, "--sequence-parallel")
    if has("--no-overlap-p2p-communication"):  # overlap_p2p_comm is on by default (store_false)
        set_(("training", "overlap_pipeline_transfers"), False, "--no-overlap-p2p-communication")
    if has("--tp-comm-overlap"):  # megatron/training/arguments.py: TP communication/GEMM overlap (C010)
        set_(("training", "async_tensor_parallel"), True, "--tp-comm-overlap")
    if has("--fp8-format"):
        set_(("training", "precision"), "fp8", "--fp8-format")
    elif has("--bf16"):
        set_(("training", "precision"), "bf16", "--bf16")
    elif has("--fp16"):
        set_(("training", "precision"), "fp16", "--fp16")
    else:
        set_(("training", "precision"), "fp32", None, "neither --bf16 nor --fp16")
    granularity = text_of("--recompute-granularity")
    if has("--recompute-activations"):  # validate_args: recompute_activations -> granularity selective
        granularity = "selective"
    if granularity in ("full", "selective"):
        set_(
            ("training", "activation_checkpointing"),
            granularity,
            "--recompute-activations" if has("--recompute-activations") else "--recompute-granularity",
        )
        if has("--recompute-modules"):
            _recompute_modules(b, args["--recompute-modules"], set_, grouped_gemm=has("--moe-grouped-gemm"))
    elif text_of("--activations-checkpoint-method") == "uniform" or has("--checkpoint-activations"):
        # Megatron-LM 2.x (the SC21 scripts): --activations-checkpoint-method uniform recomputes every
        # layer from its checkpointed input (--checkpoint-activations sets it), today's
        # --recompute-granularity full --recompute-method uniform. `block` recomputes only some layers.
        flag = (
            "--activations-checkpoint-method" if has("--activations-checkpoint-method") else "--checkpoint-activations"
        )
        set_(("training", "activation_checkpointing"), "full", flag, f"{flag} (Megatron-LM 2.x: full recomputation)")
    elif has("--activations-checkpoint-method"):
        b.unmodelled(
            f"--activations-checkpoint-method {text_of('--activations-checkpoint-method')}",
            at("--activations-checkpoint-method"),
            "recomputation of some layers only is not modelled (priced as none)",
        )
    lr = num("--lr", None, float)
    if lr is not None and lr > 0:
        set_(("training", "learning_rate"), lr, "--lr")
    optimizer = text_of("--optimizer", "adam")
    if optimizer not in ("adam", "sgd"):
        b.unmodelled(f"--optimizer {optimizer}", at("--optimizer"), "priced as adam (two moments per parameter)")
    # Megatron's "adam" applies decoupled weight decay (AdamW).
    set_(
        ("training", "optimizer"),
        "sgd" if optimizer == "sgd" else "adamw",
        "--optimizer" if has("--optimizer") else None,
        "--optimizer" if has("--optimizer") else "--optimizer default adam (decoupled weight decay)",
    )
    if has("--train-iters"):
        set_(("training", "steps"), num("--train-iters"), "--train-iters")
    if has("--seed"):
        set_(("training", "seed"), num("--seed"), "--seed")
    b.set(("backend",), {"name": "megatron", "entry": "arguments"}, origin="pretrain_gpt.py arguments")
    return b.result()


def _pipeline_layout(b: SpecBuilder, has, at, text_of, pp: int, layers, vpp, per_stage):
    """``--pipeline-model-parallel-layout`` (Megatron-LM 0.13 and later): the layers of every virtual
    stage, read by layer_split.megatron_layout as Megatron-Core 0.16 reads it. Returns the layout,
    None without the flag, or False where Megatron refuses the launch (the refusal is reported).

    validate_args (megatron/training/arguments.py) asserts that at most one of the layout,
    --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank is set, and
    takes the virtual stages from the layout; TransformerConfig.__post_init__
    (megatron/core/transformer/transformer_config.py) raises for the layout with
    --decoder-first/last-pipeline-num-layers or --account-for-embedding/loss-in-pipeline-split and
    asserts a virtual pipeline size given beside it equals the layout's."""
    flag = "--pipeline-model-parallel-layout"
    if not has(flag):
        return None
    where = at(flag)
    text = text_of(flag)
    if not text:
        b.refuse(f"`{flag}` needs a value", where, f'write `{flag} "Et|(tt|)*N,L"`: E, t, m, L per stage')
        return False
    if per_stage is not None or has("--num-virtual-stages-per-pipeline-rank"):
        b.refuse(
            f"`{flag}` is given with --num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank",
            where,
            "Megatron-LM's validate_args allows only one of them: the layout sets the virtual stages, drop the other",
        )
        return False
    others = [
        f
        for f in (
            "--decoder-first-pipeline-num-layers",
            "--decoder-last-pipeline-num-layers",
            "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split",
        )
        if has(f)
    ]
    if others:
        b.refuse(
            f"`{flag}` is given with {', '.join(others)}",
            where,
            "Megatron's TransformerConfig raises for a layout beside another way of splitting the layers: keep one",
        )
        return False
    if not isinstance(layers, int):
        return None  # the model's size is refused already
    mtp = b.get(("model", "mtp_num_layers")) or 0
    try:
        layout = megatron_layout(text, pp, layers, mtp)
    except LayoutError as error:
        b.refuse(
            f"the pipeline layout {text!r} is refused by Megatron: {error}",
            where,
            "Megatron-Core's PipelineParallelLayerLayout asserts this (pipeline_parallel_layer_layout.py): "
            "fix the layout string",
        )
        return False
    if vpp is not None and vpp != layout.virtual_stages and (vpp > 1 or layout.virtual_stages > 1):
        b.refuse(
            f"--virtual-pipeline-model-parallel-size {vpp} conflicts with the layout's {layout.virtual_stages} "
            f"virtual stages ({len(layout.counts)} stages over pp {pp})",
            where,
            "TransformerConfig asserts they agree: drop --virtual-pipeline-model-parallel-size",
        )
        return False
    if layout.mtp_rank is not None and layout.mtp_rank != pp - 1:
        b.refuse(
            f"the pipeline layout {text!r} puts the multi-token prediction layers on pipeline rank "
            f"{layout.mtp_rank}, not the last ({pp - 1}): Megatron runs that (mtp_standalone), this tool does "
            "not model it",
            where,
            "move `m` into the last stage (before `L`) to check the launch; the memory and step time of a rank "
            "holding only the depths are not priced",
        )
        return False
    return layout


def _multi_token_prediction(b: SpecBuilder, has, num, at, set_, text_of, *, from_hf: bool) -> None:
    """``--mtp-num-layers N`` and ``--mtp-loss-scaling-factor X``: TransformerConfig.mtp_num_layers
    (default None: no multi-token prediction) and mtp_loss_scaling_factor (default 0.1), both made
    flags by ArgumentGroupFactory(TransformerConfig) in _add_network_size_args (megatron/core/
    transformer/transformer_config.py, megatron/training/arguments.py at core_v0.16.1). GPTModel then
    builds N MTP blocks after the decoder on the last pipeline stage (megatron/core/transformer/
    multi_token_prediction.py, get_mtp_num_layers_to_build), each a transformer layer of the decoder's
    kind with its own norms and projection, and adds the mean of their losses times the factor to
    the main loss. validate_args asserts, when mtp_num_layers is set, that the model is not a legacy
    one and that --position-embedding-type is rope or none (``--use-rotary-position-embeddings``
    makes it rope)."""
    flag, factor_flag = "--mtp-num-layers", "--mtp-loss-scaling-factor"
    layers = num(flag, None)
    if layers is not None and layers < 0:
        b.refuse(
            f"`{flag} {layers}` is not a number of multi-token prediction layers",
            at(flag),
            f"write `{flag} N` with N >= 1, or leave it out for none",
        )
        return
    if layers is None and from_hf:
        # The sizes come from an HF config, whose num_nextn_predict_layers Megatron-LM does not read:
        # without the flag the launch builds no MTP layer.
        if b.get(("model", "mtp_num_layers")):
            set_(
                ("model", "mtp_num_layers"),
                0,
                None,
                f"no {flag} (Megatron-LM builds no multi-token prediction layer; the HF config's "
                "num_nextn_predict_layers is not a launch argument)",
            )
    elif layers is not None:
        set_(("model", "mtp_num_layers"), layers, flag)
    if layers:
        position = text_of("--position-embedding-type", "learned_absolute")
        if has("--use-rotary-position-embeddings"):  # validate_args: use_rotary_position_embeddings -> rope
            position = "rope"
        if position not in ("rope", "none"):
            b.diagnostic(
                codes.ENGINE_REFUSES.code,
                f"Megatron-LM refuses `{flag} {layers}` with --position-embedding-type {position}"
                + ("" if has("--position-embedding-type") else " (the default)")
                + " (validate_args asserts Multi-Token Prediction is supported with rope and none only)",
                at(flag),
                hint="write `--position-embedding-type rope`, or leave the multi-token prediction layers out",
            )
        if has("--use-legacy-models"):
            b.diagnostic(
                codes.ENGINE_REFUSES.code,
                f"Megatron-LM refuses `{flag}` with --use-legacy-models (validate_args asserts the legacy models "
                "do not support Multi-Token Prediction)",
                at(flag),
                hint="drop --use-legacy-models (Megatron-Core's GPTModel builds the MTP layers)",
            )
    if not has(factor_flag):
        return  # the factor is TransformerConfig's default, 0.1: training.mtp_loss_scaling_factor null
    if not layers:
        b.unmodelled(
            f"{factor_flag} {text_of(factor_flag, '')}".strip(),
            at(factor_flag),
            f"there is no multi-token prediction loss to weigh without {flag}",
        )
        return
    factor = num(factor_flag, None, float)
    if factor is None:
        return
    if not (math.isfinite(factor) and 0 < factor <= 1e6):
        b.refuse(
            f"`{factor_flag} {text_of(factor_flag)}` is not a weight the spec takes for the multi-token prediction "
            "loss (a number above 0, at most 1e6)",
            at(factor_flag),
            f"write a positive weight (Megatron-Core's default is 0.1), or leave `{factor_flag}` out",
        )
        return
    set_(("training", "mtp_loss_scaling_factor"), factor, factor_flag)


#: Megatron-LM's MLA arguments and their defaults (megatron/training/arguments.py, _add_mla_args:
#: --q-lora-rank None, --kv-lora-rank 32, --qk-head-dim 128, --qk-pos-emb-head-dim 64, --v-head-dim 128),
#: with the spec field each gives.
MLA_FLAGS = (
    ("--kv-lora-rank", "kv_lora_rank", 32),
    ("--qk-head-dim", "qk_nope_head_dim", 128),
    ("--qk-pos-emb-head-dim", "qk_rope_head_dim", 64),
    ("--v-head-dim", "v_head_dim", 128),
)


def _latent_attention(b: SpecBuilder, has, num, at, set_, text_of) -> None:
    """``--multi-latent-attention``: Megatron-Core's MLASelfAttention (megatron/core/transformer/
    multi_latent_attention.py): queries from ``linear_q_proj`` where --q-lora-rank is unset, else
    ``linear_q_down_proj`` to that latent and ``linear_q_up_proj``; ``linear_kv_down_proj`` to
    kv_lora_rank + qk_pos_emb_head_dim and ``linear_kv_up_proj`` to heads * (qk_head_dim + v_head_dim);
    --kv-channels and the query groups are not read (its heads are qk_head_dim + qk_pos_emb_head_dim
    and v_head_dim). The latents' norms are built with --qk-layernorm only (gpt_layer_specs.py: the
    up projections are TELayerNormColumnParallelLinear with it, plain column-parallel without)."""
    flag = "--multi-latent-attention"
    for mla_flag, field_name, default in MLA_FLAGS:
        value = num(mla_flag, default)
        if value is not None and value <= 0:
            b.refuse(f"`{mla_flag} {value}` is not a width", at(mla_flag), f"give `{mla_flag}` a positive size")
            continue
        set_(
            ("model", field_name),
            value,
            mla_flag if has(mla_flag) else flag,
            mla_flag if has(mla_flag) else f"{mla_flag} default {default} (megatron/training/arguments.py)",
        )
    q_lora = num("--q-lora-rank", None)
    if q_lora is not None and q_lora <= 0:
        b.refuse(
            f"`--q-lora-rank {q_lora}` is not a query latent's width (MLASelfAttention builds a down projection "
            "to it whenever it is set)",
            at("--q-lora-rank"),
            "leave `--q-lora-rank` out for one query projection, or give the latent's width",
        )
    elif q_lora is not None:
        set_(("model", "q_lora_rank"), q_lora, "--q-lora-rank")
    if has("--group-query-attention"):
        # validate_args: "Group query attention is mutually exclusive with multi latent attention."
        b.diagnostic(
            codes.ENGINE_REFUSES.code,
            "Megatron-LM refuses --group-query-attention with --multi-latent-attention (validate_args asserts "
            "they are mutually exclusive)",
            at("--group-query-attention"),
            hint="drop --group-query-attention: MLA projects a key and a value for every head",
        )
    for unused in ("--kv-channels", "--num-query-groups"):
        if has(unused):
            b.unmodelled(
                unused,
                at(unused),
                "Multi-head Latent Attention does not read it (its heads are --qk-head-dim + --qk-pos-emb-head-dim "
                "and --v-head-dim)",
            )
    # With learned absolute positions (Megatron's default) GPTModel's embedding adds its position table
    # and MLA still turns the rotary part of its keys and queries with its own rotary embedding
    # (multi_latent_attention.py builds rotary_pos_emb from rope_type whatever position_embedding_type):
    # the spec's learned positions on an MLA model are both, as read above.
    if not has("--qk-layernorm"):
        b.assumed(
            "Megatron-Core builds Multi-head Latent Attention's latent norms only with --qk-layernorm; the spec's "
            "MLA has them, so each layer is priced with (q_lora_rank + kv_lora_rank) norm weights it does not hold",
            at(flag),
            "add `--qk-layernorm` (DeepSeek's launches pass it) to run what the plan prices",
            field=("model", "kv_lora_rank"),
        )


# megatron/core/transformer/transformer_config.py, recompute_modules: the submodules selective
# recomputation runs again; the spec names those of the transformer it models (the others belong to
# GatedDeltaNet/GatedDeltaProduct attention and hyper-connections).
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
OTHER_RECOMPUTE_MODULES = ("gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc")


def _recompute_modules(b: SpecBuilder, arg: _Arg, set_, *, grouped_gemm: bool) -> None:
    """``--recompute-modules a b ...`` (argparse nargs="*", read under selective granularity only:
    TransformerConfig.__post_init__ asserts every name is one it knows, and raises for moe_act
    without --moe-grouped-gemm). No names at all recompute nothing (the default, ["core_attn"],
    stands for an absent flag only)."""
    names = [w.text for w in arg.values]
    if not names:
        set_(
            ("training", "activation_checkpointing"),
            "none",
            "--recompute-modules",
            "--recompute-modules with no module: selective granularity recomputes nothing",
        )
        return
    if "moe_act" in names and not grouped_gemm:
        b.diagnostic(
            codes.ENGINE_REFUSES.code,
            "Megatron-Core refuses `--recompute-modules moe_act` without `--moe-grouped-gemm` (TransformerConfig: "
            "'moe_act in recompute_modules is only supported with moe_grouped_gemm')",
            arg.values[names.index("moe_act")].pos,
            hint="add `--moe-grouped-gemm`, or remove moe_act",
        )
    for w in arg.values:
        if w.text in OTHER_RECOMPUTE_MODULES:
            b.refuse(
                f"`--recompute-modules {w.text}` recomputes a submodule of an architecture the transformer "
                "spec does not model",
                w.pos,
                "remove it",
            )
            return
        if w.text not in RECOMPUTE_MODULES:
            b.diagnostic(
                codes.ENGINE_REFUSES.code,
                f"Megatron-Core refuses `--recompute-modules {w.text}` (TransformerConfig: 'Invalid choices "
                "for recompute_modules')",
                w.pos,
                hint="use " + ", ".join(RECOMPUTE_MODULES),
            )
            return
    set_(("training", "recompute_modules"), names, "--recompute-modules")


def _vocab(b: SpecBuilder, args, num, text_of, at, tp: int, options: ImportOptions) -> None:
    tokenizer = text_of("--tokenizer-type")
    if "--padded-vocab-size" in args:
        # TokenizerConfig.padded_vocab_size: the model's vocabulary as given; build_tokenizer's
        # _set_padded_vocab_size pads only when it is unset (megatron/core/tokenizers/utils/build_tokenizer.py)
        padded = num("--padded-vocab-size")
        if padded is not None and tp and padded % tp:
            # unpadded, it is split over tp as it is: VocabParallelEmbedding and the output layer divide it
            # (megatron/core/tensor_parallel/utils.py VocabUtility, megatron/core/utils.py divide asserts)
            b.diagnostic(
                codes.ENGINE_REFUSES.code,
                f"Megatron-Core refuses --padded-vocab-size {padded} with tp {tp}: the vocabulary is used as "
                "given and split over the tensor-parallel ranks, whose divide() asserts it splits evenly",
                at("--padded-vocab-size"),
                hint=f"give a multiple of {tp}, or --vocab-size to have Megatron pad it",
            )
        if padded is not None:
            b.set(
                ("model", "vocab_size"), padded, at=at("--padded-vocab-size"), origin="--padded-vocab-size (not padded)"
            )
        return
    hf_vocab = None
    if options.model is not None:
        from mixle_compile.importers.hf import read_hf_document

        data = read_hf_document(options.model, options.model).data
        hf_vocab = data.get("vocab_size") if isinstance(data, dict) else None
    if "--vocab-size" in args:
        vocab, origin, pos = num("--vocab-size"), "--vocab-size", at("--vocab-size")
    elif isinstance(hf_vocab, int) and not isinstance(hf_vocab, bool):
        vocab, origin, pos = (
            hf_vocab,
            f"{options.model}: vocab_size (the tokenizer's vocabulary)",
            at("--tokenizer-type"),
        )
    elif tokenizer == "GPT2BPETokenizer" or (tokenizer is None and "--vocab-file" in args):
        vocab, origin, pos = 50257, "GPT-2 BPE vocabulary (50257 tokens)", at("--tokenizer-type") or at("--vocab-file")
    elif tokenizer == "Llama2Tokenizer":
        vocab, origin, pos = 32000, "Llama 2 sentencepiece vocabulary (32000 pieces)", at("--tokenizer-type")
    else:
        b.refuse(
            f"the vocabulary size is not in the arguments (tokenizer {tokenizer or 'unset'} reads it from a file)",
            at("--tokenizer-type"),
            "add `--vocab-size N`, or give the model's HF config with `--model config.json`",
            ("model", "vocab_size"),
        )
        return
    if vocab is None:
        return
    # megatron/core/tokenizers/utils/build_tokenizer.py vocab_size_with_padding: up to a multiple of
    # --make-vocab-size-divisible-by (default 128) * tp.
    multiple = num("--make-vocab-size-divisible-by", 128) * tp
    padded = int(math.ceil(vocab / multiple) * multiple)
    b.set(("model", "vocab_size"), padded, at=pos, origin=f"{origin}, padded to a multiple of {multiple}")


def _hf_model(b: SpecBuilder, options: ImportOptions) -> None:
    from mixle_compile.importers.hf import hf_model, read_hf_document

    hf = hf_model(read_hf_document(options.model, options.model))
    for message, hint, pos in hf.problems:
        b.refuse(f"{options.model}:{pos.line}:{pos.column}: {message}", None, hint, ("model",))
    for field_name, v in hf.model.items():
        b.set(("model", field_name), v, origin=f"{options.model}: {hf.keys.get(field_name, 'architecture')}")


def _device_comment(text: str) -> tuple[str | None, str | None, str | None]:
    """The device kind and memory that mixle-compile's own export notes: ``# devices: 8 H100, each with 80GiB``."""
    m = re.search(r"^# devices: \d+(?: (\S+))?, each with (\S+)$", text, re.M)
    if not m:
        return None, None, None
    return (m.group(1).lower() if m.group(1) else None), m.group(2), "the script's comment: " + m.group(0)[2:]


#: The modules ``python -m`` runs as torchrun: torch.distributed.run is torchrun's own module, and the
#: deprecated torch.distributed.launch parses its command line with run.py's get_args_parser (plus
#: --use-env), so both take torchrun's options and defaults.
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _torchrun(launcher: list[Word]) -> tuple[Word, list[Word]] | None:
    """The word that runs torchrun (``torchrun``, or the module of ``python -m torch.distributed.run``)
    and the launcher's words after it (torchrun's options), or None where the launch has no torchrun."""
    for k, w in enumerate(launcher):
        if w.text.rsplit("/", 1)[-1] == "torchrun":
            return w, launcher[k + 1 :]
        if w.text == "-m" and k + 1 < len(launcher) and launcher[k + 1].text in TORCHRUN_MODULES:
            return launcher[k + 1], launcher[k + 2 :]
    return None


def _world(launcher: list[Word], run: ShellRun | None = None) -> tuple[int | None, Position | None, str | None]:
    """The world size the launch states: torchrun's --nproc-per-node * --nnodes, their defaults where
    a torchrun launch leaves them out; 1 for a script run by a bare python interpreter (one process:
    Megatron-LM's parse_args reads the world size from WORLD_SIZE, default 1, which only a launcher
    sets). None where the launch does not say (another launcher, a value the reader cannot resolve,
    a machine-dependent count such as ``--nproc-per-node gpu``, an elastic ``--nnodes 1:4``)."""
    if launcher and all(PYTHON.fullmatch(w.text.rsplit("/", 1)[-1]) or w.text in ("-u", "-O") for w in launcher):
        return 1, launcher[0].pos, "a single python process (no launcher: WORLD_SIZE defaults to 1)"
    found = _torchrun(launcher)
    if found is None:
        return _srun_tasks(launcher, run)
    torchrun, options = found
    args, _ = parse_arguments(options)
    # torch/distributed/run.py get_args_parser: "--nnodes" default="1:1", "--nproc-per-node"/
    # "--nproc_per_node" default="1"; both with action=env, which takes PET_NNODES / PET_NPROC_PER_NODE
    # from the environment before the default (torch/distributed/argparse_util.py).
    scalars = run.scalars if run is not None else {}
    said: list[str] = []

    def option(flags: tuple[str, ...], env: str, default: str) -> tuple[str | None, Position]:
        for flag in flags:
            if flag in args:
                a = args[flag]
                said.append(flag)
                return (a.value.text if a.value else None), (a.value or a.flag).pos
        if env in scalars:
            said.append(env)
            return scalars[env].text, scalars[env].pos
        said.append(f"{flags[0]} default {default}")
        return default, torchrun.pos

    per_node, per_node_at = option(("--nproc-per-node", "--nproc_per_node"), "PET_NPROC_PER_NODE", "1")
    nodes, nodes_at = option(("--nnodes",), "PET_NNODES", "1:1")
    # run.py parse_min_max_nnodes: "N" or "MIN:MAX"; a range is an elastic job whose size is decided at
    # rendezvous. determine_local_world_size: an integer, or gpu/cpu/xpu/auto, counted on the machine.
    low, _, high = (nodes or "").partition(":")
    if not (per_node or "").isdigit() or not low.isdigit() or (high and high != low):
        return None, None, None
    # the count's position: the per-node count where written, else the node count, else torchrun itself
    where = per_node_at if per_node_at is not torchrun.pos else nodes_at
    defaults = " (torch/distributed/run.py)" if any(" default " in s for s in said) else ""
    origin = "torchrun " + " * ".join(said) + defaults
    return int(per_node) * int(low), where, origin


#: Programs srun starts (the end of srun's own options in a launch).
_PROGRAMS = ("sh", "bash", "env", "numactl", "torchrun")


def _srun_tasks(launcher: list[Word], run: ShellRun | None) -> tuple[int | None, Position | None, str | None]:
    """The processes of a launch run by ``srun`` without torchrun: one per task (srun(1)), each a rank
    (WORLD_SIZE from SLURM_NTASKS, as NVIDIA's enroot PyTorch hook sets it in the containers Megatron-LM's
    examples run: enroot conf/hooks/extra/50-slurm-pytorch.sh). The tasks are srun's -n, else its nodes
    times its tasks per node, each option srun's own or, where srun leaves it out, the batch job's (#SBATCH
    directives or sbatch's options, which srun inherits through the SLURM_* environment). None where the
    launch is not srun's or the tasks are not said."""
    start = next((k for k, w in enumerate(launcher) if w.text.rsplit("/", 1)[-1] == "srun"), None)
    if start is None:
        return None, None, None
    end = next(
        (
            k
            for k in range(start + 1, len(launcher))
            if PYTHON.fullmatch(launcher[k].text.rsplit("/", 1)[-1]) or launcher[k].text in _PROGRAMS
        ),
        len(launcher),
    )
    own = slurm_options(launcher[start + 1 : end])
    job = run.slurm if run is not None else {}

    def option(name: str) -> tuple[int | None, Word | None, str]:
        w, whose = (own[name], "srun") if name in own else (job.get(name), "#SBATCH")
        if w is None or not w.text.isdigit():
            return None, None, ""
        return int(w.text), w, f"{whose} --{name} {w.text}"

    ntasks, at, said = option("ntasks")
    if ntasks is not None:
        return ntasks, at.pos, f"srun tasks: {said} (one process per task)"
    nodes, _, nodes_said = option("nodes")
    per_node, at, per_node_said = option("ntasks-per-node")
    if nodes is None or per_node is None:
        return None, None, None
    return nodes * per_node, at.pos, f"srun tasks: {nodes_said} * {per_node_said} (one process per task)"
