"""The Triton compute seams (TritonBackend, TritonOps) against the torch ones (TorchBackend,
TorchOps) on a tiny random Llama, Qwen3 (q/k norm) and gpt-oss (attention sinks, a sliding
window on every other layer, biased and clamped experts): prefill with scores, a batch of
sparse draft steps planned from them, and a verify step with a ScoreRequest, as the engine
drives them; logits, scores and caches must agree. Also which rows the backend's top-k hands
to the Triton kernel."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernel_cases import DEVICE, generator

from vegas_spec import ops
from vegas_spec.attention.backend import make_backend
from vegas_spec.attention.context import ScoreRequest, SparsePlan, StepContext
from vegas_spec.cache import slots_of
from vegas_spec.compute.base import make_ops
from vegas_spec.config import ModelConfig, SpecConfig
from vegas_spec.kernels import topk
from vegas_spec.models.decoder import Decoder, build_model
from vegas_spec.models.loader import expected_shapes
from vegas_spec.ops import topk_positions  # bound here: `TopkCalls` spies on ops' name
from vegas_spec.speculative.policies import SelectionInput, make_policy

PAGE = 16
GAMMA = 3
PROMPTS = (45, 29)
HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 128,
      "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 6,
      "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 256,
      "rms_norm_eps": 1e-6, "eos_token_id": 2}


# gpt-oss's own fields: a window shorter than the prompts, experts whose clamp bites.
OSS = {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 12,
       "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 0.5}


def tiny_model(architecture: str) -> Decoder:
    extra = OSS if architecture == "GptOssForCausalLM" else {}
    cfg = ModelConfig.from_hf({**HF, **extra, "architectures": [architecture]})
    gen = generator(0)
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        noise = torch.randn(*shape, generator=gen)
        weights[name] = 1 + 0.1 * noise if name.endswith("norm.weight") else \
            noise + 1 if name.endswith("sinks") else 0.15 * noise
    return build_model(cfg, weights, torch.float32, DEVICE)


class Runner:
    """One backend's seams (`name`: torch or triton) with its own paged cache; steps are
    built like LLM._ctx builds them."""

    def __init__(self, model: Decoder, name: str) -> None:
        cfg = model.cfg
        self.model, self.ops, self.attn = model, make_ops(name), make_backend(name)
        shape = (len(PROMPTS) * 8 * PAGE, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [(torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE))
                       for _ in range(cfg.num_layers)]
        self.page_table = torch.arange(len(PROMPTS) * 8, device=DEVICE, dtype=torch.int32)
        self.page_table = self.page_table.view(8, len(PROMPTS)).T.contiguous()  # interleaved

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                rows: list[int] | None = None, mode: str = "weight", per_kv_head: bool = False,
                plan: SparsePlan | None = None, seqs: slice = slice(None),
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg, table = self.model.cfg, self.page_table[seqs]
        req = None
        if rows is not None:
            groups = cfg.num_kv_heads if per_kv_head else 1
            out = torch.full((cfg.num_layers, tokens.shape[0], len(rows), groups, kv_len),
                             float("nan"), device=DEVICE)
            req = ScoreRequest(torch.tensor(rows, device=DEVICE), out, mode, per_kv_head)
        ctx = StepContext(positions=positions,
                          slot_mapping=slots_of(table, positions, PAGE), page_table=table,
                          page_size=PAGE, kv_len_max=kv_len, scores=req, sparse=plan)
        hidden = self.model(tokens, ctx, self.caches, self.ops, self.attn)
        return self.model.logits(hidden, self.ops), None if req is None else req.out


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_make_backend_and_make_ops_register_triton() -> None:
    assert make_backend("triton").name == make_ops("triton").name == "triton"


@pytest.mark.parametrize("mode,per_kv_head,architecture", [
    ("weight", False, "LlamaForCausalLM"), ("logit", True, "Qwen3ForCausalLM"),
    ("weight", True, "GptOssForCausalLM")])
def test_same_logits_as_torch_backend(mode: str, per_kv_head: bool, architecture: str) -> None:
    torch.manual_seed(0)
    model = tiny_model(architecture)
    assert model.cfg.qk_norm == (architecture == "Qwen3ForCausalLM")
    oss = architecture == "GptOssForCausalLM"
    assert model.cfg.sinks == oss and any(model.cfg.layer_windows) == oss
    runs = [Runner(model, "torch"), Runner(model, "triton")]
    gen = generator(1)
    prompts = [torch.randint(3, 96, (1, n), generator=gen).to(DEVICE) for n in PROMPTS]

    # prefill each prompt alone, scores of its last row
    firsts, prefill_scores = [], []
    for b, ids in enumerate(prompts):
        n = ids.shape[1]
        pos = torch.arange(n, device=DEVICE)[None]
        (want, want_sc), (got, got_sc) = [r.forward(ids, pos, n, [n - 1], mode, per_kv_head,
                                                    seqs=slice(b, b + 1)) for r in runs]
        close(got, want)
        close(got_sc, want_sc)
        firsts.append(want[0, -1].argmax())
        prefill_scores.append(torch.nn.functional.pad(want_sc, (0, max(PROMPTS) - n)))

    # plan the drafts from the prefill rows, as the vegas policy does
    lengths = torch.tensor(PROMPTS, device=DEVICE)
    rankable = lengths - 1
    budget = torch.tensor([8, 5], device=DEVICE)
    indices = topk_positions(torch.cat(prefill_scores, 1).sum(2), rankable, budget)
    recent_max = int((lengths + GAMMA - rankable).max())
    plan = SparsePlan(indices, rankable, recent_max, budget)

    token = torch.stack(firsts)
    drafts = []
    for j in range(GAMMA):
        pos = lengths[:, None] + j
        (want, _), (got, _) = [r.forward(token[:, None], pos, max(PROMPTS) + GAMMA, plan=plan)
                               for r in runs]
        close(got, want)
        token = want[:, -1].argmax(-1)
        drafts.append(token)

    tokens = torch.cat([torch.stack(firsts)[:, None], torch.stack(drafts, 1)], 1)
    pos = lengths[:, None] + torch.arange(GAMMA + 1, device=DEVICE)
    rows = sorted({0, GAMMA})
    (want, want_sc), (got, got_sc) = [r.forward(tokens, pos, max(PROMPTS) + GAMMA + 1, rows,
                                                mode, per_kv_head) for r in runs]
    close(got, want)
    close(got_sc, want_sc)
    for (k_want, v_want), (k_got, v_got) in zip(runs[0].caches, runs[1].caches, strict=True):
        close(k_got, k_want)
        close(v_got, v_want)


def test_quest_draft_steps_as_torch_backend() -> None:
    """quest's draft steps (a per-layer selector: page scores of the q the Triton backend
    rotates inside the page-score kernel, then RoPE and the KV store inside the sparse
    attention) against the torch backend's (rope_store, reference page scores and top-k),
    from the same caches: logits and caches agree."""
    torch.manual_seed(0)
    model = tiny_model("LlamaForCausalLM")
    runs = [Runner(model, "torch"), Runner(model, "triton")]
    gen = generator(2)
    firsts = []
    for b, n in enumerate(PROMPTS):
        ids = torch.randint(3, 96, (1, n), generator=gen).to(DEVICE)
        logits, _ = runs[0].forward(ids, torch.arange(n, device=DEVICE)[None], n,
                                    seqs=slice(b, b + 1))
        firsts.append(logits[0, -1].argmax())
    for (k_src, v_src), (k_dst, v_dst) in zip(runs[0].caches, runs[1].caches, strict=True):
        k_dst.copy_(k_src)
        v_dst.copy_(v_src)
    lengths = torch.tensor(PROMPTS, device=DEVICE)
    policy = make_policy(SpecConfig(method="quest", gamma=GAMMA, ratio=0.3, min_tokens=8,
                                    page=4))
    plans = [policy.plan(SelectionInput(None, lengths - 1, torch.zeros_like(lengths), lengths,
                                        GAMMA, r.caches, r.page_table, PAGE)) for r in runs]
    assert all(p is not None and p.selector is not None for p in plans)
    token = torch.stack(firsts)
    for j in range(GAMMA):
        pos = lengths[:, None] + j
        (want, _), (got, _) = [r.forward(token[:, None], pos, max(PROMPTS) + GAMMA, plan=p)
                               for r, p in zip(runs, plans, strict=True)]
        close(got, want)
        token = want[:, -1].argmax(-1)
    for (k_want, v_want), (k_got, v_got) in zip(runs[0].caches, runs[1].caches, strict=True):
        close(k_got, k_want)
        close(v_got, v_want)


class TopkCalls:
    """Spies on the Triton top-k and the reference: the row widths each was called with."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kernel: list[int] = []
        self.reference: list[int] = []
        self.summed: list[tuple[int, ...]] = []  # shapes the row-summing kernel ranked
        kernel, reference = topk.topk_positions_triton, ops.topk_positions
        summing = topk.topk_row_sum_triton

        def spy_summing(scores: torch.Tensor, *args: object) -> torch.Tensor:
            self.summed.append(tuple(scores.shape))
            return summing(scores, *args)

        def spy_kernel(scores: torch.Tensor, *args: object) -> torch.Tensor:
            self.kernel.append(scores.shape[-1])
            return kernel(scores, *args)

        def spy_reference(scores: torch.Tensor, *args: object) -> torch.Tensor:
            self.reference.append(scores.shape[-1])
            return reference(scores, *args)

        monkeypatch.setattr(topk, "topk_positions_triton", spy_kernel)
        monkeypatch.setattr(topk, "topk_row_sum_triton", spy_summing)
        monkeypatch.setattr(ops, "topk_positions", spy_reference)


