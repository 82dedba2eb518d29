"""The spec as code: pydantic v2 models with ``extra="forbid"``.

The JSON Schema in ``schemas/spec.schema.json`` is generated from these models
(``python -m mixle_compile schema``), never written by hand.

Integers are strict everywhere: ``8.0``, ``"8"`` and ``true`` are refused where an integer is
meant, because each of those is usually a mistake that a lax parser would hide.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from mixle_compile.schedules import NUMBERS, Logic
from mixle_compile.spec.kinds import Family

# Bounds keep arithmetic meaningful and every later pass fast; no real cluster or model is
# anywhere near them.
MAX_DEGREE = 1 << 20
MAX_SIZE = 1 << 48

Degree = Annotated[StrictInt, Field(ge=1, le=MAX_DEGREE)]
Size = Annotated[StrictInt, Field(ge=1, le=MAX_SIZE)]
Count = Annotated[StrictInt, Field(ge=0, le=MAX_SIZE)]
Name = Annotated[StrictStr, Field(min_length=1, max_length=200)]
# fp64: distribution models only (EM fits in float64, as mixle does); rule C008 refuses it for neural ones.
Precision = Literal["fp32", "bf16", "fp16", "fp8", "fp64"]
NeuralPrecision = Literal["fp32", "bf16", "fp16", "fp8"]  # a module parameter's own dtype


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- quantities

_MEMORY_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z/]+)\s*$")


def parse_memory(value: Any) -> int:
    """``"80GiB"`` -> 85899345920; ``"80GB"`` -> 80000000000; an integer is a number of bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"must be a memory size such as '80GiB', '80GB' or a number of bytes, got {_show(value)}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"must be a positive number of bytes, got {value}")
        return value
    m = _QUANTITY.match(value)
    if not m or m.group(2) not in _MEMORY_UNITS:
        units = ", ".join(_MEMORY_UNITS)
        raise ValueError(
            f"cannot read memory size {value!r}; write a number and one of the units {units} (e.g. '80GiB')"
        )
    nbytes = int(float(m.group(1)) * _MEMORY_UNITS[m.group(2)])
    if nbytes < 1:
        raise ValueError(f"memory size {value!r} is zero")
    return nbytes


_FLOPS_UNITS = {"FLOPS": 1, "KFLOPS": 1e3, "MFLOPS": 1e6, "GFLOPS": 1e9, "TFLOPS": 1e12, "PFLOPS": 1e15}


