"""The training session: the seed's DistributedTrainingSession protocol over a replayed plan.

``train_batch(inputs, targets)`` takes this rank's batch of one accumulation step (``microbatches``
micro-batches stacked on dimension 0), runs forward and backward per micro-batch, reduces the
gradients the plan reduces every accumulation step, and returns a skipped receipt until the
accumulation window closes; then it runs the per-step reductions, the optimizer step and the
distributed optimizer's gathers, and returns the step's receipt with the collective bytes observed
and the global example and token counts all-reduced over the data-parallel group.
"""

from __future__ import annotations

import datetime
import errno
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from mixle_compile.contracts import TORCH_CAPABILITIES, ContractError, ParallelPlan, StepReceipt
from mixle_compile.plan.document import PlanDocument
from mixle_compile.runtime.collectives import Collectives, Ledger
from mixle_compile.runtime.errors import CollectiveFailed, RuntimeRefusal
from mixle_compile.runtime.instructions import Instructions, read_instructions
from mixle_compile.runtime.launch import RENDEZVOUS_ENV, rendezvous_timeout
from mixle_compile.runtime.mesh import Mesh
from mixle_compile.runtime.model import TransformerShape, default_loss, module_loss, transformer_loss
from mixle_compile.runtime.ops import ParallelOps
from mixle_compile.runtime.parameters import ParamStore
from mixle_compile.runtime.tensor_parallel import TensorParallel

DEFAULT_TIMEOUT_S = 60.0
DATA_GROUP = "dp_replicate+dp_shard"


def fsdp_units(instructions: Instructions) -> dict[str, tuple[str, ...]]:
    """The units FSDP gathers together: the embedding, each transformer block (a multi-token prediction
    depth's ``layers.{i}`` too), the head (the final norm, the output head and multi-token prediction's
    copy of the embedding, ``mtp_embed.weight``, which every depth reads inside it), or the whole module."""
    units: dict[str, list[str]] = {}
    for p in instructions.params:
        if instructions.family != "transformer":
            unit = "module"
        elif p.layer is not None:
            unit = f"layers.{p.layer}"
        elif p.name.startswith(("embed.", "pos_embed.")):
            unit = "embed"
        else:
            unit = "head"
        units.setdefault(unit, []).append(p.name)
    order = [
        "embed",
        *sorted((u for u in units if u.startswith("layers.")), key=lambda u: int(u.split(".")[1])),
        "head",
        "module",
    ]
    return {u: tuple(units[u]) for u in order if u in units}


