"""How far each kind of draft weights moves the model's next-token distribution, measured on
the same texts for every kind (paired, so a sampled cell's luck of the draw cancels out).

`draft_weights_acceptance.py` counts tokens per iteration, which under sampling depends on
the texts a run happens to draw: one kind of copies draws other texts than the next, and a
16-prompt sampled cell moves by several percent from draw to draw. Here every kind reads the
same contexts. For each workload of `vegas bench` (essays and code: prompts of about
--tokens tokens; generation: the chat questions) the model writes --new-tokens tokens once,
greedy and once sampled at the reference setting (temperature 0.6, top-p 0.95, top-k 20);
then, at every one of those positions, the model's weights give the target's probabilities p
and the copies (each projection of every layer dequantised, as a draft step reads it; full
attention both times, so that only the weights differ) give q, and

  * greedy: `disagree`, the share of positions where argmax q != argmax p;
  * sampled: `loss`, the mean of 1 - Σ min(p, q) over the filtered distributions: the total
    variation between the two.

The copies compute every position here, the keys and values of its context too, where a
draft step reads the context's keys and values as the model wrote them: the figures are on
the high side of what a draft's copies change. A real draft also attends to a selection,
which moves its distribution too. Its acceptance at a
position is 1 - TV(p, q_draft), and TV(p, q_draft) <= TV(p, q_selection) + TV(q_selection,
q_draft): a copy lowers a sampled draft's acceptance by at most about its `loss` (its
distance to the model, taken here at full attention), and a greedy draft's by at most its
`disagree`. With --rates (results files of `draft_weights_acceptance.py`), each cell also
gives the tokens per iteration of vegas's model-weight drafts at γ 6 (1 + the sum of the
shares of rounds that accepted draft j) and the same with each draft's acceptance given the
drafts before it lowered by the copy's figure: the bound on what the copies cost.

    python benchmarks/draft_weights_agreement.py --kinds fp8 int8 int4 --prompts 8 \\
        --new-tokens 128 --rates acceptance.json --out agreement.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from common import TEXTS, rotated_prompts

from vegas_spec import LLM, SamplingParams
from vegas_spec.bench.workloads import generation_prompts
from vegas_spec.quant import QUANTIZERS
from vegas_spec.sampling import BatchSampling, probs

SAMPLED = dict(temperature=0.6, top_p=0.95, top_k=20)
WORKLOADS = ("essays", "code", "generation")


def prompts_of(llm: LLM, workload: str, count: int, tokens: int) -> list[list[int]]:
    """A workload's prompts: chat questions, or `count` texts of about `tokens` tokens,
    each from another text onwards."""
    if workload == "generation":
        return [p.ids for p in generation_prompts(llm.tokenizer, count)]
    return rotated_prompts(llm.tokenizer, TEXTS[workload](), count, tokens)


@contextmanager
def copies_read(llm: LLM, kind: str) -> Iterator[None]:
    """Within: every projection of every layer holds its `kind` copy, dequantised to the
    model's dtype (what a draft step reads), instead of the model's weight."""
    saved = []
    for layer in llm.engine.runner.model.layers:
        for name in layer.projections:
            linear = getattr(layer, name)
            saved.append((linear, linear.weight.data))
            linear.weight.data = QUANTIZERS[kind](linear.weight.data).dequantize(
                linear.weight.dtype)
    try:
        yield
    finally:
        for linear, data in saved:
            linear.weight.data = data


def next_logits(llm: LLM, texts: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Per (prompt, written) text, the logits [len(written), V] that predict each written
    token."""
    out = []
    for prompt, written in texts:
        logits = llm.logits(prompt + written)
        out.append(logits[len(prompt) - 1: len(prompt) + len(written) - 1].float().clone())
    return out


def figures(target: list[torch.Tensor], copy: list[torch.Tensor],
            sampling: BatchSampling | None) -> float:
    """Greedy (`sampling` None): the share of positions whose argmax differs; sampled: the
    mean total variation 1 - Σ min(p, q) of the filtered distributions."""
    if sampling is None:
        parted = sum(int((p.argmax(-1) != q.argmax(-1)).sum()) for p, q in zip(target, copy))
        return parted / sum(p.shape[0] for p in target)
    loss = [1.0 - torch.minimum(probs(p[None], sampling)[0], probs(q[None], sampling)[0])
            .sum(-1) for p, q in zip(target, copy)]
    return float(torch.cat(loss).mean())


def tokens_per_iteration(rates: list[float], lowered_by: float = 0.0) -> float:
    """`rates`: the share of rounds whose draft j was accepted (every draft before it too),
    as the engine reports them -> 1 + Σ_j of them, with each draft's acceptance given the
    ones before it (rate j over rate j - 1) lowered by `lowered_by` (at least 0)."""
    out, run, before = 1.0, 1.0, 1.0
    for a in rates:
        given = a / before if before > 0 else 0.0
        run *= max(0.0, given - lowered_by)
        out += run
        before = a
    return out


def model_rates(paths: list[Path]) -> dict[tuple[str, str], list[float]]:
    """(workload, greedy|sampled) -> the per-position acceptance of vegas's drafts on the
    model's weights, from `draft_weights_acceptance.py` results files (a later file's cell
    replaces an earlier one's)."""
    out = {}
    for path in paths:
        for c in json.loads(path.read_text())["cells"]:
            if c["draft_weights"] == "model" and c["method"] == "vegas" and \
                    c.get("keep", "none") == "none":
                out[(c["workload"], c["sampling"])] = c["acceptance_rate_per_position"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kinds", nargs="+", default=["fp8", "int8", "int4"],
                    choices=sorted(QUANTIZERS))
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1500, help="essays and code: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens the model writes")
    ap.add_argument("--rates", type=Path, nargs="+", default=[],
                    help="draft_weights_acceptance.py results: each cell's bound on τ")
    ap.add_argument("--kv-cache-gb", type=float, default=0.5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.prompts < 1 or args.new_tokens < 1:
        raise SystemExit("--prompts and --new-tokens must be at least 1")
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)))
    rates = model_rates(args.rates)
    sampled = BatchSampling.build([SamplingParams(**SAMPLED)], torch.device("cpu"))
    cells = []
    for workload in args.workloads:
        prompts = prompts_of(llm, workload, args.prompts, args.tokens)
        for mode in ("greedy", "sampled"):
            params = [SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, seed=i,
                                     **(SAMPLED if mode == "sampled" else {}))
                      for i in range(len(prompts))]
            written = [o.token_ids for o in llm.generate(prompts, params)]
            texts = list(zip(prompts, written))
            target = next_logits(llm, texts)
            for kind in args.kinds:
                with copies_read(llm, kind):
                    copy = next_logits(llm, texts)
                figure = figures(target, copy, sampled if mode == "sampled" else None)
                cell = {"workload": workload, "sampling": mode, "kind": kind,
                        "positions": sum(len(w) for w in written),
                        ("loss" if mode == "sampled" else "disagree"): figure}
                base = rates.get((workload, mode))
                if base is not None:
                    tau = tokens_per_iteration(base)
                    cell["tokens_per_iteration_model"] = tau
                    cell["tokens_per_iteration_bound"] = tokens_per_iteration(base, figure)
                    cell["bound_change"] = cell["tokens_per_iteration_bound"] / tau - 1.0
                cells.append(cell)
                print(json.dumps(cell), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
