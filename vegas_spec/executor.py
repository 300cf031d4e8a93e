"""Tensor-parallel execution with one scheduler: rank 0 runs the engine, ranks 1..N-1 mirror
its model runner.

`launch(N, device)` makes this process rank 0 of N: it starts N - 1 worker processes
(`python -m vegas_spec.worker`, or takes torchrun's ranks), joins the group (gloo on CPU,
NCCL on CUDA, with a gloo group of its own for control messages) and watches the workers.
An engine built while a launch is active wraps its `ModelRunner` in a `RunnerProxy`: before
each runner call that touches the device (reserve, warm_prefill, warm_rounds, set_spec, start,
prefill, join, grow, decode, select, drop, clear, logits, next_token_logits) rank 0
broadcasts a `Call`, a method name and plain host arguments, and every worker makes the same
call on its own runner, so all ranks run the same forwards on the same shapes and meet in
the same collectives. A sequence is sent whole when it starts (`SeqSpec`: request id, prompt
ids, sampling, limit, headroom, pages, the positions its cached prefix covers, and a
preempted one's output so far), its new pages with each `grow`, and by request id otherwise;
workers append the tokens of their own decode outputs (equal on every rank: the logits
are), and rank 0 sends which rows finished with the `select` that drops them, so EOS, stop
strings and aborts are decided in rank 0 only. Unseeded sampling gets a seed from rank 0,
so every rank draws the same tokens.

A worker that dies is an `ExecutorError` naming its rank and exit code in rank 0 (its next
collective fails, or, should it block, a watcher thread ends the process); a worker whose
rank 0 dies fails its next receive and exits. World size 1 never comes here: the engine
uses its `ModelRunner` directly. Imports `config`, `parallel`, `sequence`, `scheduler`,
`sampling` (for types) and `model_runner`."""

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
from dataclasses import dataclass, field
from typing import Any

import torch

from vegas_spec import parallel
from vegas_spec.config import ConfigError, EngineConfig, SamplingParams, SpecConfig
from vegas_spec.model_runner import ModelRunner, StepOutput
from vegas_spec.models.loader import ModelSource, load_config
from vegas_spec.scheduler import Piece
from vegas_spec.sequence import Sequence

TIMEOUT_S = 600  # a collective that waits longer fails (a rank that stopped answering)
STUCK_S = 30  # a dead worker that rank 0 has not noticed by then ends rank 0 (blocked in NCCL)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE")


class ExecutorError(RuntimeError):
    """A tensor-parallel worker died or failed: the engine cannot go on."""