def _parse_rate(
    value: Any, *, what: str, example: str, units: dict[str, float], normalise=lambda unit: unit, also: str = ""
) -> float:
    """A positive finite rate: a plain number in the base unit, or a number and one of ``units``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"must be a {what} such as {example}, got {_show(value)}")
    if isinstance(value, str):
        m = _QUANTITY.match(value)
        unit = normalise(m.group(2)) if m else ""
        if not m or unit not in units:
            raise ValueError(
                f"cannot read {what} {value!r}; write a number and one of {', '.join(units)}{also} (e.g. "
                f"{example.split(' or ')[0]})"
            )
        value = float(m.group(1)) * units[unit]
    value = float(value)
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"{what} must be a positive finite number, got {value}")
    return value


def parse_throughput(value: Any) -> float:
    """``"989TFLOPS"`` (or ``"989 TFLOP/s"``) -> 9.89e14 FLOP/s; a plain number is FLOP/s."""
    return _parse_rate(
        value,
        what="throughput",
        example="'989TFLOPS' or a number of FLOP/s",
        units=_FLOPS_UNITS,
        normalise=lambda unit: unit.upper().replace("FLOP/S", "FLOPS"),
    )


_BANDWIDTH_UNITS = {"B/s": 1, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12, "Gb/s": 1e9 / 8, "Tb/s": 1e12 / 8}


def parse_bandwidth(value: Any) -> float:
    """``"450GB/s"`` (bytes) or ``"400Gb/s"`` (bits) -> bytes per second; a plain number is bytes/s."""
    return _parse_rate(
        value,
        what="bandwidth",
        example="'450GB/s' or '400Gb/s', or a number of bytes/s",
        units=_BANDWIDTH_UNITS,
        also=" (GB/s bytes, Gb/s bits)",
    )


_LATENCY_UNITS = {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_latency(value: Any) -> float:
    """``"3.4us"`` (or ``"14 us"``, ``"0.01ms"``) -> seconds; a plain number is seconds."""
    return _parse_rate(
        value,
        what="latency",
        example="'3.4us' or a number of seconds",
        units=_LATENCY_UNITS,
    )


Latency = Annotated[
    float,
    PlainValidator(parse_latency),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "exclusiveMinimum": 0, "description": "seconds"},
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(s|ms|us|ns)\s*$"},
            ]
        }
    ),
]


Bandwidth = Annotated[
    float,
    PlainValidator(parse_bandwidth),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "exclusiveMinimum": 0, "description": "bytes/s"},
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(B/s|KB/s|MB/s|GB/s|TB/s|Gb/s|Tb/s)\s*$"},
            ]
        }
    ),
]


#: `mesh.dp_shard: auto`: the data-parallel shard degree takes the ranks the other degrees leave,
#: ``devices / (dp_replicate * tp * pp * cp)`` (``ep`` and ``etp`` are carved out of those ranks,
#: not factors). Written once here and read as numbers (the loader's S012, :func:`parallel_plan`)
#: and as solver terms (the verifier's symbols, rule D001's hint).
AUTO = "auto"


def is_auto(value: Any) -> bool:
    """Whether a ``mesh.dp_shard`` value is ``auto`` (never true of a number)."""
    return isinstance(value, str) and value == AUTO


def auto_divisor(*, dp_replicate: Any, tp: Any, pp: Any, cp: Any) -> Any:
    """What `dp_shard: auto` divides the devices by (numbers or solver terms)."""
    return dp_replicate * tp * pp * cp


def auto_resolves(devices: int, divisor: int) -> bool:
    """Whether `dp_shard: auto` resolves to a whole degree on ``devices`` (S012 otherwise)."""
    return devices % divisor == 0


def auto_dp_shard(logic: Logic, *, devices: Any, dp_replicate: Any, tp: Any, pp: Any, cp: Any) -> Any:
    """What `dp_shard: auto` resolves to, rounding down; ``logic`` is
    :data:`mixle_compile.schedules.NUMBERS` for numbers or the verifier's ``TERMS``."""
    return logic.quotient(devices, auto_divisor(dp_replicate=dp_replicate, tp=tp, pp=pp, cp=cp))


def _parse_dp_shard(value: Any) -> int | str:
    if is_auto(value):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DEGREE:
        raise ValueError(f"must be an integer from 1 to {MAX_DEGREE} or '{AUTO}', got {_show(value)}")
    return value


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, str):
        return f"{value!r} (a string)"
    if isinstance(value, float):
        return f"{value!r} (a float)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return repr(value)


Memory = Annotated[
    int,
    PlainValidator(parse_memory),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 1, "description": "bytes"},
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$"},
            ],
            "description": "memory per device: bytes, or a size such as '80GiB' or '80GB'",
        }
    ),
]
Throughput = Annotated[
    float,
    PlainValidator(parse_throughput),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "exclusiveMinimum": 0, "description": "FLOP/s"},
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*[KMGTP]?FLOP(S|/s)\s*$"},
            ],
            "description": "peak throughput per device: FLOP/s, or e.g. '989TFLOPS'",
        }
    ),
]
DpShard = Annotated[
    int | Literal[AUTO],
    PlainValidator(_parse_dp_shard),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_DEGREE}, {"const": AUTO}]}),
]


# --------------------------------------------------------------------------- mesh

MESH_ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")


class MeshSpec(StrictModel):
    """Exactly the ParallelPlan fields, plus an optional Megatron-style rank order."""

    dp_replicate: Degree = 1
    dp_shard: DpShard = 1
    tp: Degree = 1
    pp: Degree = 1
    cp: Degree = 1
    ep: Degree = 1
    etp: Degree = 1
    microbatches: Degree = 1
    gradient_accumulation_steps: Degree = 1
    order: StrictStr | None = Field(
        default=None,
        description="rank order of the axes, innermost first, Megatron style, e.g. 'tp-cp-ep-dp-pp'",
    )

    @field_validator("order")
    @classmethod
    def _order_is_permutation(cls, value: str | None) -> str | None:
        if value is None:
            return value
        tokens = value.split("-")
        if sorted(tokens) != sorted(MESH_ORDER_TOKENS):
            raise ValueError(
                f"order {value!r} must name each of {', '.join(MESH_ORDER_TOKENS)} exactly once, joined "
                "by '-' (e.g. 'tp-cp-ep-dp-pp')"
            )
        return value


