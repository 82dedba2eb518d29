"""`run`: compile or load a plan, refuse what cannot run, start the ranks, watch them, report.

Torch-free at import: a plan is refused (unverified, tampered with, a world-size mismatch, an axis
this runtime does not execute) before torch is loaded or any process starts.

Two ways to run:

- local: ``run_plan`` starts ``world_size`` worker processes on this machine (gloo on CPU, nccl
  when CUDA is present) and watches them. When one fails, the others get a short grace period to
  fail on their own (a dead peer breaks their collectives at once; a stalled one makes them time
  out after ``timeout_s``), then every survivor is stopped and ``RunFailed`` names the rank that
  died or stalled;
- torchrun: when ``RANK`` and ``WORLD_SIZE`` are set, this process is one rank of a group started
  by torchrun (multi-node runs are torchrun's job); it joins that group and runs its rank in-process.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from mixle_compile.plan import PlanDocument, load_plan_text
from mixle_compile.plan.artifact import PlanError, written_text
from mixle_compile.plan.rederive import PlanMismatch, rederive
from mixle_compile.runtime.em.plan import is_distribution, read_em_instructions
from mixle_compile.runtime.errors import RunFailed, RuntimeRefusal, SpecRejected
from mixle_compile.runtime.instructions import read_instructions
from mixle_compile.runtime.report import REPORT_FILE, RunReport

DEFAULT_TIMEOUT_S = 60.0
LAUNCHER_ENV = "MIXLE_LAUNCHER_PID"  # the local launcher's pid, for its ranks (worker.die_with_launcher)
FAILURE_GRACE_S = 3.0  # after the first failure, how long the others may take to fail by themselves
RENDEZVOUS_TIMEOUT_S = 60.0  # how long joining the process group waits for every rank, unless RENDEZVOUS_ENV says
RENDEZVOUS_ENV = "MIXLE_RENDEZVOUS_TIMEOUT"
SPEC_SUFFIXES = (".yaml", ".yml")


def load_plan_or_spec(path: str | Path) -> PlanDocument:
    """A verified plan from a plan.json, or compiled from a spec file (refused when it has errors)."""
    path = Path(path)
    if _is_spec_path(path):
        return compile_spec_file(path)
    try:
        return load_plan_text(path.read_bytes(), str(path))
    except OSError as exc:
        raise RuntimeRefusal(f"cannot read {path}: {exc.strerror or exc}") from None
    except PlanError as exc:
        raise RuntimeRefusal(str(exc)) from None


def _is_spec_path(path: Path) -> bool:
    return path.suffix in SPEC_SUFFIXES or (path.suffix == ".json" and _looks_like_spec(path))


def _looks_like_spec(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "format_version" not in data and "model" in data


def compile_spec_file(path: Path) -> PlanDocument:
    """The same pass as `mixle-compile compile`: a spec the verifier rejects never reaches the ranks."""
    from mixle_compile.compile import CompilerBug, compile_file

    try:
        result = compile_file(path)
    except CompilerBug as exc:
        raise RuntimeRefusal(f"{path}: the compiler failed its own checks ({exc}); nothing is run") from None
    if result.plan is None:
        errors = [d for d in result.check.diagnostics if d.severity.value == "error"]
        shown = "\n".join(d.text() for d in errors[:5])
        refusal = RuntimeRefusal if result.check.unreadable else SpecRejected
        raise refusal(f"{path} does not check cleanly, so it is not run:\n{shown}")
    return load_plan_text(result.text, str(path))


def preflight(doc: PlanDocument):
    """The plan read as instructions for the runtime that `run` starts (EM, or the neural replay with
    or without a pipeline), refusing what that runtime does not execute; nothing is started."""
    if is_distribution(doc):
        return read_em_instructions(doc)  # EM (runtime/em/fit.py); refuses what it does not execute
    instructions = read_instructions(doc)
    if instructions.family != "transformer":
        raise RuntimeRefusal(
            "a `modules` plan describes the parameters of your own nn.Module, which `run` cannot build; train it "
            "with the library API instead: get_training_backend('torch').prepare(module, plan=..., document=...) "
            "(see docs/runtime.md)"
        )
    if instructions.plan.pp > 1:
        from mixle_compile.runtime.pipeline_plan import check_pipeline

        check_pipeline(doc, instructions)  # what the pipeline runtime does not execute, before anything starts
    return instructions


def _preflight_tokens(instructions, data_path, *, repeat_data: bool) -> None:
    """Read the token file on the launcher, before any rank starts: format, vocabulary, and at least
    one global batch of distinct samples unless ``repeat_data`` allows reusing them."""
    from mixle_compile.runtime.worker import batch_layout, token_source

    source = token_source(instructions, str(data_path))
    needed = batch_layout(instructions).global_batch
    if source.distinct_samples < needed and not repeat_data:
        raise RuntimeRefusal(
            f"{data_path} holds {source.distinct_samples} distinct samples of seq_len {instructions.seq_len} "
            "tokens, fewer "
            f"than one global batch of {needed}: every step would repeat samples; use more data, or "
            "--repeat-data to allow it"
        )


def rendezvous_timeout() -> float:
    """Seconds the rendezvous waits for every rank: ``MIXLE_RENDEZVOUS_TIMEOUT``, else RENDEZVOUS_TIMEOUT_S."""
    text = os.environ.get(RENDEZVOUS_ENV)
    if text is None:
        return RENDEZVOUS_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise RuntimeRefusal(f"{RENDEZVOUS_ENV}={text!r} must be a positive, finite number of seconds")
    return value


def torchrun_environment() -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` of a process started by torchrun (or by hand with its variables),
    refusing inconsistent ones, naming the variable: a non-integer, RANK outside 0..WORLD_SIZE-1,
    LOCAL_RANK outside 0..LOCAL_WORLD_SIZE-1 or above RANK, LOCAL_WORLD_SIZE above WORLD_SIZE, a
    MASTER_PORT outside 1..65535, an empty MASTER_ADDR, or (outside torchrun) no MASTER_ADDR or MASTER_PORT."""
    env = os.environ

    def integer(name: str, low: int, high: int | None = None) -> int | None:
        text = env.get(name)
        if text is None:
            return None
        try:
            value = int(text.strip())
        except ValueError:
            raise RuntimeRefusal(
                f"{name}={text!r} is not an integer; torchrun sets it (check the environment this rank was "
                "started with)"
            ) from None
        if value < low or (high is not None and value > high):
            span = f"{low}..{high}" if high is not None else f"at least {low}"
            raise RuntimeRefusal(
                f"{name}={value} is out of range ({span}); the ranks' environment is inconsistent, so nothing "
                "is started"
            )
        return value

    world = integer("WORLD_SIZE", 1)
    rank = integer("RANK", 0)
    if rank >= world:
        raise RuntimeRefusal(
            f"RANK={rank} is outside WORLD_SIZE={world} (ranks are 0..{world - 1}); the ranks' environment is "
            "inconsistent"
        )
    local_world = integer("LOCAL_WORLD_SIZE", 1)
    if local_world is not None and local_world > world:
        raise RuntimeRefusal(
            f"LOCAL_WORLD_SIZE={local_world} is above WORLD_SIZE={world}; a node cannot hold more ranks than the job"
        )
    local = integer("LOCAL_RANK", 0)
    if local is not None and local_world is not None and local >= local_world:
        raise RuntimeRefusal(
            f"LOCAL_RANK={local} is outside LOCAL_WORLD_SIZE={local_world} (local ranks are 0..{local_world - 1})"
        )
    if local is not None and local > rank:
        raise RuntimeRefusal(
            f"LOCAL_RANK={local} is above RANK={rank}; a rank's local index on its node cannot exceed its global one"
        )
    integer("MASTER_PORT", 1, 65535)
    if "MASTER_ADDR" in env and not env["MASTER_ADDR"].strip():
        raise RuntimeRefusal(
            "MASTER_ADDR is empty; set it to the address of rank 0's machine (127.0.0.1 on one machine)"
        )
    return rank, world


