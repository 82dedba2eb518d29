"""The batch arithmetic (B0xx)."""

from __future__ import annotations

from mixle_compile.verify.rule import EVERY_FAMILY, Rule, define
from mixle_compile.verify.wording import alternatives

_TERMS = (
    ("mesh.gradient_accumulation_steps", "gradient_accumulation_steps"),
    ("mesh.microbatches", "microbatches"),
    ("training.micro_batch_size", "micro_batch_size"),
)


def _product(x) -> int:
    return x.micro_batch_size * x.microbatches * x.gradient_accumulation_steps * x.data_parallel


def _explain(x) -> str:
    return (
        f"global_batch_size={x.global_batch_size}, but micro_batch_size*microbatches*gradient_accumulation_steps"
        "*data-parallel size = "
        f"{x.micro_batch_size}*{x.microbatches}*{x.gradient_accumulation_steps}*{x.data_parallel} "
        f"= {_product(x)}; the data-parallel size is dp_replicate*dp_shard = {x.dp_replicate}*{x.dp_shard} "
        "(tp, cp and pp ranks see the same samples and do not count)"
    )


def _hint(x) -> str:
    """Every single-field change that would make the product fit."""
    fits = [f"training.global_batch_size: {_product(x)}"]
    for path, name in _TERMS:
        rest = _product(x) // getattr(x, name)
        if x.global_batch_size % rest == 0:
            fits.append(f"{path}: {x.global_batch_size // rest}")
    return "any of these fits: " + alternatives(fits)


GLOBAL_BATCH = define(
    Rule(
        code="B001",
        name="global-batch-size",
        title="global_batch_size = micro_batch_size * microbatches * gradient_accumulation_steps * "
        "dp_replicate * dp_shard.",
        docs=(
            "Every optimizer step consumes the global batch: each data-parallel rank runs `microbatches` "
            "pipeline micro-batches of `micro_batch_size` samples, `gradient_accumulation_steps` times. The "
            "data-parallel size is `dp_replicate * dp_shard` only: tensor-, context- and pipeline-parallel "
            "ranks work on the same samples, and counting them is the classic mistake behind DeepSpeed "
            "#5410 and #3228. The hint lists each single field that would make the product fit."
        ),
        engine_reference=(
            "Megatron-LM `validate_args` (global batch divisible by micro batch * data-parallel size); "
            "DeepSpeed `_batch_assertion` (train_batch_size = micro_batch * gas * dp world size), issues #5410, #3228"
        ),
        constraint=lambda v: (
            v.global_batch_size == v.micro_batch_size * v.microbatches * v.gradient_accumulation_steps * v.data_parallel
        ),
        explain=_explain,
        hint=_hint,
        fields=(
            "global_batch_size",
            "gradient_accumulation_steps",
            "microbatches",
            "micro_batch_size",
            "dp_replicate",
            "dp_shard",
        ),
        families=EVERY_FAMILY,
    )
)