# --------------------------------------------------------------------------- models


class TransformerModel(StrictModel):
    family: Literal[Family.TRANSFORMER.value]
    vocab_size: Size
    hidden_size: Size
    num_layers: Size
    num_heads: Size
    num_kv_heads: Size | None = Field(default=None, description="defaults to num_heads (multi-head attention)")
    head_dim: Size | None = Field(default=None, description="defaults to hidden_size / num_heads")
    kv_lora_rank: Size | None = Field(
        default=None,
        description="Multi-head Latent Attention (MLA, DeepSeek-V2/V3): keys and values are projected down to a "
        "latent of this width and up again per head (HF kv_lora_rank, Megatron --kv-lora-rank); null = "
        "ordinary attention",
    )
    q_lora_rank: Size | None = Field(
        default=None,
        description="MLA: queries are projected down to a latent of this width and up again (HF q_lora_rank, "
        "Megatron --q-lora-rank); null = one query projection",
    )
    qk_nope_head_dim: Size | None = Field(
        default=None,
        description="MLA: a query/key head's features without rotary positions (HF qk_nope_head_dim, Megatron "
        "--qk-head-dim)",
    )
    qk_rope_head_dim: Size | None = Field(
        default=None,
        description="MLA: a query/key head's features with rotary positions, the key's part shared by every "
        "head (HF qk_rope_head_dim, Megatron --qk-pos-emb-head-dim)",
    )
    v_head_dim: Size | None = Field(
        default=None, description="MLA: a value head's features (HF v_head_dim, Megatron --v-head-dim)"
    )
    ffn_hidden_size: Size
    tie_embeddings: StrictBool = False
    num_experts: Count = Field(default=0, description="0 = dense")
    experts_per_token: Size | None = Field(default=None, description="top-k routing; required when num_experts > 0")
    moe_ffn_hidden_size: Size | None = Field(default=None, description="defaults to ffn_hidden_size")
    moe_layer_frequency: Size = Field(default=1, description="every k-th layer is a mixture-of-experts layer")
    moe_first_layer: Count = Field(
        default=0,
        description="the first mixture-of-experts layer: layers f, f + k, f + 2k, ... are MoE layers (f = this, k "
        "= moe_layer_frequency) and the f layers before it dense (DeepSeek's first_k_dense_replace; HF Qwen-MoE's "
        "decoder_sparse_step k and Llama 4's interleave step k put it at k - 1)",
    )
    moe_shared_expert_hidden_size: Size | None = Field(
        default=None,
        description="a shared expert beside the routed ones in every mixture-of-experts layer: a dense MLP of "
        "this width that every token passes through (Megatron --moe-shared-expert-intermediate-size: the "
        "shared experts' widths summed); null = none",
    )
    moe_shared_expert_gate: StrictBool = Field(
        default=False,
        description="the shared expert's output is scaled by sigmoid(x . w) with a learned [1, hidden] w "
        "(Megatron --moe-shared-expert-gate, Qwen2-MoE's shared_expert_gate)",
    )
    expert_capacity_factor: Annotated[StrictFloat | StrictInt, Field(gt=0, allow_inf_nan=False)] | None = Field(
        default=None,
        description="tokens an expert takes, as a multiple of its even share (Megatron "
        "--moe-expert-capacity-factor); null = dropless routing",
    )
    mtp_num_layers: Count = Field(
        default=0,
        description="multi-token prediction depths (DeepSeek-V3) after the last layer: depth k joins the previous "
        "depth's hidden state with the embedding of the token k ahead (two norms and a [2 hidden -> hidden] "
        "projection), runs one more block of the last layer's kind and predicts the token k + 1 ahead through the "
        "output head (Megatron --mtp-num-layers, HF num_nextn_predict_layers, torchtitan num_mtp_layers); they sit "
        "on the last pipeline stage; 0 = none",
    )
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    activation: Literal["swiglu", "gelu", "relu"] = "swiglu"
    position_embedding: Literal["rope", "learned"] = "rope"
    max_position_embeddings: Size | None = Field(
        default=None,
        description="the longest sequence the model is built for: a learned position table's rows (HF "
        "n_positions / max_position_embeddings, Megatron --max-position-embeddings); null = training.seq_len",
    )

    @property
    def latent_attention(self) -> bool:
        """Multi-head Latent Attention (MLA) instead of (grouped-query) multi-head attention."""
        return self.kv_lora_rank is not None

    def positions(self, seq_len: int | None) -> int | None:
        """The longest sequence the model is built for (a learned position table's rows)."""
        return self.max_position_embeddings or seq_len


