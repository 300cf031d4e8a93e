"""Static shapes and CUDA graphs of the decode loop.

On CPU the fixed-shape path (`static_shapes=True`) runs the same buffers eagerly that CUDA
captures: its greedy and seeded outputs must equal the default eager path's token for token,
for plain decoding and every speculative method, with a batch of 3 padded to bucket 4 and
with sequences leaving the batch at different times; nothing inside an iteration may read the
device. On CUDA the captured graphs replay and must give the eager tokens too."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_IDS, TINY_METHODS, config_folder, tiny_spec

from vegas_spec import SamplingParams, SpecConfig
from vegas_spec.attention.triton_backend import TritonBackend, topk_sum_by_width
from vegas_spec.cli import _engine_kwargs, _parser
from vegas_spec.config import ConfigError, EngineConfig
from vegas_spec.engine import LLM
from vegas_spec.graphs import GraphRunner, bucket_for, buckets_upto
from vegas_spec.input_batch import Batch
from vegas_spec.kernels.topk import topk_positions_triton
from vegas_spec.runner_setup import span_lengths, static_shapes
from vegas_spec.sampling import BatchSampling
from vegas_spec.speculative.policies import QuestState, SelectionInput, make_policy, max_budget

VOCAB = 256
CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
          "bos_token_id": 1, "eos_token_id": 2}
ENGINE = dict(load_format="dummy", kv_cache_bytes=1 << 22)
LENGTHS = (20, 45, 70)
METHODS, IDS = TINY_METHODS, TINY_IDS
SYNCS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return config_folder(tmp_path_factory, "tiny-llama", CONFIG)


@pytest.fixture(scope="module")
def eager(tiny: Path) -> LLM:
    return LLM(str(tiny), **ENGINE)


@pytest.fixture(scope="module")
def static(tiny: Path) -> LLM:
    return LLM(str(tiny), static_shapes=True, **ENGINE)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


STEPS: list[str] = []  # the kind of every static step of the running test


@pytest.fixture
def buckets(monkeypatch: pytest.MonkeyPatch) -> set[tuple[int, int]]:
    """(bucket, rows) of every static step run during the test (their kinds in STEPS)."""
    seen: set[tuple[int, int]] = set()
    STEPS.clear()

    replay = GraphRunner._replay

    def record(self: GraphRunner, kind: str) -> Any:
        seen.add((self.bucket, self.rows))
        STEPS.append(kind)
        return replay(self, kind)

    monkeypatch.setattr(GraphRunner, "_replay", record)
    return seen


def same_tokens(a: LLM, b: LLM, prompts: list[list[int]], params: Any,
                method: dict[str, Any] | None) -> list[list[int]]:
    spec = tiny_spec(method)
    ours = b.generate(prompts, params, speculative=spec)
    ref = a.generate(prompts, params, speculative=spec)
    for o, r in zip(ours, ref, strict=True):
        assert o.token_ids == r.token_ids
        assert o.stats["sequence"] == r.stats["sequence"]  # same iterations and budgets
    return [o.token_ids for o in ours]


# --- static shapes on CPU ---------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_static_greedy_equals_eager(eager: LLM, static: LLM, prompts: list[list[int]],
                                    method: dict[str, Any] | None,
                                    buckets: set[tuple[int, int]]) -> None:
    """3 sequences of different lengths run as bucket 4 (one dummy row)."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    tokens = same_tokens(eager, static, prompts, params, method)
    assert [len(t) for t in tokens] == [16] * 3
    assert static.engine.runner.graphs is not None and static.engine.runner.graphs.capacity == 4
    assert (4, 3) in buckets
    # greedy rounds run as one `spec` step: drafts, verify and acceptance together
    kinds = ("plain",) if method is None else ("spec",)
    assert static.engine.runner.graphs.shapes.kinds == kinds and set(STEPS) == set(kinds)


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_static_uneven_finish_equals_eager(eager: LLM, static: LLM, prompts: list[list[int]],
                                           method: dict[str, Any] | None,
                                           buckets: set[tuple[int, int]]) -> None:
    """Sequences leave at different times: the batch shrinks to bucket 2, then 1."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (25, 3, 11)]
    tokens = same_tokens(eager, static, prompts, params, method)
    assert [len(t) for t in tokens] == [25, 3, 11]
    assert {(4, 3), (2, 2), (1, 1)} <= buckets


@pytest.mark.parametrize("method", ["vegas", "quest"])
@pytest.mark.parametrize(("top_k", "kind"), [(0, "filtered"), (20, "topk"), (300, "filtered")])
def test_static_seeded_sampling_equals_eager(eager: LLM, static: LLM, prompts: list[list[int]],
                                             method: str, top_k: int, kind: str,
                                             buckets: set[tuple[int, int]]) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=top_k, max_tokens=n, seed=i,
                             ignore_eos=True) for i, n in enumerate((14, 6, 10))]
    same_tokens(eager, static, prompts, params, {"method": method})
    # each sampled round is one step too: top-p alone or a top-k past sampling.CANDIDATES
    # sorts the vocabulary (`filtered`), a small top-k ranks its candidates (`topk`)
    assert static.engine.runner.graphs is not None and set(STEPS) == {kind}


@pytest.fixture(scope="module")
def spanned(tiny: Path) -> LLM:
    """Static shapes with graphs at key widths 32, 64 and 128 besides the whole (256 + γ+1)."""
    return LLM(str(tiny), static_shapes=True, narrowest_span=32, **ENGINE)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The key width (`GraphRunner.span`) of every static step run during the test."""
    seen: list[int] = []
    replay = GraphRunner._replay

    def record(self: GraphRunner, kind: str) -> Any:
        seen.append(self.span)
        return replay(self, kind)

    monkeypatch.setattr(GraphRunner, "_replay", record)
    return seen


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_narrower_key_widths_equal_eager(eager: LLM, spanned: LLM, prompts: list[list[int]],
                                         method: dict[str, Any] | None,
                                         spans: list[int]) -> None:
    """The batch runs the narrowest key width that holds its longest row: 128 while the
    70-token prompt decodes, narrower once it leaves, then wider again up to the whole, with
    each step's plan made at another width than the one that reads it; the tokens, the
    iterations and the budgets are the eager path's."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (120, 3, 11)]
    same_tokens(eager, spanned, prompts, params, method)
    graphs = spanned.engine.runner.graphs
    assert graphs is not None
    assert [s.length for s in graphs.shapes.spans] == [32, 64, 128]
    assert spans[0] == 2 and spans[-1] == 3 and min(spans) < 2
    assert any(b < a for a, b in zip(spans, spans[1:]))  # down when the longest row left


def test_span_lengths_and_choice(tiny: Path) -> None:
    assert span_lengths(8192, 2048) == (2048, 4096)
    assert span_lengths(131072, 2048) == (16384, 32768, 65536)  # at most MAX_SPANS - 1
    assert span_lengths(4000, 2048) == () and span_lengths(8192, 0) == ()
    llm = LLM(str(tiny), static_shapes=True, narrowest_span=32, **ENGINE)
    parts = llm.engine.runner.parts
    shapes = static_shapes(parts, tiny_spec({"method": "vegas"}), make_policy(
        tiny_spec({"method": "vegas"})), 32)
    widths = shapes.widths
    assert [w.length for w in widths] == [32, 64, 128, 256] and widths[-1].pages == shapes.pages
    assert [w.pages for w in widths[:3]] == [2, 4, 8]
    assert [w.kmax for w in widths] == sorted(w.kmax for w in widths)
    # a round (γ+1 = 4 positions) must fit: 28 committed tokens run at 32, 29 at 64
    assert [shapes.span_for(n) for n in (28, 29, 124, 125, None)] == [0, 1, 2, 3, 3]
    plain = static_shapes(parts, tiny_spec(None), None, 32)
    assert [plain.span_for(n) for n in (31, 32)] == [0, 1]
    assert [w.length for w in plain.widths] == [32, 64, 128, 256]
    with pytest.raises(ConfigError, match="narrowest_span must be an integer >= 0"):
        EngineConfig(narrowest_span=-1)
    # exact mode keeps one width, whatever the batch's longest row
    exact = LLM(str(tiny), static_shapes=True, narrowest_span=32, exact=True, **ENGINE)
    exact.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True),
                   speculative=tiny_spec({"method": "vegas"}))
    assert exact.engine.runner.graphs is not None
    assert exact.engine.runner.graphs.shapes.spans == ()


def test_runner_is_reused_then_rebuilt_for_a_larger_batch(tiny: Path, eager: LLM,
                                                          prompts: list[list[int]]) -> None:
    llm = LLM(str(tiny), static_shapes=True, **ENGINE)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    spec = tiny_spec({"method": "stream"})
    for batch, capacity in (([prompts[0]], 1), ([prompts[1]], 1), (prompts, 4), (prompts[:2], 4)):
        outs = llm.generate(batch, params, speculative=spec)
        assert [o.token_ids for o in outs] == \
            [o.token_ids for o in eager.generate(batch, params, speculative=spec)]
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.capacity == capacity
    runner = llm.engine.runner.graphs
    llm.generate(prompts[:2], params, speculative=spec)
    assert llm.engine.runner.graphs is runner
    llm.generate(prompts[:2], params, speculative=tiny_spec({"method": "vegas"}))
    assert llm.engine.runner.graphs is not runner  # other shapes: a new runner


def test_leaving_rows_keep_every_sampling_setting() -> None:
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate((1.0, 0.5, 0.75))]
    sampling = BatchSampling.build(params, torch.device("cpu"))
    batch = Batch(["a", "b", "c"], [0, 1, 2], torch.zeros(3, 2, dtype=torch.int32),
                  torch.arange(3), torch.arange(3), sampling)
    kept = batch.keep([0, 2], torch.tensor([0, 2])).sampling
    assert kept.temperature.tolist() == [1.0, 0.75]
    assert kept.seeds.tolist() == [0, 2]
    assert (kept.all_greedy, kept.filters) == (sampling.all_greedy, sampling.filters)


def test_padding_rows_write_only_the_scratch_page(tiny: Path,
                                                  prompts: list[list[int]]) -> None:
    llm = LLM(str(tiny), static_shapes=True, **ENGINE)
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True),
                 speculative=tiny_spec({"method": "vegas"}))
    cache = llm.engine.runner.cache
    assert cache.num_pages - len(cache.free_pages) == 1  # the scratch page stays taken
    size = llm.config.page_size
    written = {p for p in range(cache.num_pages)
               if any(k[p * size:(p + 1) * size].abs().sum() > 0 for k, _ in cache.layers)}
    # Pages are handed out in order: the scratch page first, then each sequence's pages.
    owned = 1 + sum(cache.pages_for(len(p) + 8 + 4) for p in prompts)
    assert llm.engine.runner.scratch_page == 0 and 0 in written and written <= set(range(owned))


def padded_equal(static: torch.Tensor, dynamic: torch.Tensor) -> bool:
    """static [..., K] equals dynamic [..., k] (k <= K) followed by -1 padding."""
    k = dynamic.shape[-1]
    return torch.equal(static[..., :k], dynamic) and bool((static[..., k:] == -1).all())


@pytest.mark.parametrize("method", ["vegas", "lastq", "specextend", "stream", "quest"])
def test_host_bounds_give_the_same_selection(method: str) -> None:
    """A plan made with the static host bounds is the dynamic plan, -1 padded to the fixed
    width, with the fixed recent range."""
    layers, hkv, dim, page, gamma = 2, 2, 8, 4, 3
    own = {"specextend": {"chunk": 4}, "quest": {"page": page}}.get(method, {})
    cfg = SpecConfig(method=method, gamma=gamma, ratio=0.1, min_tokens=5, **own)
    policy = make_policy(cfg)
    g = torch.Generator().manual_seed(0)
    lengths, accepted = torch.tensor([40, 17, 6]), torch.tensor([2, 0, 3])
    row = lengths - accepted - 1
    groups = hkv if policy.per_kv_head else 1
    scores = torch.rand(layers, 3, len(policy.score_rows(gamma + 1, False)), groups,
                        int(row.max()) + gamma + 1, generator=g)
    caches = [(torch.randn(3 * 64, hkv, dim, generator=g), torch.zeros(3 * 64, hkv, dim))
              for _ in range(layers)]
    table = torch.arange(3 * 16, dtype=torch.int32).view(3, 16)
    inp = SelectionInput(scores, row, accepted, lengths, gamma, caches, table, page)
    kmax = max_budget(cfg, 64)
    dynamic = policy.plan(inp)
    bound = policy.recent_max(gamma)  # 2γ+1, and vegas's and lastq's window before it
    static = policy.plan(dataclasses.replace(inp, kmax=kmax, recent_max=bound,
                                             max_len=int(lengths.max())))
    assert dynamic is not None and static is not None
    assert static.recent_max == bound >= dynamic.recent_max
    assert torch.equal(static.recent_start, dynamic.recent_start)
    assert torch.equal(static.budget, dynamic.budget)
    if dynamic.indices is not None:
        assert static.indices is not None
        assert static.indices.shape[-1] <= policy.index_width(kmax)
        assert padded_equal(static.indices, dynamic.indices)
        return
    assert static.selector is not None and dynamic.selector is not None
    # quest's captured form: page bounds of every page of the key width in a QuestState
    state = QuestState.empty(layers, 4, 64 // page, hkv, dim, torch.device("cpu"))
    fixed = policy.plan(dataclasses.replace(inp, kmax=kmax, recent_max=bound,
                                            quest_state=state))
    assert fixed is not None and fixed.selector is not None
    q = torch.randn(3, 1, 2 * hkv, dim, generator=g)
    for layer in range(layers):
        want = dynamic.selector(layer, q, None)
        assert padded_equal(static.selector(layer, q, None), want)
        assert padded_equal(fixed.selector(layer, q, None), want)
        assert padded_equal(state.selector(3, page, -(-kmax // page))(layer, q, None), want)


# --- no host synchronisation inside an iteration ----------------------------------------------

class SyncGuard:
    """Makes the Tensor methods that read device values raise while armed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        for name in SYNCS:
            monkeypatch.setattr(torch.Tensor, name, self._forbid(name, getattr(torch.Tensor, name)))

    def _forbid(self, name: str, original: Callable) -> Callable:
        guard = self

        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if guard.armed:
                raise AssertionError(f"host sync inside an iteration: Tensor.{name}")
            return original(tensor, *args, **kwargs)

        return call

    def wrap(self, fn: Callable, armed: bool) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            before, self.armed = self.armed, armed
            try:
                return fn(*args, **kwargs)
            finally:
                self.armed = before

        return call


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_static_iteration_reads_the_device_once(static: LLM, eager: LLM, prompts: list[list[int]],
                                                method: dict[str, Any] | None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything in an iteration but `_commit` (the one host read) runs with the reading
    Tensor methods disabled; the first selection after prefill too."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 4, 13)]
    expected = [o.token_ids for o in eager.generate(prompts, params,
                                                    speculative=tiny_spec(method))]
    guard = SyncGuard(monkeypatch)
    calls: list[str] = []
    runner = static.engine.runner
    commit = guard.wrap(runner._commit, armed=False)
    iteration = guard.wrap(runner._iteration, armed=True)
    monkeypatch.setattr(runner, "_commit", lambda *a: calls.append("read") or commit(*a))
    monkeypatch.setattr(runner, "_iteration", lambda *a: calls.append("it") or iteration(*a))
    # the rows that leave, the selections after an iteration and after prefill
    for name in ("_leave", "_select", "_join"):
        monkeypatch.setattr(runner, name, guard.wrap(getattr(runner, name), True))
    outs = static.generate(prompts, params, speculative=tiny_spec(method))
    assert [o.token_ids for o in outs] == expected
    assert calls.count("read") == calls.count("it") >= 3


def test_fixed_shape_prefill_rounds_as_the_dynamic_one(static: LLM, eager: LLM,
                                                      prompts: list[list[int]]) -> None:
    """Uncaptured, the prefill buffers have the chunk's exact sizes: the same products as the
    dynamic path, so the same bits (static and eager runs then select alike)."""
    assert torch.equal(static.next_token_logits(prompts), eager.next_token_logits(prompts))


@pytest.mark.parametrize("method", [None, {"method": "vegas"}], ids=["vanilla", "vegas"])
def test_prefill_chunks_read_nothing_back(static: LLM, eager: LLM, prompts: list[list[int]],
                                          method: dict[str, Any] | None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed-shape prefill chunk (packing, copies, the forward, the last rows' logits and
    scores) runs with the reading Tensor methods disabled."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    expected = [o.token_ids for o in eager.generate(prompts, params,
                                                    speculative=tiny_spec(method))]
    guard = SyncGuard(monkeypatch)
    chunks: list[int] = []
    prefiller = static.engine.runner.prefiller
    chunk = guard.wrap(prefiller._chunk, armed=True)
    monkeypatch.setattr(prefiller, "_chunk", lambda *a: chunks.append(1) or chunk(*a))
    outs = static.generate(prompts, params, speculative=tiny_spec(method))
    assert [o.token_ids for o in outs] == expected and chunks == [1]


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU tensors reach Triton only through its interpreter (no CUDA)")
@pytest.mark.parametrize("method", ["vegas", "quest"])
def test_static_triton_equals_eager_triton(tiny: Path, prompts: list[list[int]], method: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels with the key axis at the page table's full width (Triton's interpreter on
    CPU), under the sync guard too."""
    calls = []

    def topk(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[0].shape)
        return topk_positions_triton(*args, **kwargs)

    def topk_sum(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[0].shape)
        return topk_sum_by_width(*args, **kwargs)

    # vegas ranks the sum of its verify scores' rows, quest its pages, with the backend's
    # own top-k
    monkeypatch.setattr(TritonBackend, "topk", staticmethod(topk))
    monkeypatch.setattr(TritonBackend, "topk_sum", staticmethod(topk_sum))
    engine = dict(ENGINE, backend="triton", max_model_len=40)
    plain, static = LLM(str(tiny), **engine), LLM(str(tiny), static_shapes=True, **engine)
    guard = SyncGuard(monkeypatch)
    runner = static.engine.runner
    monkeypatch.setattr(runner, "_commit", guard.wrap(runner._commit, armed=False))
    monkeypatch.setattr(runner, "_iteration", guard.wrap(runner._iteration, armed=True))
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 2, 4)]
    short = [p[:n] for p, n in zip(prompts, (12, 20, 30))]  # the interpreter is slow
    same_tokens(plain, static, short, params, {"method": method})
    assert calls


def test_the_guard_catches_the_eager_path(eager: LLM, prompts: list[list[int]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The dynamic path reads host bounds (the budget's max) inside the iteration."""
    guard, runner = SyncGuard(monkeypatch), eager.engine.runner
    monkeypatch.setattr(runner, "_commit", guard.wrap(runner._commit, armed=False))
    monkeypatch.setattr(runner, "_iteration", guard.wrap(runner._iteration, armed=True))
    monkeypatch.setattr(runner, "_select", guard.wrap(runner._select, armed=True))
    with pytest.raises(AssertionError, match=r"host sync inside an iteration: Tensor.__int__"):
        eager.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True),
                       speculative=tiny_spec({"method": "vegas"}))


