"""`LLMEngine`: add_request, abort and step; `LLM(model, **kw).generate(prompts, params)`.

One engine step is one message each way: the scheduler plans it (`StepPlan`: it admits
waiting requests, rows and KV pages permitting, takes the next pieces of the admitted prompts,
at most one prefill budget of tokens, and gives the rows the KV pages their iteration writes,
the newest sequences preempted where the pool runs out; the adaptive controller says how
many tokens the iteration drafts, none for a plain step), and the model runner executes it:
it prefills the pieces, the prompts that complete give their first token and join the input
batch, then one decode iteration runs over every row (one token each, or a
draft-verify-accept round of 1 to g+1 tokens, g ≤ γ drafts),
returning a `StepResult`: each step is exactly one `execute`. The engine appends its tokens
to the sequences; each request that got tokens gets a `RequestOutput` with its text delta;
finished requests give their pages back, and their rows leave with the next plan (the last
ones, once no row is in use, with the next call that needs an idle runner, or at the end of
`LLM.generate`: `release_rows`). The engine sees the runner only through the `step.Runner`
interface (`ModelRunner`, or `ParallelRunner` under tensor parallelism); it reads its facts,
never its parts, and sets nothing on it. The offline `LLM.generate` and the server are loops
over `step()`; offline, more prompts than fit at once simply queue, the admitted prompts are
all prefilled before their rows decode (`step(prefill_first=True)`: every decode iteration
then runs the whole batch), and no step makes outputs (each request's text is decoded once,
when it is read at the end). Python's cyclic garbage collector is paused for the length of
that loop (`collector_paused`): a full collection walks every tracked object of the process
(the model's modules, the tokenizer, the prompts: about 900K objects with the embedded
model) and stops the loop between two steps for tens to hundreds of milliseconds, while the
steps make no reference cycles for it to find."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import operator
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from vegas_spec.cache import OutOfMemoryError, check_memory, fmt_bytes
from vegas_spec.config import (
    ConfigError,
    LengthCapWarning,
    PromptError,
    SamplingParams,
    SpecConfig,
    engine_config,
    is_int,
    prompt_list,
    sampling_list,
    spec_config,
)
from vegas_spec.executor import make_runner, spmd_group
from vegas_spec.graphs import bucket_for, round_kind_of
from vegas_spec.models.loader import resolve
from vegas_spec.prefill_graphs import bucket_floor
from vegas_spec.sampling import host_flags
from vegas_spec.scheduler import Piece, PrefillPacer, Scheduler
from vegas_spec.sequence import Detokenizer, Sequence, Status
from vegas_spec.speculative.adaptive import SpeculationController, draft_lengths
from vegas_spec.stats import RunStats, SeqStats
from vegas_spec.step import Prefill, Runner, StepPlan, StepResult
from vegas_spec.tokenizer import encode, load_tokenizer, longest_token, text_decoder


@dataclass
class StepInfo:
    """What one step did: prompt tokens prefilled, tokens emitted per decoding row (1..γ+1
    each; empty when no row decoded), the draft length γ (0: plain decoding), seconds."""

    prefill_tokens: int = 0
    first_tokens: int = 0  # prompts that completed and gave their first token
    emitted: list[int] = field(default_factory=list)
    gamma: int = 0
    drafted: int = 0  # the decode iteration's draft length (0: a plain step)
    bucket: int = 0  # the batch bucket of the decode iteration (its rows, rounded up)
    preempted: int = 0  # sequences preempted for the pages of this iteration
    seconds: float = 0.0
    prefill_seconds: float = 0.0  # of which admission and prefill (the rest: the iteration)


class _Later:
    """A field value made only if it is read (see `_Deferred`)."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