def require_rendezvous_address() -> None:
    """Outside torchrun's own store the ranks meet at MASTER_ADDR:MASTER_PORT: both must be set."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise RuntimeRefusal(
                    f"{name} is not set, but RANK and WORLD_SIZE are: rank 0 hosts the rendezvous at "
                    "MASTER_ADDR:MASTER_PORT; "
                    "set both (or launch with torchrun, which sets them)"
                )


OUTPUT_FILES = ("plan.json", "report.json", "receipts.jsonl")
OUTPUT_DIRS = ("logs", "errors", "evidence")


def prepare_out(out: Path) -> None:
    """Make ``out`` safe to write into: a symbolic link where a run writes a file or a directory of
    its own (report, receipts, logs, error notes, evidence) is removed, never written through, so
    what it points to is left untouched."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in OUTPUT_FILES:
            if (out / name).is_symlink():
                (out / name).unlink(missing_ok=True)
        for name in OUTPUT_DIRS:
            d = out / name
            if d.is_symlink():
                d.unlink(missing_ok=True)
            elif d.is_dir():
                for entry in d.iterdir():
                    if entry.is_symlink():
                        entry.unlink(missing_ok=True)
    except OSError as exc:
        raise RuntimeRefusal(f"cannot prepare the output directory {out}: {exc.strerror or exc}") from None


