"""What several benchmarks share: long text (the Paul Graham essays and, as a second kind
that is not prose, the Python standard library's own source code; the same texts `vegas
bench` reads, its essays and code workloads, loaded from there on first use, and prompts cut
from them), a tiny random model that speaks SmolLM2's tokenizer, the per-step watch of
`LLM.generate`'s `on_step`, and the timer of calls captured in one CUDA graph."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def essays() -> list[str]:
    from vegas_spec.bench.workloads import essays as read

    return read()


def source_code() -> list[str]:
    from vegas_spec.bench.workloads import source_code as read

    return read()


TEXTS = {"essays": essays, "code": source_code}


def rotated_prompts(tokenizer: Any, texts: list[str], count: int, tokens: int,
                    grow: int = 0) -> list[list[int]]:
    """`count` prompts of `tokens` tokens (prompt i: up to `grow` · i more, of the first
    8 · `tokens` characters), prompt i the texts from the i-th onwards."""
    out = []
    for i in range(count):
        text = "\n\n".join(texts[i:] + texts[:i])
        ids = tokenizer(text[: 8 * tokens], add_special_tokens=False)["input_ids"]
        out.append(ids[: tokens + grow * i])
    return out


def tiny_model(folder: Path) -> Path:
    """A 2-layer Llama config with SmolLM2's vocabulary and tokenizer files in `folder` (load
    it with load_format="dummy": random weights, real detokenisation) -> folder."""
    from vegas_spec.models.loader import resolve
    from vegas_spec.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve(None))
    tok.save_pretrained(str(folder))
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": len(tok),
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
              "eos_token_id": 2, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class StepWatch:
    """`on_step` for `LLM.generate` that hands every step to `step(wall, added, info)`: its
    wall time since the previous call returned (so the callback's own time is left out),
    the seconds the runner's phase timer added in it, by phase (`engine.runner.timer.totals`,
    the figures behind a run's `phase_s`), and what the step did (`engine.last_step`)."""

    def __init__(self, llm: Any) -> None:
        self.engine = llm.engine
        self.last: float | None = None  # when the previous call returned
        self.phases: dict[str, float] = {}

    def __call__(self, progress: Any) -> None:
        now = time.perf_counter()
        phases = dict(self.engine.runner.timer.totals)
        if self.last is not None:  # the first call comes before the first step
            added = {k: v - self.phases.get(k, 0.0) for k, v in phases.items()}
            self.step(now - self.last, added, self.engine.last_step)
        self.phases = phases
        self.last = time.perf_counter()

    def step(self, wall: float, added: dict[str, float], info: Any) -> None:
        raise NotImplementedError


def cuda_median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median ms of `reps` calls of fn, each timed alone by CUDA events around it."""
    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_us(fn: Callable[[], object], calls: int = 30, reps: int = 20) -> float:
    """Median µs per call of `calls` calls captured in one CUDA graph (after a warm-up run
    outside the capture), over `reps` replays."""
    from vegas_spec.graphs import capture

    graph, _ = capture(lambda: [fn() for _ in range(calls)], None)
    graph.replay()
    return cuda_median_ms(graph.replay, reps) * 1000 / calls


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, read + write."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (cuda_median_ms(lambda: dst.copy_(src), 10) / 1e3)