@dataclass(frozen=True)
class SeqSpec:
    """What a worker needs to rebuild a sequence's mirror."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    limit: int
    headroom: int
    pages: list[int]
    output: list[int]  # a preempted sequence's output so far, prefilled again
    prefilled: int = 0  # positions on pages taken from the prefix cache

    @classmethod
    def of(cls, seq: Sequence) -> SeqSpec:
        return cls(seq.request_id, list(seq.prompt_ids), seq.params, seq.limit, seq.headroom,
                   list(seq.pages), list(seq.output), seq.prefilled)

    def mirror(self) -> Sequence:
        return Sequence(self.request_id, self.prompt_ids, self.prompt_ids, self.params,
                        self.limit, self.headroom, pages=list(self.pages),
                        prefilled=self.prefilled, cached=self.prefilled,
                        output=list(self.output), prefill_ids=self.prompt_ids + self.output)


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
    """The executor engines built now mirror to (None: single process, or SPMD ranks)."""
    return _active


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


# --- rank 0: the runner proxy -----------------------------------------------------------


class RunnerProxy:
    """Rank 0's ModelRunner, each device call sent to the workers first; every other
    attribute is the runner's own."""

    def __init__(self, executor: Executor, config: EngineConfig, source: ModelSource,
                 spec: SpecConfig) -> None:
        parallel.check_divisible(load_config(source), executor.world_size)  # before loading
        engine = executor.new_engine()
        object.__setattr__(self, "_executor", executor)
        object.__setattr__(self, "_engine", engine)
        executor.send(Call(engine, "build", (config, source, spec)))
        runner = _guard(executor, lambda: ModelRunner(config, source, spec))
        object.__setattr__(self, "_runner", runner)
        _guard(executor, lambda: agree_pages(runner, executor.channel))
        weakref.finalize(self, executor.free, engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._runner, name, value)

    def _run(self, method: str, wire: tuple, *args: Any) -> Any:
        """Send `method` with the host arguments `wire`, then make the call here with args."""
        executor: Executor = self._executor
        executor.send(Call(self._engine, method, wire))
        return _guard(executor, lambda: getattr(self._runner, method)(*args))

    def reserve(self, rows: int) -> None:
        self._run("reserve", (rows,), rows)

    def warm_prefill(self, max_pieces: int) -> int:
        return self._run("warm_prefill", (max_pieces,), max_pieces)

    def warm_rounds(self, kinds: tuple[str, ...] | None = None) -> None:
        self._run("warm_rounds", (kinds,), kinds)

    def set_spec(self, spec: SpecConfig) -> None:
        self._run("set_spec", (spec,), spec)

    def start(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return self._runner.start(seqs)
        for seq in seqs:  # every rank draws from the same seed
            if seq.params.seed is None:
                seq.params = dataclasses.replace(
                    seq.params, seed=int(torch.randint(2**62, ()).item()))
        self._run("start", ([SeqSpec.of(s) for s in seqs],), seqs)

    def prefill(self, pieces: list[Piece]) -> tuple[list[Sequence], list[int]]:
        wire = [(p.seq.request_id, p.start, p.end) for p in pieces]
        return self._run("prefill", (wire,), pieces)

    def join(self, seqs: list[Sequence]) -> None:
        self._run("join", ([s.request_id for s in seqs],), seqs)

    def grow(self, seqs: list[Sequence]) -> None:
        self._run("grow", ([(s.request_id, list(s.pages)) for s in seqs],), seqs)

    def decode(self, draft: bool = True) -> StepOutput:
        return self._run("decode", (draft,), draft)

    def select(self) -> None:
        batch = self._runner.batch
        done = [] if batch is None else [(s.request_id, s.finish_reason) for s in batch.seqs
                                         if s.finished]
        self._run("select", (done,))

    def drop(self, seq: Sequence) -> None:
        self._run("drop", (seq.request_id,), seq)

    def clear(self) -> None:
        self._run("clear", ())

    def logits(self, token_ids: list[int], pages: list[int], chunk: int) -> torch.Tensor:
        return self._run("logits", (list(token_ids), list(pages), chunk), token_ids, pages,
                         chunk)

    def next_token_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        return self._run("next_token_logits", ([SeqSpec.of(s) for s in seqs],), seqs)


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


@dataclass
class Mirror:
    """A worker's runner and the mirrors of rank 0's sequences that hold its rows."""

    runner: ModelRunner
    seqs: dict[str, Sequence] = field(default_factory=dict)
    done: list[Sequence] = field(default_factory=list)  # the last prefill's completed ones

    def apply(self, method: str, args: tuple) -> None:
        """Make rank 0's call on this rank's runner."""
        runner = self.runner
        if method in ("reserve", "warm_prefill", "warm_rounds", "set_spec"):
            getattr(runner, method)(*args)
        elif method == "start":
            seqs = [s.mirror() for s in args[0]]
            self.seqs.update((s.request_id, s) for s in seqs)
            runner.start(seqs)
        elif method == "prefill":
            pieces = [Piece(self.seqs[rid], a, b) for rid, a, b in args[0]]
            self.done, first = runner.prefill(pieces)
            for seq, tok in zip(self.done, first):
                seq.output.append(tok)
        elif method == "join":
            keep = set(args[0])
            runner.join([self.seqs[rid] for rid in args[0]])
            for seq in self.done:
                if seq.request_id not in keep:
                    self.seqs.pop(seq.request_id, None)
            self.done = []
        elif method == "grow":
            seqs = [self.seqs[rid] for rid, _ in args[0]]
            for seq, (_, pages) in zip(seqs, args[0]):
                seq.pages = pages
            runner.grow(seqs)
        elif method == "decode":
            out = runner.decode(*args)
            for seq, tokens in zip(out.seqs, out.tokens):
                seq.output.extend(tokens)
        elif method == "select":
            for rid, reason in args[0]:
                seq = self.seqs.pop(rid, None)
                if seq is not None:
                    seq.finish_reason = reason
            runner.select()
        elif method == "drop":
            seq = self.seqs.pop(args[0], None)
            if seq is not None:
                runner.drop(seq)
        elif method == "clear":
            runner.clear()
            self.seqs.clear()
        elif method == "logits":
            runner.logits(*args)
        elif method == "next_token_logits":
            runner.next_token_logits([s.mirror() for s in args[0]])
        else:
            raise ExecutorError(f"unknown call {method!r}")


def serve(channel: Channel) -> None:
    """A worker rank's loop: make every call rank 0 sends until it says stop."""
    engines: dict[int, Mirror] = {}
    while True:
        call = channel.recv()
        for engine in call.freed:
            engines.pop(engine, None)
        if call.method == "stop":
            return
        if call.method == "build":
            runner = ModelRunner(*call.args)
            agree_pages(runner, channel)
            engines[call.engine] = Mirror(runner)
            continue
        engines[call.engine].apply(call.method, call.args)


def make_runner(config: EngineConfig, source: ModelSource, spec: SpecConfig) -> ModelRunner:
    """The engine's runner: mirrored to the workers while a launch is active, else plain."""
    executor = active()
    if executor is None:
        return ModelRunner(config, source, spec)
    return RunnerProxy(executor, config, source, spec)  # type: ignore[return-value]
