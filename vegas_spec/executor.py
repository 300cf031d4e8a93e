"""Tensor-parallel execution with one scheduler: rank 0 runs the engine, ranks 1..N-1 run
the same model runner calls on their shards.

`launch(N, device)` makes this process rank 0 of N: it starts N - 1 worker processes
(`python -m vegas_spec.worker`, or takes torchrun's ranks), joins the group (gloo on CPU,
NCCL on CUDA, with a gloo group of its own for control messages) and watches the workers.
An engine built while a launch is active gets a `ParallelRunner`, a `step.Runner` like the
`ModelRunner` (no proxy: it has the interface's members and nothing else): before each
runner call that touches the device rank 0 broadcasts a `Call`, a method name and plain host
arguments, and every worker makes the same call on its own `ModelRunner`, so all ranks run
the same forwards on the same shapes and meet in the same collectives. A step is one call,
`execute` with the scheduler's `StepPlan` (request ids, token ids, page ids, sampling
settings: everything a rank needs), so workers hold no sequences and replay nothing; the
other calls are the settings and warm-ups, `drop` (rows that leave between steps), `clear`
and the logits helpers. The interface's facts (model config, KV pages, buffer capacity)
and the phase timer are read from rank 0's own runner, with no message. Each rank's runner
returns the same `StepResult` (the logits are equal on every rank); rank 0's engine alone
reads it. Unseeded sampling gets a seed from rank 0 in the plan, so every rank draws the
same tokens.

A worker that dies is an `ExecutorError` naming its rank and exit code in rank 0 (its next
collective fails, or, should it block, a watcher thread ends the process); a worker whose
rank 0 dies fails its next receive and exits. World size 1 never comes here: the engine
uses its `ModelRunner` directly. Imports `config`, `parallel`, `models.loader`, `pages`,
`stats`, `step` and `model_runner`."""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from vegas_spec import parallel
from vegas_spec.config import ConfigError, EngineConfig, ModelConfig, SpecConfig
from vegas_spec.model_runner import ModelRunner
from vegas_spec.models.loader import ModelSource, load_config
from vegas_spec.pages import PageAllocator
from vegas_spec.stats import PhaseTimer
from vegas_spec.step import Prefill, Runner, StepPlan, StepResult

TIMEOUT_S = 600  # a collective that waits longer fails (a rank that stopped answering)
STUCK_S = 30  # a dead worker that rank 0 has not noticed by then ends rank 0 (blocked in NCCL)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE")


class ExecutorError(RuntimeError):
    """A tensor-parallel worker died or failed: the engine cannot go on."""


@dataclass(frozen=True)
class Call:
    """One message from rank 0: `method` of engine `engine`'s runner with `args`; `freed`:
    engines rank 0 no longer holds. Methods "build" and "stop" are the workers' own."""

    engine: int
    method: str
    args: tuple = ()
    freed: tuple[int, ...] = ()


class Channel:
    """Control messages from rank 0 to every rank, over a gloo group."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def send(self, call: Call) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([call], src=0, group=self.group)

    def recv(self) -> Call:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """This process was started by torchrun (or another launcher setting RANK/WORLD_SIZE)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def check_devices(world_size: int, device: str) -> None:
    """ConfigError unless `device` has a GPU for each of world_size ranks."""
    if world_size < 1:
        raise ConfigError(f"--tensor-parallel must be at least 1, got {world_size}")
    if device == "cuda" and world_size > 1:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < world_size:
            raise ConfigError(f"tensor parallelism over {world_size} ranks on cuda needs "
                              f"{world_size} visible GPUs, found {count}")


def init_group(rank: int, world_size: int, device: str) -> Channel:
    """Join the default group as `rank` (env:// rendezvous) and this process's TP group ->
    the control channel (a gloo group beside NCCL; on CPU the gloo default group itself)."""
    import torch.distributed as dist

    os.environ.update(parallel.NO_MULTICAST)
    backend = "gloo"
    if device == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if device == "cuda":
        backend = "nccl"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    control = None if backend == "gloo" else dist.new_group(backend="gloo")
    parallel.join(world_size, rank)
    return Channel(control)


