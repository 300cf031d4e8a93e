"""What the cells say, derived in one place for results.json, report.md, the plots and tune:
speedup over vanilla, losslessness, needle retrieval and the time split. Plain functions over
the rows that `runner` writes (dicts), no model."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

# A greedy output may part from vanilla's only where the plain run's top two logits lie this
# close: about four units in the last place of a logit near 16-32 in that type, where the
# verify pass (γ+1 rows) and a plain step round sums in another order.
NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.0625}
# Time split of a decode loop: the engine's phase timers, the rest is `other`. `round` is a
# whole greedy round replayed as one CUDA graph (drafts, verify, acceptance and the next
# selection together; the engine times it as one phase).
SPLIT = (("draft", "draft"), ("verify", "verify"), ("round", "speculate"),
         ("selection", "select"), ("acceptance", "accept"))


def baseline(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in rows if r["group"] == row["group"] and r["method"] == "vanilla"),
                None)


def speedup(row: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    """Decode throughput over vanilla's on the same prompts (None: one is not measured)."""
    if base is None or not row.get("decode_tokens_per_s") or not base.get("decode_tokens_per_s"):
        return None
    return row["decode_tokens_per_s"] / base["decode_tokens_per_s"]


def request_speedup(row: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    """The whole request (prefill, first token and decode) in vanilla's time over this
    cell's, on the same prompts (None: one is not measured)."""
    if base is None or not row.get("total_s") or not base.get("total_s"):
        return None
    return base["total_s"] / row["total_s"]


def speedup_range(row: dict[str, Any], base: dict[str, Any] | None,
                  key: str = "decode_tokens_per_s") -> list[float] | None:
    """The least and the most a speedup can be from the timed runs: the cell's slowest run
    against vanilla's fastest, and its fastest against vanilla's slowest. key: a throughput
    (decode_tokens_per_s: higher is faster) or a time (total_s). None: one run each, or a
    run not timed."""
    runs, plain = row.get(f"{key}_runs") or [], (base or {}).get(f"{key}_runs") or []
    timed = [x for x in runs + plain if x]  # None or 0: a run too short to time
    if row["method"] == "vanilla" or min(len(runs), len(plain)) < 2 or \
            len(timed) < len(runs) + len(plain):
        return None
    if key == "total_s":  # a time: vanilla's over the cell's
        return [min(plain) / max(runs), max(plain) / min(runs)]
    return [min(runs) / max(plain), max(runs) / min(plain)]


def noise(spread: list[float] | None) -> bool | None:
    """Whether a speedup's range holds 1.0: then the runs do not tell it from no speedup
    (None: no range, one run each)."""
    return None if spread is None else spread[0] <= 1.0 <= spread[1]


def near_tie(margin: float, dtype: str, exact: bool = False) -> bool:
    """Whether a greedy parting from vanilla where the plain run's top-2 logit margin is
    `margin` can be rounding: within NEAR_TIE of the dtype, and never in exact mode, where
    every step computes each row the same way (a parting there is a bug)."""
    return not exact and margin <= NEAR_TIE.get(dtype, 0.0)


def count_partings(partings: list[dict[str, Any]], dtype: str,
                   exact: bool = False) -> dict[str, int]:
    """near_ties: partings that rounding explains; mismatches: the others."""
    near = sum(near_tie(p["margin"], dtype, exact) for p in partings)
    return {"near_ties": near, "mismatches": len(partings) - near}


def lossless(row: dict[str, Any], base: dict[str, Any] | None, dtype: str,
             exact: bool = False) -> dict[str, Any]:
    """identical: outputs equal to vanilla's; verdict: `identical`, `near-ties` (every
    parting at a plain top-2 margin within NEAR_TIE; none in exact mode), `DIFFERS`,
    `sampled` (not compared token for token) or `no vanilla` (not measured)."""
    if row["method"] == "vanilla":
        return {"identical": len(row["token_ids"]), "verdict": "identical"}
    if base is None:
        return {"identical": None, "verdict": "no vanilla"}
    same = sum(a == b for a, b in zip(row["token_ids"], base["token_ids"]))
    if "partings" not in row:
        return {"identical": same, "verdict": "sampled"}
    margins = [p["margin"] for p in row["partings"]]
    largest = max(margins) if margins else None
    if not margins:
        verdict = "identical"
    elif count_partings(row["partings"], dtype, exact)["mismatches"] == 0:
        verdict = "near-ties"
    else:
        verdict = "DIFFERS"
    return {"identical": same, "largest_margin": largest, "verdict": verdict}


def time_split(row: dict[str, Any]) -> dict[str, float]:
    """Share of the decode loop's time per phase, `other` the rest (launches, host work,
    bookkeeping); plain decoding is all `decode`."""
    phases, total = row.get("phase_s", {}), row.get("decode_s") or 0.0
    if total <= 0:
        return {}
    if row["method"] == "vanilla":
        return {"decode": 1.0}
    out = {name: phases.get(key, 0.0) / total for name, key in SPLIT}
    out["other"] = max(0.0, 1.0 - sum(out.values()))
    return out


def needle(row: dict[str, Any]) -> dict[str, list[int]] | None:
    """Per depth (as text): [found, prompts]."""
    if "needle" not in row:
        return None
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for item in row["needle"]:
        entry = out[f"{item['depth']:g}"]
        entry[0] += bool(item["found"])
        entry[1] += 1
    return dict(sorted(out.items(), key=lambda kv: float(kv[0])))


def same_needles(row: dict[str, Any], base: dict[str, Any] | None) -> bool | None:
    """Whether every prompt's needle was found exactly where vanilla found it."""
    if "needle" not in row or base is None or "needle" not in base:
        return None
    return [n["found"] for n in row["needle"]] == [n["found"] for n in base["needle"]]


def slowest_row(row: dict[str, Any]) -> float | None:
    """The least tokens an iteration of any one sequence of a speculative cell (None for
    vanilla): a batch decodes until its last sequence is done, so with more than one
    sequence this row, not the mean, sets how long the tail of the batch runs alone."""
    per_row = [t for t in row.get("per_prompt_tokens_per_iteration") or [] if t is not None]
    return min(per_row) if per_row and row.get("method") != "vanilla" else None


def summary(rows: list[dict[str, Any]], dtype: str,
            exact: bool = False) -> list[dict[str, Any]]:
    """One line per cell: what the report's tables show (exact: no parting is a near-tie)."""
    out = []
    for row in rows:
        base = baseline(rows, row)
        acc = row.get("acceptance_rate_per_position") or []
        spread, whole = speedup_range(row, base), speedup_range(row, base, "total_s")
        out.append({
            "key": row["key"], "workload": row["workload"], "context": row["context"],
            "batch": row["batch"], "method": row["method"], "gamma": row["gamma"],
            "ratio": row["ratio"], "decode_tokens_per_s": row.get("decode_tokens_per_s"),
            "speedup": speedup(row, base), "speedup_range": spread, "noise": noise(spread),
            "total_s": row.get("total_s"), "request_speedup": request_speedup(row, base),
            "request_speedup_range": whole, "request_noise": noise(whole),
            "repeats": row.get("repeats", 1),
            "tokens_per_iteration": row.get("tokens_per_iteration"),
            "slowest_row_tokens_per_iteration": slowest_row(row),
            "acceptance_first": acc[0] if acc else None,
            "acceptance_last": acc[-1] if acc else None,
            "acceptance_per_position": list(acc),  # draft positions 1..γ; [] for vanilla
            # rounds by draft length 1..γ, and plain steps (adaptive speculation's choices)
            "draft_lengths": list(row.get("draft_length_histogram") or []),
            "plain_steps": row.get("plain_steps"),
            "budget_mean": row.get("budget_mean"), "prompts": len(row["token_ids"]),
            **lossless(row, base, dtype, exact), "needle": needle(row),
            "needle_same_as_vanilla": same_needles(row, base),
            "time_split": time_split(row)})
    return out


def method_verdicts(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method over all its cells: the worst verdict, outputs identical / compared, and
    the largest margin of a parting."""
    order = ["identical", "near-ties", "sampled", "no vanilla", "DIFFERS"]
    out: dict[str, dict[str, Any]] = {}
    for line in lines:
        m = out.setdefault(line["method"], {"verdict": "identical", "identical": 0,
                                            "prompts": 0, "largest_margin": None})
        if order.index(line["verdict"]) > order.index(m["verdict"]):
            m["verdict"] = line["verdict"]
        m["identical"] += line["identical"] or 0
        m["prompts"] += line["prompts"]
        margin = line.get("largest_margin")
        if margin is not None:
            m["largest_margin"] = max(margin, m["largest_margin"] or margin)
    return out