ParameterRole = Literal["embedding", "column", "row", "norm", "expert", "router", "head", "bias", "other"]


class ModuleParameter(StrictModel):
    name: Name
    shape: Annotated[list[Size], Field(max_length=8)]
    dtype: NeuralPrecision | None = Field(default=None, description="defaults to training.precision")
    role: ParameterRole = "other"
    layer: Count | None = None
    shared_group: Name | None = Field(default=None, description="parameters tied to each other share a group")


class ModulesModel(StrictModel):
    family: Literal[Family.MODULES.value]
    parameters: Annotated[list[ModuleParameter], Field(min_length=1)]


# Distribution trees ------------------------------------------------------------


class _Node(StrictModel):
    name: Name | None = Field(default=None, description="optional label used in paths and reports")


Real = Annotated[StrictFloat | StrictInt, Field(allow_inf_nan=False)]
MAX_PARAMETER_VALUES = 1 << 24  # values written in a spec; a larger model is planned from its shape alone


def _check_values(
    owner: str, name: str, values: Any, *, length: int, positive: bool = False, non_negative: bool = False
) -> None:
    if len(values) != length:
        raise ValueError(f"{owner} `{name}` has {len(values)} values, but the node needs {length}")
    for v in values:
        if (positive and not v > 0) or (non_negative and not v >= 0):
            raise ValueError(
                f"{owner} `{name}` holds {v!r}; every value must be {'positive' if positive else 'non-negative'}"
            )


def _check_probabilities(owner: str, name: str, rows: list[list[float]]) -> None:
    for i, row in enumerate(rows):
        total = float(sum(row))
        if abs(total - 1.0) > 1e-6:
            where = f" row {i}" if len(rows) > 1 else ""
            raise ValueError(f"{owner} `{name}`{where} sums to {total!r}; probabilities must sum to 1")


class Gaussian(_Node):
    type: Literal["gaussian"]
    dim: Size
    covariance: Literal["diag", "full"] = "diag"
    mean: Annotated[list[Real], Field(max_length=MAX_PARAMETER_VALUES)] | None = Field(
        default=None, description="optional parameter values: the mean (dim values)"
    )
    variance: Annotated[list[Real], Field(max_length=MAX_PARAMETER_VALUES)] | None = Field(
        default=None, description="optional parameter values, covariance diag: the variances (dim positive values)"
    )
    covariance_matrix: Annotated[list[Annotated[list[Real], Field(max_length=4096)]], Field(max_length=4096)] | None = (
        Field(default=None, description="optional parameter values, covariance full: the dim x dim covariance matrix")
    )

    @model_validator(mode="after")
    def _parameters(self) -> Gaussian:
        if self.mean is not None:
            _check_values("a gaussian's", "mean", self.mean, length=self.dim)
        if self.variance is not None:
            if self.covariance != "diag":
                raise ValueError("`variance` is for covariance: diag; a full gaussian takes `covariance_matrix`")
            _check_values("a gaussian's", "variance", self.variance, length=self.dim, positive=True)
        if self.covariance_matrix is not None:
            if self.covariance != "full":
                raise ValueError("`covariance_matrix` is for covariance: full; a diag gaussian takes `variance`")
            m = self.covariance_matrix
            if len(m) != self.dim or any(len(row) != self.dim for row in m):
                raise ValueError(f"a gaussian's `covariance_matrix` must be {self.dim} x {self.dim}")
            if any(
                abs(m[i][j] - m[j][i]) > 1e-9 * max(abs(m[i][j]), abs(m[j][i]), 1e-300)
                for i in range(self.dim)
                for j in range(i)
            ):
                raise ValueError("a gaussian's `covariance_matrix` must be symmetric")
            if any(not m[i][i] > 0 for i in range(self.dim)):
                raise ValueError("a gaussian's `covariance_matrix` must have a positive diagonal")
        return self