def test_eager_path_is_untouched_by_static_buffers(eager: LLM, prompts: list[list[int]]) -> None:
    eager.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True),
                   speculative=tiny_spec({"method": "vegas"}))
    assert eager.engine.runner.graphs is None and eager.engine.runner.scratch_page == -1


# --- settings ---------------------------------------------------------------------------------

def test_buckets() -> None:
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 100, 128, 129)] == \
        [1, 2, 4, 4, 8, 8, 16, 128, 128, 256]
    assert buckets_upto(8) == [1, 2, 4, 8]


def test_graph_settings() -> None:
    cpu = EngineConfig()
    assert not cpu.graphs and not cpu.static
    assert EngineConfig(static_shapes=True).static
    assert not EngineConfig(cuda_graphs=False).graphs
    with pytest.raises(ConfigError, match="cuda_graphs needs device cuda"):
        EngineConfig(cuda_graphs=True)
    with pytest.raises(ConfigError, match="max_model_len must be >= 2"):
        EngineConfig(max_model_len=1)


def test_max_model_len_bounds_the_static_shapes(tiny: Path, prompts: list[list[int]]) -> None:
    llm = LLM(str(tiny), static_shapes=True, max_model_len=96, **ENGINE)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True),
                        speculative=tiny_spec({"method": "vegas"}))
    assert [len(o.token_ids) for o in outs] == [40, 40, 96 - LENGTHS[2]]
    graphs, cache = llm.engine.runner.graphs, llm.engine.runner.cache
    assert graphs is not None and graphs.kv_len == cache.pages_for(96 + 4) * 16
    # the selection ranks positions below max_model_len only (rows up to the end: above)
    assert graphs.shapes.rank_width == 96 < graphs.kv_len
    with pytest.raises(ConfigError, match="exceeds the model's 256 positions"):
        LLM(str(tiny), max_model_len=512, **ENGINE)