def make_optimizer(name: str, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The spec's optimizer with torch's defaults (AdamW: betas 0.9/0.999, eps 1e-8, weight decay 0.01)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise RuntimeRefusal(f"optimizer {name!r} is not executed by the torch runtime; use sgd, adam or adamw")


def micro_batches(inputs, targets, microbatches: int) -> list[tuple]:
    """A batch's (inputs, targets) split into ``microbatches`` equal micro-batches, refusing a batch
    that does not split or whose targets do not pair one row with each input example."""
    if inputs.shape[0] % microbatches:
        raise ValueError(
            f"a batch of {inputs.shape[0]} examples does not split into microbatches={microbatches} equal micro-batches"
        )
    if targets.shape[:1] != inputs.shape[:1]:
        raise ValueError(
            f"the batch has {inputs.shape[0]} input examples but {targets.shape[0] if targets.dim() else 0} "
            "target rows; give one target row per input example"
        )
    return list(zip(inputs.chunk(microbatches), targets.chunk(microbatches), strict=True))


class DistributedSession:
    """A model being trained under one plan on this rank (see the module docstring)."""

    capabilities = TORCH_CAPABILITIES

    def __init__(
        self,
        instructions: Instructions,
        mesh: Mesh,
        *,
        device: torch.device,
        module: torch.nn.Module | None = None,
        loss_fn: Callable | None = None,
        values: Mapping[str, torch.Tensor] | None = None,
        recorder=None,
        owns_process_group: bool = False,
    ) -> None:
        self.instructions = instructions
        self.plan: ParallelPlan = instructions.plan
        self.mesh = mesh
        self.device = device
        self.ledger = Ledger(instructions.collectives)
        self.comm = Collectives(mesh, self.ledger, device)
        self.recorder = recorder
        store_capture = recorder.capture if recorder is not None else None
        self.store = ParamStore(
            instructions,
            mesh,
            self.comm,
            device=device,
            values=values,
            capture=store_capture,
            units=fsdp_units(instructions),
        )
        self.tp = TensorParallel(
            self.comm,
            mesh.degree("tp"),
            mesh.coord("tp"),
            instructions.sequence_parallel,
            capture=self._capture_activation if recorder is not None else None,
        )
        self.ops = ParallelOps(self.store, self.tp)
        self.optimizer = make_optimizer(instructions.optimizer, self.store.masters(), instructions.learning_rate)
        self.module = module
        self.loss_fn = loss_fn or default_loss
        self._names = tuple(p.name for p in instructions.params)
        self._shape = TransformerShape.from_spec(instructions.spec) if instructions.family == "transformer" else None
        self._owns_process_group = owns_process_group
        self.step = 0
        self.discarded_windows = 0
        self.partial_windows = 0
        self._closed = False
        self._new_window()

    # -- the protocol --------------------------------------------------------------------

    def train_batch(self, inputs, targets) -> StepReceipt:
        if self._closed:
            raise RuntimeError("this session is closed")
        plan = self.plan
        inputs, targets = torch.as_tensor(inputs, device=self.device), torch.as_tensor(targets, device=self.device)
        batches = micro_batches(inputs, targets, plan.microbatches)
        scale = 1.0 / (plan.microbatches * plan.gradient_accumulation_steps)
        accumulation = self._accumulated
        for micro, (x, y) in enumerate(batches):
            self._set_context(accumulation, micro)
            with self.store.saved_tensor_hooks():
                loss = self._micro_loss(x, y)
            last = micro == plan.microbatches - 1
            self.store.closing_accumulation = last
            self.store.closing_step = last and accumulation == plan.gradient_accumulation_steps - 1
            (loss * scale).backward()
            self.store.end_micro_batch()
            self._loss_sum += float(loss.detach()) * scale
        self._examples += int(inputs.shape[0])
        self._tokens += _token_count(inputs, targets)
        if plan.gradient_accumulation_steps > 1:
            self._set_context(accumulation, None)
            self.store.reduce_gradients(every_accumulation=True, accumulations=(accumulation,))
        self._accumulated += 1
        if self._accumulated == plan.gradient_accumulation_steps:
            return self._close_window()
        return self._receipt(loss=None, skipped=True, collective_bytes=0, counts=None)

    def finish_accumulation(self) -> StepReceipt | None:
        """Close a partly filled window now (its gradients are the mean over the examples seen)."""
        if self._accumulated == 0:
            return None
        self.partial_windows += 1
        return self._close_window()

    def discard_accumulation(self) -> None:
        self.store.discard()
        self.ledger.discard_window()
        if self._accumulated:
            self.discarded_windows += 1
        self._new_window()

    def close(self) -> None:
        """Release the session (collective: every rank calls it). A process group that ``prepare``
        created is destroyed, by every rank at the same time."""
        if self._closed:
            return
        self._closed = True
        self.store.discard()
        if self._owns_process_group and dist.is_initialized():
            self.comm.barrier("close")
            dist.destroy_process_group()
            self.mesh.release()

    # -- library extras ------------------------------------------------------------------

    @property
    def data_rank(self) -> int:
        """Which slice of the global batch this rank trains on (0 .. data_parallel_size - 1)."""
        return self.mesh.data_rank

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.data_parallel_size

    def parameters_global(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole tensor (gathered on every rank: bookkeeping collectives)."""
        from mixle_compile.runtime.reference import assemble_global

        return assemble_global(self)

    def save_checkpoint(self, root: str | Path, *, extra: Mapping | None = None) -> Path:
        """Save parameters, optimizer state, step and RNG state into ``root/step-NNNNNNNN`` (collective:
        every rank calls it; refused while an accumulation window is open). See docs/checkpoints.md."""
        from mixle_compile.runtime.checkpoint_dcp import save_session

        return save_session(self, root, extra=extra)

    def load_checkpoint(self, path: str | Path) -> dict:
        """Load a checkpoint (a step directory, or a root: its latest complete one) saved on any mesh of
        the same model into this session's layout (collective). Returns its manifest; ``step`` follows it."""
        from mixle_compile.runtime.checkpoint_dcp import load_session

        return load_session(self, path)

    # -- internals -----------------------------------------------------------------------

    def _micro_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self._shape is not None:
            return transformer_loss(self.ops, self._shape, x, y)
        return module_loss(self.ops, self.module, self._names, self.loss_fn, x, y)

    def _set_context(self, accumulation, micro) -> None:
        if self.recorder is not None:
            self.recorder.context = (self.step, accumulation, micro)

    def _capture_activation(self, node_id: str, tensor: torch.Tensor, seq_sharded: bool) -> None:
        slices = ()
        if seq_sharded:
            n, r = tensor.shape[0], self.tp.rank
            slices = ((0, r * n, (r + 1) * n),)
        self.recorder.capture(node_id, tensor, ("act", node_id, self.mesh.data_rank, slices))

    def _new_window(self) -> None:
        self._accumulated = 0
        self._loss_sum = 0.0
        self._examples = 0
        self._tokens = 0
        self.ledger.begin_window()

    def _close_window(self) -> StepReceipt:
        plan = self.plan
        window = self._accumulated
        self._set_context(None, None)
        self.store.reduce_gradients(every_accumulation=False, accumulations=tuple(range(window)))
        if window < plan.gradient_accumulation_steps:
            # The per-micro-batch losses were scaled for a full window: rescale to the mean over this one.
            factor = plan.gradient_accumulation_steps / window
            self._loss_sum *= factor
            for p in self.store.masters():
                if p.grad is not None:
                    p.grad.mul_(factor)
        # The receipt's global counts travel while the optimizer steps.
        counts = torch.tensor(
            [self._loss_sum, float(self._examples), float(self._tokens)], dtype=torch.float64, device=self.device
        )
        pending = self.comm.bookkeeping_all_reduce(counts, rule=DATA_GROUP, name="receipt:global-counts", async_op=True)
        self.optimizer.step()
        self.store.zero_grad()
        self.store.after_optimizer_step()
        pending.wait()
        receipt = self._receipt(
            loss=float(counts[0]) / self.mesh.data_parallel_size,
            skipped=False,
            collective_bytes=self.ledger.take_window_bytes(),
            counts=(int(round(float(counts[1]))), int(round(float(counts[2])))),
        )
        self.step += 1
        self._new_window()
        return receipt

    def _receipt(self, *, loss, skipped: bool, collective_bytes: int, counts) -> StepReceipt:
        return StepReceipt(
            step=self.step,
            loss=loss,
            local_examples=self._examples,
            local_tokens=self._tokens,
            microbatches=self.plan.microbatches,
            accumulation_steps=max(1, self._accumulated),
            data_parallel_size=self.plan.data_parallel_size,
            optimizer=self.instructions.optimizer,
            precision=self.instructions.precision,
            collective_bytes=collective_bytes,
            skipped=skipped,
            extra={"rank": self.mesh.rank, "collective_calls": self.ledger.calls},
            global_examples_observed=None if counts is None else counts[0],
            global_tokens_observed=None if counts is None else counts[1],
        )


def _token_count(inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Tokens of a batch: its integer targets (one per predicted token), else one per example."""
    if not targets.dtype.is_floating_point and not targets.dtype.is_complex:
        return int(targets.numel())
    return int(inputs.shape[0])


# ---------------------------------------------------------------------------
# prepare: the library entry point (the `torch` backend calls it)
# ---------------------------------------------------------------------------


def load_document(document) -> PlanDocument:
    """A PlanDocument from a document, a plan.json path or a spec file path (compiled here)."""
    if isinstance(document, PlanDocument):
        return document
    if isinstance(document, (str, Path)):
        from mixle_compile.runtime.launch import load_plan_or_spec

        return load_plan_or_spec(document)
    raise RuntimeRefusal(
        "the torch runtime replays a compiled plan: pass document=PlanDocument (or the path of a plan.json or "
        "spec file) "
        "to prepare(), e.g. backend.prepare(module, plan=plan, document='plan.json')"
    )


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def join_process_group(world_size: int) -> bool:
    """Initialise the default process group from the environment unless one exists; True if it did."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if world_size != 1:
            raise RuntimeRefusal(
                f"the plan needs {world_size} ranks but no process group exists: launch with torchrun "
                f"(--nproc-per-node {world_size}) or call torch.distributed.init_process_group first"
            )
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        return True
    seconds = rendezvous_timeout()
    timeout = datetime.timedelta(seconds=seconds)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts the store
            dist.init_process_group(backend, timeout=timeout)
        else:
            store = rendezvous_store(
                os.environ.get("MASTER_ADDR", "127.0.0.1"),
                int(os.environ.get("MASTER_PORT", "29500")),
                rank,
                world,
                timeout,
            )
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    except (RuntimeError, OSError, ValueError) as exc:  # DistStoreError and DistNetworkError are RuntimeErrors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "Address already in use" in str(exc) or getattr(exc, "errno", None) == errno.EADDRINUSE:
            raise RuntimeRefusal(
                f"rank {rank}: MASTER_PORT={os.environ.get('MASTER_PORT')} on "
                f"{os.environ.get('MASTER_ADDR', '127.0.0.1')} is already in use "
                "by another process, so the rendezvous cannot listen there; choose a free port (torchrun "
                "--master-port) or stop what holds it"
            ) from None
        raise CollectiveFailed(
            f"rank {rank}: the process group of {world} ranks did not form within {seconds:g} s (a rank "
            "missing, stopped or "
            f"unreachable at MASTER_ADDR:MASTER_PORT; {RENDEZVOUS_ENV} sets this limit): {first}",
            node_id="rendezvous",
            rule="world",
            ranks=tuple(range(world)),
            timed_out=True,
        ) from None
    return True


_LISTENERS: list = []  # the rendezvous store's listening sockets, kept open for the store's life


def is_local_address(addr: str) -> bool:
    """Whether ``addr`` names this machine's loopback (a single-node launch)."""
    import ipaddress
    import socket

    if addr in ("localhost", ""):
        return True
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(addr, None))
    except (OSError, ValueError):
        return False


def rendezvous_store(addr: str, port: int, rank: int, world: int, timeout: datetime.timedelta):
    """The TCP store the ranks meet at. Rank 0 hosts it, listening on the loopback address when
    ``addr`` is a loopback one (a single-node launch: nothing else on the network can reach it), on
    every interface otherwise (``MASTER_ADDR`` another machine reaches, a multi-node launch)."""
    import socket

    if rank != 0:
        return dist.TCPStore(addr, port, world, False, timeout)
    if not is_local_address(addr):
        return dist.TCPStore(addr, port, world, True, timeout, wait_for_workers=False)
    family, _, _, _, sockaddr = socket.getaddrinfo(addr or "127.0.0.1", port, type=socket.SOCK_STREAM)[0]
    listener = socket.create_server(sockaddr[:2], family=family, backlog=max(128, world))
    _LISTENERS.append(listener)
    return dist.TCPStore(addr, port, world, True, timeout, wait_for_workers=False, master_listen_fd=listener.fileno())


def open_session(
    doc: PlanDocument,
    *,
    module: torch.nn.Module | None = None,
    loss_fn: Callable | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    recorder=None,
    values: Mapping[str, torch.Tensor] | None = None,
) -> DistributedSession:
    instructions = read_instructions(doc)
    if instructions.plan.pp > 1:
        raise RuntimeRefusal(
            f"a pipelined plan (pp={instructions.plan.pp}) runs its stage programs through `run` (python -m "
            "mixle_compile.runtime "
            "PLAN); the library session trains the whole model on every rank, so it takes plans with pp: 1"
        )
    owns = join_process_group(instructions.plan.world_size)
    world = dist.get_world_size()
    try:
        instructions.plan.validate_world_size(world)
    except ContractError as exc:
        raise RuntimeRefusal(
            f"{exc}; refusing to start, because ranks beyond the plan would train independent copies of the model. "
            f"Start exactly {instructions.plan.world_size} processes"
        ) from None
    device = device_for_rank()
    mesh = Mesh.create(doc.groups, timeout_s=timeout_s)
    if instructions.family == "modules":
        if module is None:
            raise RuntimeRefusal("a `modules` plan trains your nn.Module: pass it to prepare(module, ...)")
        values = _module_values(module, instructions)
    elif module is not None:
        raise RuntimeRefusal("a `transformer` plan materialises its own model from the spec; call prepare(None, ...)")
    session = DistributedSession(
        instructions,
        mesh,
        device=device,
        module=module,
        loss_fn=loss_fn,
        values=values,
        recorder=recorder,
        owns_process_group=owns,
    )
    if instructions.family == "modules" and world > 1:
        # Every rank must start from the same values: rank 0's, once, as bookkeeping.
        _broadcast_start(session, values)
    return session


def _module_values(module: torch.nn.Module, instructions: Instructions) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters(remove_duplicate=False))
    planned = {p.name: p.global_shape for p in instructions.params}
    missing = sorted(set(planned) - set(named))
    extra = sorted(set(named) - set(planned))
    wrong = sorted(n for n in set(planned) & set(named) if tuple(named[n].shape) != planned[n])
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"the spec lists {', '.join(missing)}, which the module does not have")
        if extra:
            parts.append(f"the module has {', '.join(extra)}, which the spec does not list")
        if wrong:
            parts.append(
                "shapes differ for "
                + ", ".join(f"{n} (module {list(named[n].shape)}, spec {list(planned[n])})" for n in wrong)
            )
        raise RuntimeRefusal("the module's parameters do not match the plan: " + "; ".join(parts))
    return {name: named[name].detach().float().cpu() for name in planned}