class Categorical(_Node):
    type: Literal["categorical"]
    num_values: Size
    probs: Annotated[list[Real], Field(max_length=MAX_PARAMETER_VALUES)] | None = Field(
        default=None, description="optional parameter values: the probability of each value 0..num_values-1"
    )

    @model_validator(mode="after")
    def _parameters(self) -> Categorical:
        if self.probs is not None:
            _check_values("a categorical's", "probs", self.probs, length=self.num_values, non_negative=True)
            _check_probabilities("a categorical's", "probs", [self.probs])
        return self


class _Rates(_Node):
    dim: Size = 1
    rate: Annotated[list[Real], Field(max_length=MAX_PARAMETER_VALUES)] | None = Field(
        default=None, description="optional parameter values: the rate of each dimension (dim positive values)"
    )

    @model_validator(mode="after")
    def _parameters(self):
        if self.rate is not None:
            _check_values(f"a {self.type}'s", "rate", self.rate, length=self.dim, positive=True)
        return self


class Poisson(_Rates):
    type: Literal["poisson"]


class Exponential(_Rates):
    type: Literal["exponential"]


class _TransitionValues(StrictModel):
    """Optional initial and transition probabilities of an HMM's S states."""

    initial: Annotated[list[Real], Field(max_length=4096)] | None = Field(
        default=None, description="optional parameter values: the initial state probabilities (num_states values)"
    )
    transition: Annotated[list[Annotated[list[Real], Field(max_length=4096)]], Field(max_length=4096)] | None = Field(
        default=None, description="optional parameter values: row i holds the probabilities of moving from state i"
    )

    def _check_transition_values(self, owner: str, num_states: int) -> None:
        if self.initial is not None:
            _check_values(owner, "initial", self.initial, length=num_states, non_negative=True)
            _check_probabilities(owner, "initial", [self.initial])
        if self.transition is not None:
            if len(self.transition) != num_states or any(len(r) != num_states for r in self.transition):
                raise ValueError(f"{owner} `transition` must be {num_states} x {num_states}")
            for row in self.transition:
                _check_values(owner, "transition", row, length=num_states, non_negative=True)
            _check_probabilities(owner, "transition", self.transition)


class Transitions(_Node, _TransitionValues):
    """An HMM's initial and transition probabilities, a dense S x S block held whole."""

    type: Literal["transitions"]
    num_states: Size

    @model_validator(mode="after")
    def _parameters(self) -> Transitions:
        self._check_transition_values("a transitions node's", self.num_states)
        return self


class Mixture(_Node):
    type: Literal["mixture"]
    components: Annotated[list[DistributionNode], Field(min_length=1)] | None = None
    component: DistributionNode | None = Field(default=None, description="one component repeated `repeat` times")
    repeat: Size | None = None
    weights: Annotated[list[Real], Field(max_length=MAX_PARAMETER_VALUES)] | None = Field(
        default=None, description="optional parameter values: the weight of each component"
    )

    @model_validator(mode="after")
    def _components_or_repeat(self) -> Mixture:
        listed = self.components is not None
        repeated = self.component is not None or self.repeat is not None
        if listed and repeated:
            raise ValueError("a mixture takes either `components` or `component` with `repeat`, not both")
        if not listed and (self.component is None or self.repeat is None):
            raise ValueError("a mixture needs `components` (a list) or `component` together with `repeat: K`")
        if self.weights is not None:
            _check_values("a mixture's", "weights", self.weights, length=self.num_components, non_negative=True)
            _check_probabilities("a mixture's", "weights", [self.weights])
        return self

    @property
    def num_components(self) -> int:
        return len(self.components) if self.components is not None else int(self.repeat or 0)


class Composite(_Node):
    type: Literal["composite"]
    factors: Annotated[list[DistributionNode], Field(min_length=1)]


class HMM(_Node, _TransitionValues):
    type: Literal["hmm"]
    num_states: Size
    emission: DistributionNode | None = Field(default=None, description="one emission distribution repeated per state")
    emissions: Annotated[list[DistributionNode], Field(min_length=1)] | None = None
    transitions: DistributionNode | None = Field(
        default=None, description="a `transitions` node (often a `ref:` to a shared one); defaults to the HMM's own"
    )
    length: DistributionNode | None = Field(
        default=None, description="optional distribution of the sequence length, held whole (not cut with the states)"
    )

    @model_validator(mode="after")
    def _emissions(self) -> HMM:
        if (self.emission is None) == (self.emissions is None):
            raise ValueError(
                "an hmm takes exactly one of `emission` (repeated per state) or `emissions` (one per state)"
            )
        if self.emissions is not None and len(self.emissions) != self.num_states:
            raise ValueError(
                f"an hmm with num_states={self.num_states} needs {self.num_states} emissions, got {len(self.emissions)}"
            )
        if self.transitions is not None and (self.initial is not None or self.transition is not None):
            raise ValueError("an hmm with a `transitions` node takes its initial and transition values there")
        self._check_transition_values("an hmm's", self.num_states)
        return self