def _check_options(
    *, timeout_s: float, steps: int | None, save_every: int | None, keep_checkpoints: int | None
) -> None:
    """Refuse options no run can use before any rank starts (they used to fail inside the ranks)."""
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise RuntimeRefusal(f"timeout must be a positive, finite number of seconds, got {timeout_s!r}")
    for name, value in (("steps", steps), ("save_every", save_every), ("keep_checkpoints", keep_checkpoints)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RuntimeRefusal(f"{name} must be a whole number of at least 1, got {value!r}")


def run_plan(
    plan: PlanDocument | str | Path,
    *,
    steps: int | None = None,
    out_dir: str | Path | None = None,
    reference: bool = False,
    data_path: str | Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: bool = True,
    save_every: int | None = None,
    checkpoint_dir: str | Path | None = None,
    keep_checkpoints: int | None = None,
    resume: str | Path | None = None,
    repeat_data: bool = False,
    overwrite_checkpoints: bool = False,
) -> RunReport:
    """Replay a plan on real process groups and return its report (also written to ``out_dir``).

    ``plan``: a PlanDocument, a plan.json, or a spec file (compiled first). ``steps`` defaults to the
    spec's ``training.steps``; ``reference`` also trains in one process and fills every update's
    numerical evidence; ``data_path`` is a token file (default: seeded synthetic tokens);
    ``out_dir`` receives ``receipts.jsonl``, ``report.json`` and per-rank logs (default: a new
    temporary directory). Raises RuntimeRefusal before starting anything it cannot run, and
    RunFailed (naming the rank) when a rank dies, raises or stalls.

    Checkpoints (docs/checkpoints.md): ``save_every`` N saves every N steps and at the end into
    ``checkpoint_dir`` (default ``out_dir/checkpoints``), keeping the ``keep_checkpoints`` newest
    (default all). ``resume`` is a checkpoint root (its latest complete checkpoint) or one step
    directory; the plan may have another mesh. ``steps`` then counts from 0: a run resumed at step k
    runs steps k .. steps - 1. Committed checkpoints in the root at steps after the one resumed
    from (after 0 for a fresh run), which this run would replace, are refused unless
    ``overwrite_checkpoints``.
    """
    _check_options(timeout_s=timeout_s, steps=steps, save_every=save_every, keep_checkpoints=keep_checkpoints)
    doc = plan if isinstance(plan, PlanDocument) else load_plan_or_spec(plan)
    if not (isinstance(plan, (str, Path)) and _is_spec_path(Path(plan))):  # a spec was compiled here, just now
        try:
            rederive(doc)
        except PlanMismatch as exc:
            raise RuntimeRefusal(str(exc)) from None
    instructions = preflight(doc)
    steps = instructions.steps if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise RuntimeRefusal(f"steps must be a positive integer, got {steps!r}")
    if data_path is not None and not Path(data_path).is_file():
        raise RuntimeRefusal(f"token file {data_path} does not exist")
    if data_path is not None and not is_distribution(doc):
        _preflight_tokens(instructions, data_path, repeat_data=repeat_data)
    checkpoints = _checkpoint_options(
        doc,
        instructions,
        steps=steps,
        reference=reference,
        data_path=data_path,
        save_every=save_every,
        checkpoint_dir=checkpoint_dir,
        keep=keep_checkpoints,
        resume=resume,
    )
    world = instructions.plan.world_size
    joined = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rendezvous_timeout()  # a bad MIXLE_RENDEZVOUS_TIMEOUT is refused here, not in the ranks
    if joined:
        rank, actual = torchrun_environment()
        if actual != world:
            raise RuntimeRefusal(
                f"the plan's world size is {world} ({instructions.plan.factorisation()}) but this job has "
                f"WORLD_SIZE={actual}; extra or missing ranks would train independent copies, so it does not start"
            )
        require_rendezvous_address()
    else:
        _refuse_oversized(doc, world)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="mixle-run-"))
    if checkpoints.every is not None and checkpoints.root is None:
        checkpoints = replace(checkpoints, root=out / "checkpoints")
    root = checkpoints.root
    if root is not None and Path(root).is_symlink():
        raise RuntimeRefusal(
            f"the checkpoint directory {root} is a symbolic link (to {os.readlink(root)}); checkpoints are "
            "never written "
            "through a link: pass the directory it points to as --checkpoint-dir"
        )
    prepare_out(out)
    from mixle_compile.runtime import checkpoint as ckpt

    checkpoints = replace(checkpoints, run_id=ckpt.new_run_id())
    lock = None
    if checkpoints.every is not None and (
        not joined or rank == 0
    ):  # one process per job writes the root: it holds the lock
        checkpoints, lock = _lock_root(checkpoints, steps=steps, overwrite=overwrite_checkpoints)
    try:
        if joined:
            return _run_joined(
                doc,
                steps=steps,
                out=out,
                reference=reference,
                data_path=data_path,
                timeout_s=timeout_s,
                progress=progress,
                checkpoints=checkpoints,
            )
        return _run_local(
            doc,
            world,
            steps=steps,
            out=out,
            reference=reference,
            data_path=data_path,
            timeout_s=timeout_s,
            progress=progress,
            checkpoints=checkpoints,
        )
    finally:
        ckpt.unlock_root(lock)