class Executor:
    """Rank 0's side: the channel, the worker processes it started (none under torchrun) and
    a watcher of them."""

    def __init__(self, world_size: int, procs: list[subprocess.Popen], channel: Channel,
                 ) -> None:
        self.world_size, self.procs, self.channel = world_size, procs, channel
        self.dead: str | None = None
        self.closed = False
        self._ids = 0
        self._freed: list[int] = []
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name="tp-worker-watch")
        if procs:
            self._watcher.start()

    def _watch(self) -> None:
        """Note the first worker that exits; end the process if rank 0 does not notice."""
        while not self.closed:
            for rank, p in enumerate(self.procs, 1):
                code = p.poll()
                if code is not None and not self.closed:
                    self.dead = f"tensor-parallel worker rank {rank} exited with code {code}"
                    self._stuck()
                    return
            time.sleep(0.05)

    def _stuck(self) -> None:
        deadline = time.monotonic() + STUCK_S
        while time.monotonic() < deadline:
            if self.closed:
                return
            time.sleep(0.1)
        print(f"vegas: error: {self.dead}; the engine stopped", file=sys.stderr, flush=True)
        os._exit(1)

    def check(self) -> None:
        """ExecutorError if a worker died."""
        if self.dead is not None:
            self.closed = True
            raise ExecutorError(f"{self.dead}; the engine stopped")

    def send(self, call: Call) -> None:
        """Broadcast call (with the engines freed since the last one); a dead worker is an
        ExecutorError naming it."""
        self.check()
        if self._freed:
            call = dataclasses.replace(call, freed=tuple(self._freed))
            self._freed.clear()
        try:
            self.channel.send(call)
        except RuntimeError as err:
            self.failed(err)

    def failed(self, err: BaseException) -> None:
        """A collective failed: the dead worker's name if one died (waiting up to a second
        for the watcher to see it), else the error as an ExecutorError."""
        deadline = time.monotonic() + 1.0
        while self.dead is None and self.procs and time.monotonic() < deadline:
            time.sleep(0.02)
        self.check()
        self.closed = True
        raise ExecutorError(f"a tensor-parallel collective failed: {err}") from err

    def new_engine(self) -> int:
        self._ids += 1
        return self._ids

    def free(self, engine: int) -> None:
        """Engine `engine` is gone in rank 0: the workers drop theirs with the next call."""
        self._freed.append(engine)

    def shutdown(self) -> None:
        """Stop the workers (they leave their loop) and leave the group."""
        import torch.distributed as dist

        if not self.closed and self.dead is None:
            try:
                self.channel.send(Call(0, "stop"))
            except RuntimeError:
                pass
        self.closed = True
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        global _active
        _active = None
        parallel.leave()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass


_active: Executor | None = None


def active() -> Executor | None:
    """The executor engines built now broadcast to (None: single process, or SPMD ranks)."""
    return _active


def spmd_group() -> parallel.TPGroup | None:
    """The tensor-parallel group where every rank runs an engine of its own (SPMD ranks:
    `parallel.join` and no launch), else None. Such engines must plan the same steps, so
    the times their plans follow (the pacer's and the adaptive controller's) are rank 0's."""
    group = parallel.current()
    return group if _active is None and group.world_size > 1 else None