class Sequence(_Node):
    type: Literal["sequence"]
    base: DistributionNode
    length: DistributionNode | None = Field(
        default=None, description="the distribution of the sequence length; omitted: lengths are not modelled"
    )


class Ref(StrictModel):
    ref: Name


NODE_TYPES = (
    "gaussian",
    "categorical",
    "poisson",
    "exponential",
    "transitions",
    "mixture",
    "composite",
    "hmm",
    "sequence",
)


def _node_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        return "ref" if "ref" in value else value.get("type") if isinstance(value.get("type"), str) else None
    if isinstance(value, Ref):
        return "ref"
    return getattr(value, "type", None)


DistributionNode = Annotated[
    Annotated[Gaussian, Tag("gaussian")]
    | Annotated[Categorical, Tag("categorical")]
    | Annotated[Poisson, Tag("poisson")]
    | Annotated[Exponential, Tag("exponential")]
    | Annotated[Transitions, Tag("transitions")]
    | Annotated[Mixture, Tag("mixture")]
    | Annotated[Composite, Tag("composite")]
    | Annotated[HMM, Tag("hmm")]
    | Annotated[Sequence, Tag("sequence")]
    | Annotated[Ref, Tag("ref")],
    Discriminator(_node_tag),
]

for _cls in (Mixture, Composite, HMM, Sequence):
    _cls.model_rebuild()


class DistributionModel(StrictModel):
    family: Literal[Family.DISTRIBUTION.value]
    root: DistributionNode
    shared: dict[Name, DistributionNode] = Field(
        default_factory=dict, description="nodes defined once and used from several parents with {ref: NAME}"
    )


FAMILIES = tuple(f.value for f in Family)


class ModelFile(StrictModel):
    """``model: {from: hf, path: config.json}``: a transformer read from an HF config.json;
    ``model: {from: mixle, path: model.json}``: a distribution read from a mixle model's ``to_dict()``
    JSON. The path is relative to the spec. The loader replaces it with the model it reads before
    validation."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    from_: Literal["hf", "mixle"] = Field(
        alias="from", description="the file's format: an HF config.json (hf) or a mixle model's to_dict() JSON (mixle)"
    )
    path: Name = Field(description="the file, relative to the spec file")


def _family_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        family = value.get("family")
        return family if isinstance(family, str) else None
    return getattr(value, "family", None)


ModelSpec = Annotated[
    Annotated[TransformerModel, Tag("transformer")]
    | Annotated[ModulesModel, Tag("modules")]
    | Annotated[DistributionModel, Tag("distribution")],
    Discriminator(_family_tag),
]


# --------------------------------------------------------------------------- training, resources


def compiled_components(value: Any) -> tuple[str, ...]:
    """What ``training.compile`` compiles: () when off, torchtitan's default [model, loss] for ``true``."""
    if value is True:
        return ("model", "loss")
    return tuple(dict.fromkeys(value or ()))