def _lock_root(checkpoints, *, steps: int, overwrite: bool):
    """Take the lock of the checkpoint root this run saves into; return the options (their
    ``resume`` where the lock moved the step back to its name) and the lock. Refuses, unlocked
    again, a run that would replace committed checkpoints unless ``overwrite``."""
    from mixle_compile.runtime import checkpoint as ckpt

    root = checkpoints.root
    lock = ckpt.lock_root(root, checkpoints.run_id)
    resume = checkpoints.resume
    if resume is not None and not Path(resume).exists() and ckpt.step_of_dir(resume) is not None:
        # The lock finished an interrupted re-commit: the step resumed from moved back to its name.
        checkpoints = replace(checkpoints, resume=Path(resume).parent / ckpt.step_dir_name(ckpt.step_of_dir(resume)))
    if not overwrite:
        try:
            _refuse_replacing(root, checkpoints.resume, steps=steps, every=checkpoints.every)
        except BaseException:
            ckpt.unlock_root(lock)
            raise
    return checkpoints, lock


def _refuse_replacing(root, resume, *, steps: int, every: int) -> None:
    """Refuse a run that would save over committed checkpoints: the steps it saves (every
    ``every``-th and the last, as the worker does, after the one it starts from) that ``root``
    already holds, another run's or this lineage's own: either is lost if replaced."""
    from mixle_compile.runtime import checkpoint as ckpt

    start = (ckpt.step_of_dir(resume) or 0) if resume is not None else 0
    saves = {k for k in range(start + 1, steps + 1) if k % every == 0 or k == steps}
    taken = [step for step, _, complete in ckpt.list_checkpoints(root) if complete and step in saves]
    if taken:
        shown = ", ".join(str(s) for s in taken[:5]) + (f" and {len(taken) - 5} more" if len(taken) > 5 else "")
        raise RuntimeRefusal(
            f"checkpoint directory {root} already holds committed checkpoints at step(s) {shown}, which this "
            "run would save "
            f"again and so replace. Resume from the newest (--resume {root}), choose an empty "
            "--checkpoint-dir, or pass "
            "--overwrite-checkpoints to replace them"
        )