def test_cli_eager_flag() -> None:
    base = ["generate", "--prompt", "x"]
    assert "cuda_graphs" not in _engine_kwargs(_parser().parse_args(base))
    args = _parser().parse_args([*base, "--eager", "--max-model-len", "128"])
    assert _engine_kwargs(args)["cuda_graphs"] is False
    assert _engine_kwargs(args)["max_model_len"] == 128
    assert "narrowest_span" not in _engine_kwargs(args)
    spans = _parser().parse_args([*base, "--narrowest-span", "0"])
    assert _engine_kwargs(spans)["narrowest_span"] == 0


# --- CUDA graphs --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graphs_replay_equals_eager(tiny: Path, prompts: list[list[int]], backend: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Replays give the tokens of the same buffers run eagerly and of the dynamic path, and
    CUDA reports no synchronising call inside an iteration but the one in `_commit`."""
    cuda = dict(ENGINE, device="cuda", backend=backend)
    graphs = LLM(str(tiny), **cuda)  # on by default on CUDA
    static = LLM(str(tiny), cuda_graphs=False, static_shapes=True, **cuda)
    plain = LLM(str(tiny), cuda_graphs=False, **cuda)
    runner = graphs.engine.runner
    monkeypatch.setattr(runner, "_commit", sync_mode(runner._commit, "default"))
    monkeypatch.setattr(runner, "_iteration", sync_mode(runner._iteration, "error"))
    # a sampled round's graph is captured at its first use (capturing synchronises, once)
    monkeypatch.setattr(GraphRunner, "_capture_now",
                        sync_mode(GraphRunner._capture_now, "default"))
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (25, 3, 11)]
    sampled = [SamplingParams(max_tokens=n, ignore_eos=True, seed=i, temperature=t, top_p=p)
               for i, (n, t, p) in enumerate(((25, 0.8, 0.95), (3, 0.0, 1.0), (11, 1.0, 1.0)))]
    for method in METHODS:
        for batch in (params, sampled):
            same_tokens(static, graphs, prompts, batch, method)
            same_tokens(plain, graphs, prompts, batch, method)
        runner = graphs.engine.runner.graphs
        assert runner is not None and {b for _, b, _ in runner.graphs} == {1, 2, 4}
        if method is not None:
            assert {k for k, _, _ in runner.graphs} == {"spec", "filtered"}
        assert static.engine.runner.graphs is not None and not static.engine.runner.graphs.graphs
    assert plain.engine.runner.graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_at_narrower_key_widths_equal_eager(tiny: Path, prompts: list[list[int]],
                                                       spans: list[int]) -> None:
    """Graphs captured at key widths 32, 64, 128 and the whole replay the tokens, iterations
    and budgets of the same buffers run eagerly, greedy and seeded sampling, every method,
    the batch moving between the widths as its longest row grows and leaves."""
    cuda = dict(ENGINE, device="cuda", narrowest_span=32)
    graphs = LLM(str(tiny), **cuda)
    static = LLM(str(tiny), cuda_graphs=False, static_shapes=True, **cuda)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (120, 3, 11)]
    sampled = [SamplingParams(max_tokens=n, ignore_eos=True, seed=i, temperature=t, top_p=p)
               for i, (n, t, p) in enumerate(((120, 0.8, 0.95), (3, 0.0, 1.0), (11, 1.0, 1.0)))]
    for method in METHODS:
        for batch in (params, sampled):
            spans.clear()
            same_tokens(static, graphs, prompts, batch, method)
            assert set(spans) >= {1, 2, 3}
        runner = graphs.engine.runner.graphs
        assert runner is not None and {s for _, _, s in runner.graphs} == {0, 1, 2, 3}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_new_runner_captures_while_old_graph_memory_is_held(tiny: Path,
                                                             prompts: list[list[int]]) -> None:
    """Rebuilding the runner for another method must not join the old runner's memory pool:
    with a block of that pool still referenced, the allocator refuses a capture into it."""
    llm = LLM(str(tiny), **dict(ENGINE, device="cuda", dtype="float32"))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    llm.generate(prompts, params)
    assert llm.engine.runner.graphs is not None
    held = next(iter(llm.engine.runner.graphs.graphs.values())).out[0]  # a block of the old pool
    out = llm.generate(prompts, params, speculative={"method": "vegas", "min_tokens": 4})
    assert [o.token_ids for o in out] == [o.token_ids for o in llm.generate(prompts, params)]
    assert held.is_cuda


def sync_mode(fn: Callable, mode: str) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(before)

    return call


class _EagerGraph:
    """A stand-in for a captured graph on CPU: replay runs the body again into the tensors
    the capture returned, as a replay rewrites them."""

    def __init__(self, body: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        self.body = body

    def replay(self) -> None:
        for dst, src in zip(self.out, self.body()):
            dst.copy_(src)


@pytest.mark.parametrize("method", ["vegas", "quest"])
def test_a_kind_first_met_while_rows_decode_is_captured_for_every_bucket(
        tiny: Path, eager: LLM, prompts: list[list[int]], method: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled rounds and the adaptive plain step are captured at their first use, on the
    live buffers, for every bucket at once (rows that leave later meet no capture); the
    capture's warm-up run (here: the body run once more) leaves the plans as they were, so
    the tokens are the eager path's."""
    from vegas_spec.graphs import _Graph

    captured: list[tuple[str, int]] = []

    def fake_capture(self: GraphRunner, kind: str, bucket: int) -> _Graph:
        captured.append((kind, bucket))
        self._body(kind, bucket)  # the warm-up run a capture makes
        graph = _EagerGraph(lambda: self._body(kind, bucket))
        graph.out = tuple(t.clone() for t in self._body(kind, bucket))
        return _Graph(graph, graph.out)  # type: ignore[arg-type]

    init = GraphRunner.__init__

    def capturing(self: GraphRunner, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.capturing = True  # as on CUDA, every kind captured at its first use

    monkeypatch.setattr(GraphRunner, "_capture", fake_capture)
    monkeypatch.setattr(GraphRunner, "__init__", capturing)
    static = LLM(str(tiny), static_shapes=True, **ENGINE)
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=n, seed=i, ignore_eos=True)
              for i, n in enumerate((14, 6, 10))]
    same_tokens(eager, static, prompts, params, {"method": method})
    assert [k for k, _ in captured].count("topk") == 3  # buckets 4, 2 and 1, at the first
    assert {b for k, b in captured if k == "topk"} == {1, 2, 4}