class TrainingSpec(StrictModel):
    global_batch_size: Size
    micro_batch_size: Size = 1
    seq_len: Size | None = Field(default=None, description="tokens per sample; required for transformers")
    precision: Precision = "bf16"
    optimizer: Literal["sgd", "adamw", "adam"] = "adamw"
    learning_rate: Annotated[StrictFloat, Field(gt=0, le=1e6, allow_inf_nan=False)] = 1e-3
    sequence_parallel: StrictBool = False
    distributed_optimizer: StrictBool = False
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    virtual_pipeline_stages: Degree = 1
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    recompute_modules: (
        Annotated[
            list[Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"]],
            Field(min_length=1, max_length=7),
        ]
        | None
    ) = Field(
        default=None,
        description="Megatron-Core's selective recomputation (--recompute-modules; activation_checkpointing: "
        "selective): the submodules run again in the backward; null = Megatron's default, [core_attn]",
    )
    mtp_loss_scaling_factor: Annotated[StrictFloat | StrictInt, Field(gt=0, le=1e6, allow_inf_nan=False)] | None = (
        Field(
            default=None,
            description="the weight of the multi-token prediction loss (the mean over its depths) beside the main "
            "loss (Megatron --mtp-loss-scaling-factor, torchtitan MTPLoss mtp_scale); null = the engine's default "
            "(Megatron-Core 0.1, torchtitan 0.3, the in-tree runtime Megatron's)",
        )
    )
    attention: Literal["flash", "eager"] | None = Field(
        default=None,
        description="attention kernel: flash (fused; never stores the score matrix) or eager; defaults to the "
        "engine's (flash)",
    )
    compile: StrictBool | Annotated[list[Literal["model", "loss"]], Field(max_length=2)] = Field(
        default=False,
        description=(
            "what torch.compile compiles, as torchtitan's compile.enable and compile.components: true means "
            "torchtitan's default components [model, loss], a list names them; read by torchtitan (a compiled "
            "loss never materialises fp32 logits), refused as unused by engines that do not compile"
        ),
    )
    async_tensor_parallel: StrictBool = Field(
        default=False,
        description=(
            "overlap tensor-parallel communication with the matrix multiplications: torchtitan's "
            "enable_async_tensor_parallel (needs the model compiled), Megatron's --tp-comm-overlap (needs "
            "sequence parallelism); the in-tree runtime does not overlap"
        ),
    )
    expert_dispatcher: Literal["all_to_all", "flex"] = Field(
        default="all_to_all",
        description=(
            "how a mixture-of-experts layer's tokens reach their experts' ranks: all_to_all sends one copy of "
            "a token per routed expert (Megatron's alltoall dispatcher, torchtitan's standard backend, the "
            "in-tree runtime); flex sends a token once to each rank of its node holding one of its experts and "
            "once to each other node holding one (DeepEP, HybridEP: Megatron's flex dispatcher, torchtitan's "
            "deepep/hybridep expert-parallel communication backends)"
        ),
    )
    overlap_pipeline_transfers: bool | None = Field(
        default=None,
        description=(
            "whether a pipeline stage's sends and receives run beside its compute (Megatron's "
            "overlap_p2p_comm, which only the interleaved schedule has); left out, the engine's default: on "
            "for Megatron-LM's arguments (--no-overlap-p2p-communication turns it off), off for Megatron-Core's "
            "ModelParallelConfig (Megatron-Bridge turns it on whenever there are virtual stages); torch's "
            "pipelining has no such switch and refuses the field (P012): its transfers are priced exposed"
        ),
    )
    microbatch_group_size: Size | None = Field(
        default=None,
        description=(
            "Megatron's interleaved schedule: how many micro-batches each virtual stage runs at a time "
            "(microbatch_group_size_per_vp_stage, Megatron-LM's --microbatch-group-size-per-virtual-pipeline-stage); "
            "left out, pp. It must lie within [pp, micro-batches per step], and the last group hold none or at "
            "least pp micro-batches (P004); a larger group warms up more micro-batches and holds them. torch's "
            "pipelining has no such setting (P013)"
        ),
    )
    pipeline_layers: Literal["even"] | Annotated[list[Count], Field(min_length=1, max_length=1 << 16)] | None = Field(
        default=None,
        description=(
            "how layers are split over pipeline stages: 'even', or the layers of each (virtual) stage in model order; "
            "defaults to the engine's rule"
        ),
    )
    steps: Size = 1
    seed: Count = 0

    @property
    def compiled(self) -> tuple[str, ...]:
        """The components torch.compile compiles (:func:`compiled_components`)."""
        return compiled_components(self.compile)


class DeviceGroup(StrictModel):
    """``count`` devices of one kind (a list of groups describes a heterogeneous cluster)."""

    kind: Name = "gpu"
    memory: Memory
    throughput: Throughput | None = None
    count: Degree = 1


def _devices_tag(value: Any) -> str | None:
    if isinstance(value, list):
        return "list"
    if isinstance(value, int) and not isinstance(value, bool):
        return "count"
    return None


class Topology(StrictModel):
    """How devices are connected, for the step-time model (defaults per device kind: docs/step-time.md)."""

    devices_per_node: Degree | None = Field(default=None, description="devices that share the intra-node links")
    intra_node_bandwidth: Bandwidth | None = Field(default=None, description="per device and direction, e.g. '450GB/s'")
    inter_node_bandwidth: Bandwidth | None = Field(default=None, description="per device and direction, e.g. '400Gb/s'")
    intra_node_latency: Latency | None = Field(
        default=None, description="per step of a ring collective inside a node, e.g. '3.4us'"
    )
    inter_node_latency: Latency | None = Field(
        default=None, description="per step of a ring collective between nodes, e.g. '14us'"
    )


class Resources(StrictModel):
    devices: Annotated[
        Annotated[Degree, Tag("count")] | Annotated[list[DeviceGroup], Field(min_length=1), Tag("list")],
        Discriminator(_devices_tag),
    ]
    kind: Name | None = Field(default=None, description="with a device count: the kind of every device")
    memory: Memory | None = Field(default=None, description="with a device count: memory of every device")
    throughput: Throughput | None = Field(default=None, description="with a device count: throughput of every device")
    topology: Topology | None = Field(default=None, description="links between devices, for predicted step times")

    @model_validator(mode="after")
    def _count_or_list(self) -> Resources:
        if isinstance(self.devices, int) and self.memory is None:
            raise ValueError("with `devices` given as a count, `memory` (per device, e.g. '80GiB') is required")
        if isinstance(self.devices, list) and (self.kind, self.memory, self.throughput) != (None, None, None):
            raise ValueError("with `devices` given as a list, put kind, memory and throughput on each entry")
        return self

    @property
    def device_count(self) -> int:
        if isinstance(self.devices, int):
            return self.devices
        return sum(group.count for group in self.devices)

    def device_list(self) -> list[DeviceGroup]:
        """One entry per device, in rank order."""
        if isinstance(self.devices, int):
            one = DeviceGroup(kind=self.kind or "gpu", memory=self.memory, throughput=self.throughput, count=1)
            return [one] * self.devices
        return [group.model_copy(update={"count": 1}) for group in self.devices for _ in range(group.count)]


class ElasticSpec(StrictModel):
    min_world_size: Degree
    max_world_size: Degree
    multiple_of: Degree = 1

    @model_validator(mode="after")
    def _range(self) -> ElasticSpec:
        if self.min_world_size > self.max_world_size:
            raise ValueError(
                f"min_world_size ({self.min_world_size}) is larger than max_world_size ({self.max_world_size})"
            )
        return self


class BackendRef(StrictModel):
    """A backend with its version (and, for megatron, the front end that builds its config)."""

    name: Name
    version: Annotated[StrictStr, Field(pattern=r"^\d+(\.\d+){0,2}$")] | None = Field(
        default=None, description="engine version, e.g. '0.16'; defaults to the newest supported"
    )
    entry: Name | None = Field(
        default=None,
        description="megatron only: 'arguments' (Megatron-LM argument validation, the default) or 'core' "
        "(Megatron-Core config classes)",
    )


def _backend_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "name"
    if isinstance(value, (dict, BackendRef)):
        return "ref"
    return None


Backend = Annotated[
    Annotated[Name, Tag("name")] | Annotated[BackendRef, Tag("ref")],
    Discriminator(_backend_tag),
]


class Spec(StrictModel):
    model: ModelSpec
    mesh: MeshSpec
    training: TrainingSpec
    backend: Backend
    resources: Resources
    elastic: ElasticSpec | None = None


def parallel_plan(spec: Spec):
    """The spec's mesh as a :class:`~mixle_compile.contracts.ParallelPlan`, `dp_shard: auto` filled in.

    Call only on a spec whose consistency checks passed (auto is then resolvable).
    """
    from mixle_compile.contracts import ParallelPlan

    mesh = spec.mesh
    dp_shard = mesh.dp_shard
    if is_auto(dp_shard):
        dp_shard = auto_dp_shard(
            NUMBERS,
            devices=spec.resources.device_count,
            dp_replicate=mesh.dp_replicate,
            tp=mesh.tp,
            pp=mesh.pp,
            cp=mesh.cp,
        )
    return ParallelPlan(
        dp_replicate=mesh.dp_replicate,
        dp_shard=dp_shard,
        tp=mesh.tp,
        pp=mesh.pp,
        cp=mesh.cp,
        ep=mesh.ep,
        etp=mesh.etp,
        microbatches=mesh.microbatches,
        gradient_accumulation_steps=mesh.gradient_accumulation_steps,
    )
