"""Prometheus metrics of one server (its own registry, so several can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vegas_spec.engine import LLMEngine, RequestOutput


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("vegas_requests", "Finished requests, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("vegas_prompt_tokens", "Prompt tokens prefilled",
                                     registry=r)
        self.generation_tokens = Counter("vegas_generation_tokens", "Tokens generated",
                                         registry=r)
        self.draft_tokens = Counter("vegas_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter("vegas_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.plain_steps = Counter(
            "vegas_plain_steps", "Decode iterations of a speculative method run as plain "
            "steps, where the engine measured that a round would not pay", registry=r)
        self.preemptions = Counter(
            "vegas_preemptions", "Requests preempted where the KV pool ran out: their pages "
            "given back, their prompt and output prefilled again when they resume", registry=r)
        self.rounds = Counter("vegas_speculative_rounds", "Draft-verify rounds run",
                              registry=r)
        self.draft_length = Histogram(
            "vegas_draft_length", "Tokens drafted per decode iteration of a speculative "
            "method (0: a plain step), as adaptive speculation chose them",
            buckets=[0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32], registry=r)
        self.tokens_per_iteration = Histogram(
            "vegas_tokens_per_iteration", "Tokens a row emits per decode iteration",
            buckets=[1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 33], registry=r)
        self.step_seconds = Histogram(
            "vegas_step_seconds", "Duration of one engine step",
            buckets=[.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10], registry=r)
        self.waiting = Gauge("vegas_num_requests_waiting", "Requests waiting for a row",
                             registry=r)
        self.running = Gauge("vegas_num_requests_running", "Requests holding a row",
                             registry=r)
        self.free_pages = Gauge("vegas_kv_free_pages", "Free KV cache pages", registry=r)

    def step(self, engine: LLMEngine, outs: list[RequestOutput]) -> None:
        """After each engine step (in the engine thread), with its outputs: the requests
        that finished are counted here, whether or not their clients read the end."""
        for out in outs:
            if out.finished:
                self.requests.labels(out.finish_reason).inc()
        info = engine.last_step
        self.prompt_tokens.inc(info.prefill_tokens)
        self.generation_tokens.inc(sum(info.emitted) + info.first_tokens)
        for n in info.emitted:
            self.tokens_per_iteration.observe(n)
        if info.gamma and info.emitted:
            self.draft_length.observe(info.drafted)
            if info.drafted:
                self.rounds.inc()
                self.draft_tokens.inc(info.drafted * len(info.emitted))
                self.accepted_tokens.inc(sum(n - 1 for n in info.emitted))
            else:
                self.plain_steps.inc()
        self.preemptions.inc(info.preempted)
        self.step_seconds.observe(info.seconds)
        self.gauges(engine)

    def abort(self, engine: LLMEngine) -> None:
        """After a request is aborted (its client left; in the engine thread): counted with
        finish reason "abort", and the gauges at once, not at the next step."""
        self.requests.labels("abort").inc()
        self.gauges(engine)

    def gauges(self, engine: LLMEngine) -> None:
        self.waiting.set(engine.num_waiting)
        self.running.set(engine.num_running)
        self.free_pages.set(engine.scheduler.pool.num_free)