def _checkpoint_options(doc, instructions, *, steps, reference, data_path, save_every, checkpoint_dir, keep, resume):
    """Validate the checkpoint options before anything starts (a ``checkpoint.CheckpointOptions``);
    a resume is checked against the plan here."""
    from mixle_compile.runtime import checkpoint as ckpt

    if is_distribution(doc):  # EM checks its --data file and its own checkpoints (runtime/em/fit.py), torch-free
        from mixle_compile.runtime.em.fit import run_options

        return run_options(
            instructions,
            steps=steps,
            reference=reference,
            data_path=data_path,
            save_every=save_every,
            checkpoint_dir=checkpoint_dir,
            keep=keep,
            resume=resume,
        )
    options = ckpt.CheckpointOptions.checked(save_every=save_every, checkpoint_dir=checkpoint_dir, keep=keep)
    if resume is not None:
        if reference:
            raise RuntimeRefusal(
                "--reference trains the single-process reference from the initial values, so it cannot check a "
                "resumed run; drop --reference or --resume"
            )
        path = ckpt.resolve_checkpoint(resume)
        manifest = ckpt.verify_checkpoint(
            path, kind=ckpt.TORCH_KIND
        )  # every file against its seal, before any rank starts
        try:
            ckpt.check_resume(
                manifest,
                instructions,
                data=ckpt.source_description(data_path, instructions.seed),
                steps=steps,
                path=path,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, RuntimeRefusal):
                raise
            raise RuntimeRefusal(
                f"checkpoint {path}: its manifest is malformed ({type(exc).__name__}: {exc}); it cannot be resumed"
            ) from None
        options = replace(options, resume=path.resolve())
    return options


def _run_joined(doc, *, steps, out, reference, data_path, timeout_s, progress, checkpoints) -> RunReport:
    from mixle_compile.runtime.worker import run_rank, write_failure

    rank = int(os.environ["RANK"])
    try:
        report = run_rank(
            doc,
            steps=steps,
            out_dir=out,
            reference=reference,
            data_path=str(data_path) if data_path else None,
            timeout_s=timeout_s,
            progress=progress,
            checkpoints=checkpoints,
        )
    except BaseException as exc:
        write_failure(out, rank, exc)
        raise
    if report is None:  # not rank 0: rank 0 writes the report
        return RunReport(
            ok=True,
            errors=(),
            out_dir=str(out),
            steps=steps,
            world_size=doc.groups.world_size,
            losses=(),
            wall_s=0.0,
            accounting_ok=True,
            updates_checked=0,
            collective_calls_per_rank=(),
        )
    return RunReport.from_dict(report, out)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _refuse_oversized(doc: PlanDocument, world: int) -> None:
    """A local launch puts every rank on this machine: refuse what cannot fit before starting it."""
    cores = os.cpu_count() or 1
    if world > max(8, 4 * cores):
        raise RuntimeRefusal(
            f"the plan has {world} ranks, too many to start on this machine ({cores} CPU cores); "
            "launch it on its cluster with torchrun (RANK and WORLD_SIZE set), one process per device"
        )
    memory = _machine_memory()
    per_rank = max((m.total for m in doc.memory), default=0)
    if memory is not None and per_rank * world > memory // 2:
        gib = 1 << 30
        raise RuntimeRefusal(
            f"the plan needs about {per_rank / gib:.1f} GiB per rank x {world} ranks = "
            f"{per_rank * world / gib:.1f} GiB, "
            f"more than half of this machine's {memory / gib:.1f} GiB; launch it on its cluster with torchrun"
        )


