"""`report.md` of a bench run: the setting, one table of every cell, the acceptance at every
draft position, the losslessness of every method against vanilla, needle retrieval per depth,
the time split and the plots."""

from __future__ import annotations

from typing import Any

from vegas_spec.bench.analysis import NEAR_TIE, method_verdicts


def _f(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def _ctx(context: int | None) -> str:
    return "-" if context is None else str(context)


def header(meta: dict[str, Any], title: str) -> list[str]:
    s = meta["setting"]
    return [f"# {title}", "",
            f"Command: `{meta['command']}`", "",
            f"Date {meta['date']}; device {meta['device_name']}; model {s['model']}; "
            f"{s['dtype']}, {s['backend']} backend; torch {meta['torch']}.", "",
            _decoding(s), ""] + ([] if s.get("tokenizer", "the model's") == "the model's" else
                                 ["Random weights without a tokenizer: the prompts are the "
                                  "embedded default's tokens (timing only).", ""])


def sampling(s: dict[str, Any]) -> str:
    """`greedy`, or the sampling setting as the options give it (results written before
    top-p and top-k were recorded sampled without either)."""
    if s["temperature"] == 0:
        return "greedy"
    top_k = s.get("top_k", 0)
    return (f"sampled at temperature {s['temperature']:g}, top-p {s.get('top_p', 1.0):g}, "
            f"top-k {top_k if top_k else 'off'}, seed {s.get('seed', 0)}")


def _decoding(s: dict[str, Any]) -> str:
    how = sampling(s)
    return (f"Decoding: {how}, every sequence to its full length (end of sequence ignored); "
            f"min_tokens {s['spec']['min_tokens']}, score {s['spec']['score']}, collect "
            f"{s['spec']['collect']}, granularity {s['spec']['granularity']}. Speedups are "
            "decode throughputs over vanilla's on the same prompts in the same engine; the "
            "whole request (prefill, first token and decode) is timed too, and its speedup "
            "is vanilla's time over the method's.")


def _ratio(x: float | None, spread: list[float] | None) -> str:
    """A speedup, with the range its runs allow and `~` where that range holds 1.0 (noise:
    no speedup to speak of)."""
    if x is None or spread is None:
        return _f(x, 2, "x")
    lo, hi = spread
    return f"{x:.2f}x ({lo:.2f}-{hi:.2f}){' ~' if lo <= 1.0 <= hi else ''}"


def cell_table(lines: list[dict[str, Any]]) -> list[str]:
    out = ["| workload | context | batch | method | γ | ratio | decode tok/s | speedup | "
           "request s | request speedup | tokens/iter | slowest row | accept@1 | accept@γ | "
           "budget | = vanilla |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in lines:
        spec = r["method"] != "vanilla"
        same = f"{r['identical']}/{r['prompts']}" if r["identical"] is not None else "-"
        gamma, ratio = (str(r["gamma"]), f"{r['ratio']:g}") if spec else ("-", "-")
        out.append(
            f"| {r['workload']} | {_ctx(r['context'])} | {r['batch']} | {r['method']} | "
            f"{gamma} | {ratio} | "
            f"{_f(r['decode_tokens_per_s'], 1)} | "
            f"{_ratio(r['speedup'], r.get('speedup_range'))} | {_f(r.get('total_s'), 3)} | "
            f"{_ratio(r.get('request_speedup'), r.get('request_speedup_range'))} | "
            f"{_f(r['tokens_per_iteration'])} | "
            f"{_f(r.get('slowest_row_tokens_per_iteration'))} | {_f(r['acceptance_first'])} | "
            f"{_f(r['acceptance_last'])} | {_f(r['budget_mean'], 0)} | {same} "
            f"({r['verdict']}) |")
    return out


SLOWEST_NOTE = ("`slowest row`: the least tokens an iteration of any one sequence of the run "
                "shown; a batch decodes until its last sequence is done, so where this row "
                "lies well under the cell's tokens/iter, the batch's end ran with few rows "
                "and its throughput tells of that sequence more than of the mean.")


def repeats_note(lines: list[dict[str, Any]], sampled: bool = False) -> str:
    runs = max((r.get("repeats", 1) for r in lines), default=1)
    if runs == 1:
        return ("Each cell was timed once (`--repeats 1`): a speedup has no range to tell it "
                "from noise.")
    seeds = (" Sampled run i draws with seed + i (the same seeds for every method), so the "
             "runs are as many sampled texts." if sampled else "")
    return (f"Each cell was timed {runs} times (`--repeats`): its figures are the run of median "
            "decode throughput; a speedup's range, (least-most), is the cell's slowest run "
            "against vanilla's fastest and its fastest against vanilla's slowest, and `~` "
            "marks a range that holds 1.00: noise, not a speedup." + seeds)


def acceptance_section(lines: list[dict[str, Any]]) -> list[str]:
    """Per speculative cell, the share of its iterations (every sequence of the batch) that
    accepted the draft at position j, for j = 1..γ, of those that drafted it: draft j is
    accepted when the iteration emits more than j tokens (adaptive speculation may draft
    fewer than γ)."""
    rows = [r for r in lines if r["method"] != "vanilla" and r.get("acceptance_per_position")]
    if not rows:
        return []
    width = max(len(r["acceptance_per_position"]) for r in rows)
    out = ["## Acceptance per draft position", "",
           "Share of each cell's decode iterations that drafted position j, over every "
           "sequence of the batch, in which that draft was accepted (position j is accepted "
           "when the iteration emits more than j tokens; adaptive speculation drafts γ, 2γ/3 or "
           "γ/3 tokens an iteration).", "",
           "| workload | context | batch | method | γ | ratio | "
           + " | ".join(f"@{j}" for j in range(1, width + 1))
           + " | plain steps; rounds × draft length |",
           "|---|---:|---:|---|---:|---:|" + "---:|" * width + "---|"]
    for r in rows:
        acc = r["acceptance_per_position"]
        rates = [_f(acc[j]) if j < len(acc) else "-" for j in range(width)]
        out.append(f"| {r['workload']} | {_ctx(r['context'])} | {r['batch']} | {r['method']} "
                   f"| {r['gamma']} | {r['ratio']:g} | " + " | ".join(rates)
                   + f" | {_choices(r)} |")
    return out + [""]


def _choices(line: dict[str, Any]) -> str:
    """A cell's plain steps and its rounds by draft length ("12; 30 × 6, 4 × 2"), "-" where
    the results predate them."""
    lengths = line.get("draft_lengths") or []
    if not lengths:
        return "-"
    rounds = ", ".join(f"{n} × {g}" for g, n in reversed(list(enumerate(lengths, 1))) if n)
    return f"{line.get('plain_steps') or 0}; {rounds or 'none'}"


def lossless_section(lines: list[dict[str, Any]], dtype: str) -> list[str]:
    out = ["## Same output as vanilla", "",
           f"A speculative method is lossless: under greedy decoding its output is vanilla's "
           f"token for token. In {dtype} the verify pass and a plain step may round a near-tie "
           f"the other way; a parting counts as a near-tie when the plain run's top two logits "
           f"lie within {NEAR_TIE.get(dtype, 0):g} of each other there.", ""]
    for method, m in method_verdicts(lines).items():
        if method == "vanilla":
            continue
        if m["verdict"] == "identical":
            text = f"identical to vanilla in all {m['prompts']} outputs"
        elif m["verdict"] == "near-ties":
            text = (f"identical in {m['identical']}/{m['prompts']} outputs; the others part "
                    f"only at near-ties (largest plain top-2 margin {m['largest_margin']:.4g})")
        elif m["verdict"] == "sampled":
            text = ("sampled, not compared token for token (lossless in distribution: "
                    "speculative rejection sampling)")
        elif m["verdict"] == "no vanilla":
            text = "no vanilla cell to compare with"
        else:
            text = (f"**differs from vanilla**: identical in {m['identical']}/{m['prompts']}, "
                    f"largest plain top-2 margin at a parting {_f(m['largest_margin'], 4)}")
        out.append(f"- **{method}**: {text}.")
    return out + [""]


def needle_section(lines: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in lines if r["needle"] is not None]
    if not rows:
        return []
    depths = sorted({d for r in rows for d in r["needle"]}, key=float)
    out = ["## Needle in a haystack", "",
           "Found = the magic number appears in the output; it must be found in the same "
           "prompts as by vanilla.", "",
           "| context | batch | method | " + " | ".join(f"depth {d}" for d in depths)
           + " | same as vanilla |", "|---:|---:|---|" + "---:|" * len(depths) + "---|"]
    for r in rows:
        cells = [f"{r['needle'][d][0]}/{r['needle'][d][1]}" if d in r["needle"] else "-"
                 for d in depths]
        same = r["needle_same_as_vanilla"]
        out.append(f"| {_ctx(r['context'])} | {r['batch']} | {r['method']} | "
                   + " | ".join(cells) + f" | {'-' if same is None else 'yes' if same else 'NO'} |")
    return out + [""]


def split_section(lines: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in lines if r["time_split"] and r["method"] != "vanilla"]
    if not rows:
        return []
    # a round replayed as one CUDA graph is timed whole; without graphs (a CPU) there is none
    graphs = any(r["time_split"].get("round", 0.0) > 0 for r in rows)
    parts = ("draft", "verify", *(("round",) if graphs else ()), "selection", "acceptance",
             "other")
    out = ["## Where the decode time goes", "",
           "Share of the decode loop's time. " + (
               "`round` is a greedy round replayed as one CUDA graph (drafts, verify, "
               "acceptance and the next selection together: the engine does not time its "
               "parts); " if graphs else "") + "`other` is what no phase timer covers (host "
           "work, launches).", "",
           "| workload | context | batch | method | " + " | ".join(parts) + " |",
           "|---|---:|---:|---|" + "---:|" * len(parts)]
    for r in rows:
        shares = " | ".join(_f(100 * r["time_split"].get(k, 0.0), 1, "%") for k in parts)
        out.append(f"| {r['workload']} | {_ctx(r['context'])} | {r['batch']} | "
                   f"{r['method']} | {shares} |")
    return out + [""]


def bench_report(meta: dict[str, Any], lines: list[dict[str, Any]], plots: list[str]) -> str:
    parts = [*header(meta, "vegas bench"), "## Every cell", "", *cell_table(lines), "",
             repeats_note(lines, meta["setting"]["temperature"] != 0), "", SLOWEST_NOTE, "",
             *acceptance_section(lines),
             *lossless_section(lines, meta["setting"]["dtype"]), *needle_section(lines),
             *split_section(lines)]
    if plots:
        parts += ["## Plots", ""] + [f"![{p[:-4]}]({p})" for p in plots] + [""]
    return "\n".join(parts)