class _Deferred:
    """A dataclass field that may be given a `_Later`: made, once, when first read."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            raise AttributeError(self.slot)  # no default: the field stays required
        value = obj.__dict__[self.slot]
        if isinstance(value, _Later):
            value = obj.__dict__[self.slot] = value.make()
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.slot] = value


@dataclass
class RequestOutput:
    """A request's output so far: text and token_ids in full, delta_text and
    delta_token_ids what this step added; finish_reason None while it runs. A running
    request's token_ids and stats are made when first read (as they stood at its step)."""

    prompt: str | list[int]
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int] = _Deferred()  # type: ignore[assignment]
    finish_reason: str | None
    stats: dict[str, Any] = _Deferred()  # type: ignore[assignment]
    request_id: str = ""
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _sequence_stats(stats: SeqStats, iterations: int, budgets: int) -> dict[str, Any]:
    return {"sequence": stats.summary_upto(iterations, budgets)}


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic cyclic garbage collection inside (reference counting still frees what
    it can); the collector's state before is restored after, and what it would have found
    waits for its next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class LLMEngine:
    """The serving engine: a scheduler and a model runner over one method, stepped by its
    caller. Not thread-safe: one thread calls add_request, abort and step."""

    def __init__(self, model: str | None = None, *,
                 speculative: SpecConfig | dict | None = None, **engine_kwargs: Any) -> None:
        max_num_seqs = engine_kwargs.pop("max_num_seqs", 256)
        if not is_int(max_num_seqs) or max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        self.config = engine_config(engine_kwargs)
        self.spec = spec_config(speculative)
        if self.config.kv_cache_bytes is not None:  # before loading anything
            check_memory(self.config.kv_cache_bytes, torch.device(self.config.device))
        self.source = resolve(model)
        # under tensor parallelism (a `launch`), one that broadcasts each call to the workers
        self.runner: Runner = make_runner(self.config, self.source, self.spec)
        self._spmd = spmd_group()
        budget = self.config.prefill_tokens(self.runner.model_config)
        self.scheduler = Scheduler(self.runner.pages, max_num_seqs, budget)
        pacing = self.config.prefill_pacing
        self.pacer = None if pacing is None else PrefillPacer(budget, pacing)
        self._tokenizer = None
        self._decode: Callable[[list[int]], str] | None = None
        self._ids = itertools.count()
        self.seqs: dict[str, Sequence] = {}
        self.wall = {"prefill": 0.0, "decode": 0.0}  # seconds of steps, by part
        self.iterations = 0
        self.last_step = StepInfo()
        self.controller = self._controller(self.spec)

    @property
    def tokenizer(self):  # noqa: ANN201
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.source)
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def draft_weight_bytes(self) -> int:
        """Bytes of the draft steps' FP8 or INT4 weight copies (0: drafts read the model's)."""
        return self.runner.draft_weight_bytes

    @property
    def draft_weight_kind(self) -> str:
        """What the draft steps' projections read: fp8, int8, int4 or model."""
        return self.runner.draft_weight_kind

    def has_tokenizer(self) -> bool:
        """A GGUF file or an HF folder with tokenizer files (token-id prompts on a
        checkpoint without one give no text)."""
        names = ("tokenizer.json", "tokenizer_config.json")
        return self.source.is_gguf or any((self.source.path / f).exists() for f in names)

    def set_spec(self, spec: SpecConfig) -> None:
        """Another decoding method: only while no request is in flight."""
        if spec == self.spec:
            return
        if self.has_unfinished():
            raise ConfigError("the decoding method cannot change while requests run")
        self.spec = spec
        self.release_rows()
        self.runner.set_spec(spec)
        self.controller = self._controller(spec)
        if self.pacer is not None:  # another method's steps take other times
            self.pacer = dataclasses.replace(self.pacer)  # the settings, no estimates

    @staticmethod
    def _controller(spec: SpecConfig) -> SpeculationController | None:
        """Adaptive speculation's measurements, made again for another method."""
        if not (spec.speculative and spec.adaptive):
            return None
        return SpeculationController(lengths=draft_lengths(spec.gamma))

    def warm_up(self, rows: int) -> int:
        """Before serving: the decode buffers and graphs of every batch bucket up to `rows`,
        and every prefill bucket's forward, so that no request waits for a capture -> the
        prefill forwards made."""
        self.reserve(rows, None)
        return self.runner.warm_prefill(rows)

    def reserve(self, rows: int, rounds: tuple[str, ...] | None = ()) -> None:
        """While no row is in use: the static buffers (and CUDA graphs) sized for `rows` rows
        (not sized again while rows are in use), and the decode graphs of `rounds` captured
        now (None: every kind a request can need)."""
        self.release_rows()
        self.runner.reserve(rows)
        if rounds is None or rounds:
            self.runner.warm_rounds(rounds)

    def release_rows(self) -> None:
        """Where no row is in use, the finished rows the runner still holds leave now (else
        they leave with the next plan): before a call that needs an idle runner (its
        buffers sized again, its method changed), and at the end of an offline run."""
        scheduler = self.scheduler
        if scheduler.leaving and not scheduler.rows:
            self.runner.drop(*scheduler.leaving)
            scheduler.leaving = []

    # --- requests -----------------------------------------------------------------------

    def sequence(self, prompt: str | list[int], params: SamplingParams, chat: bool = False,
                 index: int | None = None, request_id: str | None = None,
                 text: bool = True) -> Sequence:
        """A checked request (not yet queued); index: the prompt's place in a batch, named
        by the errors; text: detokenize its output (where the model has a tokenizer)."""
        cfg, context = self.runner.model_config, self.max_model_len
        longest = longest_token(self.tokenizer) if isinstance(prompt, str) else 0
        if isinstance(prompt, str) and len(prompt) > context * longest:
            # refused before tokenizing: so many characters take more tokens than the context
            raise PromptError(f"has {len(prompt):,} characters, more than any {context}-token "
                              f"context holds (it would need over {len(prompt) // longest:,} "
                              "tokens)", index)
        ids = encode(self.tokenizer, prompt, chat) if isinstance(prompt, str) else list(prompt)
        vocab = cfg.vocab_size
        if not ids:
            raise PromptError("is empty (no tokens)", index)
        if min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab]
            raise PromptError(f"holds token ids outside [0, {vocab}), e.g. {bad[0]}", index)
        if len(ids) >= context:
            raise PromptError(f"has {len(ids)} tokens but the model's context is {context}: "
                              "nothing is left to generate", index)
        limit = min(len(ids) + params.max_tokens, context)
        extra = self.spec.gamma + 1 if self.spec.speculative else 0
        window = cfg.sliding_window
        if window is not None and limit + extra > window:
            raise PromptError(f"would grow to {limit + extra} tokens, past the sliding window "
                              f"({window} tokens); longer sequences are not supported", index)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, prompt, ids, params, limit, extra, frozenset(cfg.eos_token_ids),
                       stats=SeqStats(gamma=self.spec.gamma if self.spec.speculative else 0))
        if text and self.has_tokenizer():
            if self._decode is None:
                self._decode = text_decoder(self.tokenizer)
            seq.detok = Detokenizer(self.tokenizer, self._decode)
        self._check_pool(seq)
        return seq

    def _check_pool(self, seq: Sequence) -> None:
        """Refuse a sequence that could never be resident, even alone."""
        pages = self.runner.pages
        need = pages.pages_for(seq.kv_tokens)
        pool = pages.num_pages - (self.runner.scratch_page >= 0)
        if need > pool:
            raise OutOfMemoryError(
                f"a sequence of {seq.kv_tokens} tokens needs {need} KV pages "
                f"({fmt_bytes(need * pages.bytes_per_page)}) but the pool holds {pool} "
                f"({fmt_bytes(pool * pages.bytes_per_page)}); lower max_tokens or raise the "
                "KV budget")

    def add_request(self, prompt: str | list[int] | Sequence,
                    params: SamplingParams | None = None, *, chat: bool = False,
                    request_id: str | None = None) -> str:
        """Queue a request (a prompt, or a Sequence made by `sequence`) -> its id."""
        seq = prompt if isinstance(prompt, Sequence) else self.sequence(
            prompt, params or SamplingParams(), chat, request_id=request_id)
        if seq.request_id in self.seqs:
            raise ConfigError(f"request id {seq.request_id!r} is already in use")
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now: queued, prefilling or decoding, its row and pages are free
        before the next step runs, and it gives no further output. -> whether it was known."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.finished:
            return False
        seq.finish("abort")
        self.runner.drop(seq.request_id)
        self._release(seq)
        return True

    def abort_all(self) -> None:
        """Every request dropped and every page back (after an error or an interrupt)."""
        self.runner.clear()
        self.scheduler.leaving = []
        for seq in list(self.seqs.values()):
            seq.finish("abort")
            self._release(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted (their pages given back, to be prefilled again) so far."""
        return self.scheduler.preemptions

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)

    # --- the step -----------------------------------------------------------------------

    def step(self, collect: bool = True, prefill_first: bool = False) -> list[RequestOutput]:
        """Admit, prefill a budget of prompt tokens, decode one iteration -> an output for
        every request that got tokens or finished in this step (collect False: none are made,
        [] is returned; for a caller that reads the sequences once they finish).

        prefill_first: while an admitted prompt still has positions to prefill, the step only
        prefills, so that the rows decode together once every admitted prompt is in (an
        offline batch: its decode steps run at the batch's full width); else the running
        rows decode one iteration in every step while prompts arrive (a server's)."""
        touched: dict[str, Sequence] = {}
        self.last_step = info = StepInfo(gamma=self.spec.gamma if self.spec.speculative else 0)
        t0 = time.perf_counter()
        budget = self._prefill_budget()
        plan = self._plan(info, budget, prefill_first)
        t1 = time.perf_counter()
        result = self.runner.execute(plan)
        self._first_tokens(result, touched, info)
        if plan.decode:
            self._decoded(result, touched, info)
        self.scheduler.stepped()
        t2 = time.perf_counter()
        # a step that decoded: its prefill's part is the planning that admitted its prompts
        # and the runner's prefill (the rest is the iteration's, which adaptive speculation
        # weighs); a step that only prefilled is all prefill
        if not plan.decode:
            prefill_s = t2 - t0
        elif plan.prefill:
            prefill_s = t1 - t0 + result.prefill_seconds
        else:
            prefill_s = 0.0
        outs = [self._output(s) for s in touched.values()] if collect else []
        for seq in touched.values():
            if seq.finished:  # its row, if it had one, leaves with the next plan
                self._release(seq)
        # the iteration's whole cost, its host work included (scheduling, appending,
        # outputs: paid per iteration, whatever the tokens)
        seconds, spent = t2 - t0, time.perf_counter() - t0
        if self._spmd is not None:  # every rank's engine plans by rank 0's times
            seconds, prefill_s, spent = self._spmd.from_rank0((seconds, prefill_s, spent))
        self.wall["prefill"] += prefill_s
        self.wall["decode"] += seconds - prefill_s
        info.seconds, info.prefill_seconds = seconds, prefill_s
        if self.pacer is not None:
            self.pacer.observe(info.prefill_tokens, bool(info.emitted), info.seconds, budget)
        if info.emitted and self.controller is not None:  # a prefill's part is not its own
            self.controller.observe(info.bucket, info.drafted,
                                    spent - (prefill_s if info.prefill_tokens else 0.0),
                                    info.emitted)
        return outs

    def _plan(self, info: StepInfo, budget: int | None, prefill_first: bool) -> StepPlan:
        """The scheduler's plan of this step, with the adaptive controller's choice of a
        round's draft length or a plain step (0) for its decode iteration."""
        scheduler = self.scheduler
        preemptions = scheduler.preemptions
        plan = scheduler.schedule(self._row_limit(), budget, prefill_first)
        info.prefill_tokens = sum(len(p.tokens) for p in plan.prefill)
        info.preempted = scheduler.preemptions - preemptions
        if not plan.decode:
            return plan
        info.bucket = bucket_for(len(scheduler.rows))
        if self.controller is None:
            return plan
        return dataclasses.replace(plan, draft=self.controller.choose(info.bucket))

    def _row_limit(self) -> int:
        """Sequences that may run: under static shapes, while rows are in use, the buffers'
        capacity (they are sized again only when no row is in use: the finished rows that
        the plan's `leave` names go before its `reserve`)."""
        most, capacity = self.scheduler.max_num_seqs, self.runner.capacity
        if capacity is None or not self.scheduler.rows:
            return most
        return min(capacity, most)

    def _first_tokens(self, result: StepResult, touched: dict[str, Sequence],
                      info: StepInfo) -> None:
        """The first tokens of the prompts the step completed (a sequence preempted since
        its piece was planned waits to be prefilled again: its token is dropped)."""
        info.first_tokens = len(result.first)
        for rid, tok in result.first:
            seq = self.seqs[rid]
            if seq.status is Status.RUNNING:
                seq.append([tok])
                touched[rid] = seq

    def _decoded(self, result: StepResult, touched: dict[str, Sequence],
                 info: StepInfo) -> None:
        """The decode iteration's tokens, appended row by row (a row whose first token
        ended it decoded in vain: it leaves with the next plan)."""
        self.iterations += 1
        info.drafted = result.drafted
        for rid, tokens, budget in zip(result.rows, result.tokens, result.budgets):
            seq = self.seqs[rid]
            if seq.finished:
                continue
            info.emitted.append(len(tokens))
            seq.stats.record(len(tokens), budget, result.drafted)
            seq.append(tokens)
            touched[rid] = seq

    def _prefill_budget(self) -> int | None:
        """This step's prompt tokens: the pacer's (on a whole bucket of the prefill graphs, so
        no forward is padded), or None for the scheduler's fixed budget."""
        if self.pacer is None:
            return None
        tokens = self.pacer.budget(decoding=bool(self.scheduler.rows))
        return min(tokens, bucket_floor(tokens))

    def _output(self, seq: Sequence) -> RequestOutput:
        """The step's output of seq: a finished one's ids are its output list (it no longer
        grows), a running one's ids and stats are made if read."""
        text, ids = seq.delta()
        if seq.finished:
            return RequestOutput(seq.prompt, seq.prompt_ids, seq.text, seq.output,
                                 seq.finish_reason, {"sequence": seq.stats.summary()},
                                 seq.request_id, text, ids)
        n, stats = len(seq.output), seq.stats
        return RequestOutput(
            seq.prompt, seq.prompt_ids, seq.text,
            _Later(functools.partial(operator.getitem, seq.output, slice(n))), None,
            _Later(functools.partial(_sequence_stats, stats, stats.iterations,
                                     len(stats.budget))),
            seq.request_id, text, ids)


@dataclass(frozen=True)
class Progress:
    """Where an offline `generate` stands: prompt tokens prefilled of all of them, new tokens
    generated of the most that may come (each prompt's max_tokens within the context), and
    the last step's outputs (with `stream`: each request that got tokens, its delta_text)."""

    prefilled: int
    prompt_tokens: int
    generated: int
    most: int
    outputs: list[RequestOutput]

    @classmethod
    def of(cls, seqs: list[Sequence], outputs: list[RequestOutput]) -> Progress:
        return cls(sum(s.prefilled for s in seqs), sum(len(s.prompt_ids) for s in seqs),
                   sum(len(s.output) for s in seqs),
                   sum(s.limit - len(s.prompt_ids) for s in seqs), outputs)


class LLM:
    """Offline generation: every prompt added to one engine, stepped until all finish."""

    def __init__(self, model: str | None = None, *, speculative: SpecConfig | dict | None = None,
                 **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(model, speculative=speculative, **engine_kwargs)

    # What a caller reads: the settings (the engine's, the default method), the tokenizer,
    # the model's config and context, and the device that `logits` returns on: facts of the
    # runner's interface (`step.Runner`), never its parts.
    config = property(lambda self: self.engine.config)
    spec = property(lambda self: self.engine.spec)
    tokenizer = property(lambda self: self.engine.tokenizer)
    max_model_len = property(lambda self: self.engine.max_model_len)
    device = property(lambda self: self.engine.runner.device)
    model_config = property(lambda self: self.engine.runner.model_config)

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, *,
                 chat: bool = False, speculative: SpecConfig | dict | None = None,
                 on_step: Callable[[Progress], None] | None = None, stream: bool = False,
                 ) -> list[RequestOutput]:
        """Every prompt to its end -> its output, in order. on_step: called once the prompts
        are queued and after every step with where the run stands; stream: each step makes
        its outputs (text deltas) for on_step, as a server's steps do (else none are made)."""
        started = time.perf_counter()
        engine = self.engine
        if engine.has_tokenizer():  # loaded by the first call: a load, not the request's time
            engine.tokenizer  # noqa: B018
        arrived = time.perf_counter()
        spec = spec_config(speculative) if speculative is not None else engine.spec
        prompts, batch = prompt_list(prompts)
        params_list = sampling_list(params, len(prompts))
        engine.set_spec(spec)
        named = batch and len(prompts) > 1  # errors and warnings give the prompt's index
        seqs = [engine.sequence(p, sp, chat, i if named else None)
                for i, (p, sp) in enumerate(zip(prompts, params_list))]
        self._warn_capped(seqs, named)
        # Buffers (and CUDA graphs) for the largest batch these prompts can form, made once:
        # sized from the first admission, they would hold a later, larger batch to its rows.
        # (a sampled batch's round graph too, before the decode loop)
        rounds = (round_kind_of(*host_flags(params_list)),) if spec.speculative else ()
        engine.reserve(engine.scheduler.max_resident(seqs), rounds)
        stats, wall, iterations = self._start_stats(spec, seqs)
        try:
            for seq in seqs:
                engine.add_request(seq)
            with collector_paused():
                if on_step is not None:
                    on_step(Progress.of(seqs, []))
                while engine.has_unfinished():
                    # the outputs are made once, at the end (unless streamed); the rows
                    # decode once all are in
                    outs = engine.step(collect=stream, prefill_first=True)
                    if on_step is not None:
                        on_step(Progress.of(seqs, outs))
            engine.release_rows()  # the last rows: the runner is left idle
        except BaseException:
            engine.abort_all()
            raise
        texts = [s.text for s in seqs]  # decoded here, once each: inside the run's total time
        self._finish_stats(stats, seqs, arrived, wall)
        stats.load = arrived - started
        summary = stats.summary()
        return [RequestOutput(p, s.prompt_ids, text, s.output, s.finish_reason or "length",
                              {**summary, "sequence": s.stats.summary()}, s.request_id)
                for p, s, text in zip(prompts, seqs, texts)]

    def _start_stats(self, spec: SpecConfig, seqs: list[Sequence],
                     ) -> tuple[RunStats, dict[str, float], int]:
        timer = self.engine.runner.restart_timer()
        stats = RunStats(spec.method, spec.gamma if spec.speculative else 0, timer,
                         prompt_tokens=sum(len(s.prompt_ids) for s in seqs),
                         seqs=[s.stats for s in seqs])
        return stats, dict(self.engine.wall), self.engine.iterations

    def _finish_stats(self, stats: RunStats, seqs: list[Sequence], arrived: float,
                      wall: dict[str, float]) -> None:
        """The run's figures, its times from the requests' arrival (once the tokenizer was
        loaded)."""
        stats.timer.flush()
        now = self.engine.wall
        stats.wall_prefill = now["prefill"] - wall["prefill"]
        stats.wall_decode = now["decode"] - wall["decode"]
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        stats.ttft = (max(firsts) if firsts else time.perf_counter()) - arrived
        stats.wall_total = time.perf_counter() - arrived
        stats.generated_tokens = sum(len(s.output) for s in seqs)

    def _warn_capped(self, seqs: list[Sequence], named: bool) -> None:
        """Say which prompts leave less room in the context than max_tokens asks for: they
        stop there, with finish_reason "length". Warned once every prompt is accepted."""
        for i, s in enumerate(seqs):
            if len(s.prompt_ids) + s.params.max_tokens > s.limit:
                room = s.limit - len(s.prompt_ids)
                warnings.warn(LengthCapWarning(
                    f"leaves room for {room} new tokens in the model's context of "
                    f"{self.max_model_len}: max_tokens {s.params.max_tokens} is capped to {room}",
                    i if named else None), stacklevel=3)

    def logits(self, token_ids: list[int], *, chunk: int | None = None):  # noqa: ANN201
        """Logits [n, V] (float32) of every prompt position, through the packed prefill path
        in forwards of `chunk` tokens (default: the engine's prefill chunk)."""
        if chunk is not None and (not is_int(chunk) or chunk < 1):
            raise ConfigError(f"chunk must be an integer >= 1, got {chunk!r}")
        seq = self.engine.sequence(token_ids, SamplingParams(max_tokens=1), text=False)
        pool = self.engine.scheduler.pool
        pages = pool.allocate(len(seq.prompt_ids))
        try:
            return self.engine.runner.logits(
                seq.prompt_ids, pages, chunk or self.config.prefill_tokens(self.model_config))
        finally:
            pool.release(pages)

    def next_token_logits(self, prompts: str | list[str] | list[int] | list[list[int]], *,
                          chat: bool = False):  # noqa: ANN201
        """Logits [B, V] (float32) of the token after each prompt, through the prefill that
        `generate` runs (batched, chunked, with the prefix cache when it is on)."""
        seqs = [self.engine.sequence(p, SamplingParams(max_tokens=1), chat, i, text=False)
                for i, p in enumerate(prompt_list(prompts)[0])]
        scheduler = self.engine.scheduler
        scheduler.pool.check_fits([s.limit for s in seqs])
        for s in seqs:
            scheduler.place(s, s.limit)  # its cached prefix by reference
        try:
            logits = self.engine.runner.next_token_logits(
                [Prefill(s.request_id, s.prefilled, tuple(s.prefill_ids[s.prefilled :]),
                         len(s.prefill_ids), tuple(s.pages), s.params) for s in seqs])
            scheduler.prefilled([Piece(s, s.prefilled, len(s.prefill_ids)) for s in seqs])
            return logits
        finally:
            for s in seqs:
                scheduler.pool.release(s.pages)