def _run_local(doc, world: int, *, steps, out, reference, data_path, timeout_s, progress, checkpoints) -> RunReport:
    plan_path = out / "plan.json"
    plan_path.write_text(written_text(doc), encoding="utf-8")
    for stale in (out / REPORT_FILE, *(out / "errors").glob("rank*.json")):
        stale.unlink(missing_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // world)
    port = _free_port()
    base_env = {
        **os.environ,
        LAUNCHER_ENV: str(os.getpid()),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": str(threads),
    }
    command = [
        sys.executable,
        "-m",
        "mixle_compile.runtime.worker",
        "--plan",
        str(plan_path),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--timeout",
        str(timeout_s),
    ]
    if reference:
        command.append("--reference")
    if data_path is not None:
        command += ["--data", str(Path(data_path).resolve())]
    command += checkpoints.worker_arguments()
    procs = []
    files = []
    previous = _stop_on_sigterm()
    try:
        for rank in range(world):
            env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            log = (logs / f"rank{rank}.log").open("w", encoding="utf-8")
            files.append(log)
            show = progress and rank == 0
            procs.append(
                subprocess.Popen(
                    command + (["--progress"] if show else []), env=env, stdout=log, stderr=None if show else log
                )
            )
        _watch(procs, out, timeout_s)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for f in files:
            f.close()
    if not (out / REPORT_FILE).is_file():
        raise RunFailed(f"every rank exited, but rank 0 wrote no report; see {logs}")
    return RunReport.read(out)


class Terminated(RunFailed):
    """The launcher was asked to stop (SIGTERM): its ranks are stopped with it."""


def _stop_on_sigterm():
    """While ranks run, SIGTERM to the launcher stops them too (they used to train on to the last
    step); returns the handler to restore, or None off the main thread."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise Terminated("the launcher received SIGTERM: its ranks were stopped")

    return signal.signal(signal.SIGTERM, stop)


def _watch(procs: list[subprocess.Popen], out: Path, timeout_s: float) -> None:
    first_failure = None
    order: list[int] = []  # failed ranks, in the order their failures were seen
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in order:
                order.append(rank)
        if first_failure is None and order:
            first_failure = time.monotonic()
        if all(c is not None for c in codes):
            break
        if first_failure is not None and time.monotonic() - first_failure > FAILURE_GRACE_S:
            break
        time.sleep(0.05)
    if not order:
        return
    still_running = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in still_running:
        procs[r].kill()
    raise RunFailed(
        _failure_message(procs, order, still_running, out, timeout_s), ranks=tuple(_culprits(order, still_running, out))
    )


def _failure_note(out: Path, rank: int) -> dict | None:
    path = out / "errors" / f"rank{rank}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _culprits(order, still_running, out) -> list[int]:
    notes = {r: _failure_note(out, r) for r in order}
    # A rank that died without a note (signal, os._exit) or failed outside a collective is the cause.
    direct = [r for r in order if notes[r] is None or "collective" not in notes[r]]
    if direct:
        return direct
    timed_out = [r for r in order if notes[r] and notes[r].get("timed_out")]
    if timed_out:
        waited_for = set()
        for r in timed_out:
            waited_for |= set(notes[r].get("group_ranks", ()))
        stalled = [r for r in still_running if r in waited_for]
        if stalled:
            return stalled
    return order[:1]


def _describe_exit(p: subprocess.Popen) -> str:
    code = p.returncode
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _failure_message(procs, order, still_running, out, timeout_s) -> str:
    culprits = _culprits(order, still_running, out)
    notes = {r: _failure_note(out, r) for r in order}
    lines = []
    for r in culprits:
        if r in still_running:
            waiting = sorted(
                q for q in order if notes[q] and notes[q].get("timed_out") and r in notes[q].get("group_ranks", ())
            )
            what = notes[waiting[0]].get("collective", "?") if waiting else "?"
            if what == "rendezvous":
                lines.append(
                    f"rank {r} never joined the process group: rank(s) {', '.join(map(str, waiting))} gave up "
                    "waiting for it at the "
                    f"rendezvous after {rendezvous_timeout():g} s ({RENDEZVOUS_ENV}); rank {r} was stopped"
                )
                continue
            lines.append(
                f"rank {r} stalled: rank(s) {', '.join(map(str, waiting))} timed out after {timeout_s:g} s "
                "waiting for it "
                f"in {what!r} (group {notes[waiting[0]].get('group', '?') if waiting else '?'}); rank {r} was stopped"
            )
        elif notes.get(r) is None:
            lines.append(f"rank {r} died ({_describe_exit(procs[r])}) without reporting an error")
        else:
            lines.append(f"rank {r} failed: {notes[r]['error']}")
    others = sorted(q for q in order if q not in culprits)
    if others:
        lines.append(f"then rank(s) {', '.join(map(str, others))} stopped because their collectives could not complete")
    stopped = [q for q in still_running if q not in culprits]
    if stopped:
        lines.append(f"rank(s) {', '.join(map(str, stopped))} were stopped")
    lines.append(f"logs: {out / 'logs'}")
    return "\n".join(lines)