def narrowed(monkeypatch: pytest.MonkeyPatch,
             name: str) -> tuple[TopkCalls, Callable[..., torch.Tensor]]:
    """Spies on the top-k paths with RESIDENT_MAX_WIDTH made 64 (read at each call), and the
    Triton backend's top-k `name` ("topk" or "topk_sum")."""
    calls = TopkCalls(monkeypatch)
    monkeypatch.setattr(topk, "RESIDENT_MAX_WIDTH", 64)
    top = getattr(make_backend("triton"), name)
    assert top is not None
    return calls, top


def test_topk_runs_the_kernel_up_to_the_resident_width(monkeypatch: pytest.MonkeyPatch,
                                                       ) -> None:
    """The backend's top-k (the bound made small, read at each call): a row of at most
    RESIDENT_MAX_WIDTH scores goes to the Triton kernel, a wider one to the reference, whose
    positions it returns as they are (quest's pages, a bound kmax and a limit passed on)."""
    calls, top = narrowed(monkeypatch, "topk")
    gen = generator(3)
    rank, k = torch.tensor([64, 33], device=DEVICE), torch.tensor([9, 33], device=DEVICE)
    narrow = torch.randn(2, 2, 1, 64, generator=gen).to(DEVICE)
    got = top(narrow, rank, k)
    assert calls.kernel == [64] and calls.reference == []
    assert torch.equal(got, topk_positions(narrow, rank, k))
    wide = torch.randn(2, 2, 1, 65, generator=gen).to(DEVICE)
    ranked, limit = torch.tensor([65, 40], device=DEVICE), torch.tensor([259, 160], device=DEVICE)
    got = top(wide, ranked, k, 40, 4, limit)
    assert calls.kernel == [64] and calls.reference == [65]
    assert got.shape == (2, 2, 1, 40 * 4)
    assert torch.equal(got, topk_positions(wide, ranked, k, 40, 4, limit))