def launch(world_size: int, device: str) -> Executor | None:
    """Make this process rank 0 of `world_size` ranks -> its Executor; under torchrun, a rank
    other than 0 runs the worker loop instead and gets None. World size 1 (and no torchrun
    group): None, nothing started."""
    global _active
    os.environ.update(parallel.NO_MULTICAST)  # before any process starts: children inherit
    if under_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size and not (world_size == 1 and env_world > 1):
            raise ConfigError(f"--tensor-parallel {world_size} does not match torchrun's "
                              f"WORLD_SIZE {env_world}")
        world_size = env_world
        if world_size == 1:
            return None
        check_devices(world_size, device)
        rank = int(os.environ["RANK"])
        channel = init_group(rank, world_size, device)
        if rank != 0:
            _serve_torchrun(channel, rank)
            return None
        _active = Executor(world_size, [], channel)
        return _active
    check_devices(world_size, device)
    if world_size == 1:
        return None
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world_size), "VEGAS_TP_DEVICE": device}
    procs = [subprocess.Popen([sys.executable, "-m", "vegas_spec.worker"],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(1, world_size)]
    os.environ.update({k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT")})
    try:
        channel = _init_watched(world_size, device, procs)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    _active = Executor(world_size, procs, channel)
    return _active


def _serve_torchrun(channel: Channel, rank: int) -> None:
    """A torchrun rank other than 0: the worker loop, then leave the group; rank 0 gone is
    an ExecutorError."""
    import torch.distributed as dist

    try:
        serve(channel)
    except RuntimeError as err:
        raise ExecutorError(f"tensor-parallel rank {rank}: rank 0 went away ({err})") from err
    finally:
        parallel.leave()
    dist.destroy_process_group()


def _init_watched(world_size: int, device: str, procs: list[subprocess.Popen]) -> Channel:
    """Rank 0's rendezvous, failed early (ExecutorError) if a worker exits before it ends."""
    box: dict[str, Any] = {}

    def init() -> None:
        try:
            box["channel"] = init_group(0, world_size, device)
        except BaseException as err:  # noqa: BLE001 - reported to the caller
            box["error"] = err

    t = threading.Thread(target=init, daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.05)
        for rank, p in enumerate(procs, 1):
            if p.poll() is not None:
                raise ExecutorError(f"tensor-parallel worker rank {rank} exited with code "
                                    f"{p.returncode} before joining the group")
    if "error" in box:
        raise box["error"]
    return box["channel"]


# --- rank 0: the runner that broadcasts ----------------------------------------------------

# the runner's calls that every rank makes, each with plain host arguments (a step: `execute`)
CALLS = frozenset({"execute", "drop", "clear", "reserve", "warm_prefill", "warm_rounds",
                   "set_spec", "logits", "next_token_logits"})


class ParallelRunner:
    """Rank 0's `step.Runner`: each call of `CALLS` is broadcast to the workers first, then
    made on rank 0's own `ModelRunner` (`local`); the facts and the timer are read there,
    since every rank makes the same calls. No other attribute of the local runner shows
    through."""

    def __init__(self, executor: Executor, config: EngineConfig, source: ModelSource,
                 spec: SpecConfig) -> None:
        parallel.check_divisible(load_config(source), executor.world_size)  # before loading
        self._executor, self._engine = executor, executor.new_engine()
        executor.send(Call(self._engine, "build", (config, source, spec)))
        self.local: ModelRunner = _guard(executor, lambda: ModelRunner(config, source, spec))
        _guard(executor, lambda: agree_pages(self.local, executor.channel))
        weakref.finalize(self, executor.free, self._engine)

    # --- facts, read on rank 0 ----------------------------------------------------------

    @property
    def model_config(self) -> ModelConfig:
        return self.local.model_config

    @property
    def max_model_len(self) -> int:
        return self.local.max_model_len

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def pages(self) -> PageAllocator:
        return self.local.pages

    @property
    def scratch_page(self) -> int:
        return self.local.scratch_page

    @property
    def draft_weight_bytes(self) -> int:
        return self.local.draft_weight_bytes

    @property
    def draft_weight_kind(self) -> str:
        return self.local.draft_weight_kind

    @property
    def capacity(self) -> int | None:
        return self.local.capacity

    @property
    def timer(self) -> PhaseTimer:
        return self.local.timer

    def restart_timer(self) -> PhaseTimer:
        return self.local.restart_timer()

    # --- calls every rank makes ---------------------------------------------------------

    def _run(self, method: str, *args: Any) -> Any:
        """Send `method` with its arguments to every worker, then make the call here."""
        executor: Executor = self._executor
        executor.send(Call(self._engine, method, args))
        return _guard(executor, lambda: getattr(self.local, method)(*args))

    def execute(self, plan: StepPlan) -> StepResult:
        if any(p.ends and p.params.seed is None for p in plan.prefill):
            plan = dataclasses.replace(plan, prefill=tuple(_seeded(p) for p in plan.prefill))
        return self._run("execute", plan)

    def drop(self, *request_ids: str) -> None:
        self._run("drop", *request_ids)

    def clear(self) -> None:
        self._run("clear")

    def reserve(self, rows: int) -> None:
        self._run("reserve", rows)

    def warm_prefill(self, max_pieces: int) -> int:
        return self._run("warm_prefill", max_pieces)

    def warm_rounds(self, kinds: tuple[str, ...] | None = None) -> None:
        self._run("warm_rounds", kinds)

    def set_spec(self, spec: SpecConfig) -> None:
        self._run("set_spec", spec)

    def logits(self, token_ids: list[int], pages: list[int], chunk: int) -> torch.Tensor:
        return self._run("logits", list(token_ids), list(pages), chunk)

    def next_token_logits(self, pieces: list[Prefill]) -> torch.Tensor:
        return self._run("next_token_logits", pieces)


def _seeded(piece: Prefill) -> Prefill:
    """A completing piece whose sampling has no seed, given one (every rank draws the same
    tokens)."""
    if not piece.ends or piece.params.seed is not None:
        return piece
    seed = int(torch.randint(2**62, ()).item())
    return dataclasses.replace(piece, params=dataclasses.replace(piece.params, seed=seed))


def _guard(executor: Executor, fn: Any) -> Any:
    """fn() in rank 0; a failed collective inside it becomes the dead worker's name."""
    try:
        return fn()
    except ExecutorError:
        raise
    except RuntimeError as err:
        if executor.dead is not None or _collective_error(err):
            executor.failed(err)
        raise


def _collective_error(err: RuntimeError) -> bool:
    text = str(err).lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "peer", "timed out"))


def agree_pages(runner: ModelRunner, channel: Channel) -> None:
    """Every rank's KV pool cut to the smallest rank's pages (free memory differs by rank),
    so the pages rank 0 hands out exist everywhere."""
    import torch.distributed as dist

    pages = torch.tensor([runner.cache.num_pages])
    dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=channel.group)
    runner.cache.pages.shrink(int(pages.item()))


# --- ranks 1..N-1: the worker loop -------------------------------------------------------


def serve(channel: Channel) -> None:
    """A worker rank's loop: make every call rank 0 sends until it says stop."""
    engines: dict[int, ModelRunner] = {}
    while True:
        call = channel.recv()
        for engine in call.freed:
            engines.pop(engine, None)
        if call.method == "stop":
            return
        if call.method == "build":
            runner = ModelRunner(*call.args)
            agree_pages(runner, channel)
            engines[call.engine] = runner
            continue
        if call.method not in CALLS:
            raise ExecutorError(f"unknown call {call.method!r}")
        getattr(engines[call.engine], call.method)(*call.args)


def make_runner(config: EngineConfig, source: ModelSource, spec: SpecConfig) -> Runner:
    """The engine's runner: its calls broadcast to the workers while a launch is active, else
    the `ModelRunner` itself."""
    executor = active()
    if executor is None:
        return ModelRunner(config, source, spec)
    return ParallelRunner(executor, config, source, spec)