def _broadcast_start(session: DistributedSession, values) -> None:
    from mixle_compile.runtime.parameters import LocalParameter

    for local in session.store.params.values():
        whole = values[local.instr.name].clone().to(session.device)
        session.comm.bookkeeping_broadcast(whole, name="prepare:start-values")
        rebuilt = LocalParameter(local.instr, local.uses, whole.cpu(), session.mesh, session.device)
        with torch.no_grad():
            local.master.copy_(rebuilt.master)
            if local.compute is not None:
                local.compute.copy_(rebuilt.compute)


def prepare(
    module,
    *,
    plan: ParallelPlan,
    document=None,
    precision: str | None = None,
    loss_fn: Callable | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **options,
) -> DistributedSession:
    """Prepare ``module`` for training under ``plan`` (the `torch` backend's entry point).

    ``document`` is the compiled plan (a PlanDocument, or the path of a plan.json or spec file) whose
    updates are replayed; ``plan`` must be its ParallelPlan. ``module`` is your nn.Module for a
    `modules` plan (its parameter names and shapes must match the spec) and None for a `transformer`
    plan. ``loss_fn(outputs, targets)`` defaults to cross entropy for integer targets. Collectives
    time out after ``timeout_s`` seconds, so a dead or stalled rank fails the step instead of hanging.
    """
    if options:
        raise TypeError(f"prepare() got unknown options: {', '.join(sorted(options))}")
    doc = load_document(document)
    instructions = read_instructions(doc)
    if plan != instructions.plan:
        raise RuntimeRefusal(
            f"prepare(plan=...) is {plan.factorisation()}, but the plan document says "
            f"{instructions.plan.factorisation()}"
        )
    if precision is not None and precision != instructions.precision:
        raise RuntimeRefusal(
            f"precision {precision!r} differs from the plan's training.precision {instructions.precision!r}; "
            "recompile the spec"
        )
    return open_session(doc, module=module, loss_fn=loss_fn, timeout_s=timeout_s)