def test_topk_sum_sums_up_to_two_rows_in_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's top-k of summed rows: vegas's two collected rows (or one) of at most
    RESIDENT_MAX_WIDTH scores go to the row-summing kernel; more rows are summed first and
    ranked by `topk`, wider rows by the reference; every path gives the reference's plan."""
    calls, top = narrowed(monkeypatch, "topk_sum")
    gen = generator(6)
    rank, k = torch.tensor([60, 33], device=DEVICE), torch.tensor([9, 33], device=DEVICE)
    for rows, width, summed, kernel, reference in ((2, 64, [(3, 2, 2, 1, 64)], [], []),
                                                   (1, 64, [(3, 2, 1, 1, 64)], [], []),
                                                   (3, 64, [], [64], []),
                                                   (2, 65, [], [], [65])):
        calls.summed, calls.kernel, calls.reference = [], [], []
        scores = torch.rand(3, 2, rows, 1, width, generator=gen).to(DEVICE)
        got = top(scores, rank, k, 40)
        assert (calls.summed, calls.kernel, calls.reference) == (summed, kernel, reference)
        assert torch.equal(got, topk_positions(scores.sum(-3), rank, k, 40))


def test_topk_of_rows_wider_than_the_kernel_is_the_reference(monkeypatch: pytest.MonkeyPatch,
                                                             ) -> None:
    """At the real bound: vegas's token scores of a context past RESIDENT_MAX_WIDTH."""
    calls = TopkCalls(monkeypatch)
    width = topk.RESIDENT_MAX_WIDTH + 1
    scores = torch.randn(1, 2, 1, width, generator=generator(4)).to(DEVICE)
    rank, k = torch.tensor([width - 3, 5000], device=DEVICE), torch.tensor([700, 9], device=DEVICE)
    got = make_backend("triton").topk(scores, rank, k)
    assert calls.kernel == [] and calls.reference == [width]
    assert torch.equal(got, topk_positions(scores, rank, k))
