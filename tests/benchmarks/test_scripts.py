"""The benchmark scripts whose figures BENCHMARKS.md records still run (tiny sizes, CPU) and
still give the figures its tables quote, with sane values: positive times, ratios that agree
with their parts, speculative outputs equal to vanilla's. An API change must not silently
break them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import benchmark_script

from vegas_spec import quant

ROOT = Path(__file__).resolve().parents[2]
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2}
TAU, GAMMA = 6.3, 6  # step_profile's defaults: tokens per iteration, draft length


def run(script: str, *args: str) -> str:
    """Runs benchmarks/SCRIPT ARGS in a process of its own, on one torch thread: its tiny
    sizes gain nothing from more, and more threads wait on each other when the cores are
    busy (with pytest-xdist's other workers) -> its standard output."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def test_step_profile_times_each_step_against_its_floor(tmp_path: Path) -> None:
    """§1 and §3's columns: plain, verify (with and without scores), draft (on the model's
    weights and on FP8 copies) and round times, each step's byte floor, the host work between
    rounds, and the projected and byte-ideal speedups computed from them."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "steps.json"
    run("step_profile.py", "--config", str(tmp_path), "--contexts", "64", "--batches", "2",
        "--reps", "1", "--min-tokens", "16", "--host-gap-tokens", "4",
        "--draft-weights", "model", "fp8", "--launches", "--out", str(out))
    row, fp8 = json.loads(out.read_text())["rows"]
    for r in (row, fp8):
        assert (r["context"], r["batch"]) == (64, 2)
        for kind in ("plain", "verify", "draft"):
            assert r[f"{kind}_ms"] > 0 and r[f"floor_{kind}_ms"] > 0
        assert r["round_ms"] > 0 and r["round_sampled_ms"] > 0 and r["host_gap_ms"] >= 0
        assert r["verify_noscores_ms"] > 0 and r["quest_draft_ms"] > 0
        # a draft step reads a budget of the KV, a verify step the whole of it and its scores
        assert r["floor_draft_ms"] < r["floor_plain_ms"] < r["floor_verify_ms"]
        assert r["tokens_per_iteration"] == TAU
        assert r["projected_speedup"] == pytest.approx(
            TAU * r["plain_ms"] / (r["round_ms"] + r["host_gap_ms"]))
        assert r["projected_sampled_speedup"] == pytest.approx(
            TAU * r["plain_ms"] / (r["round_sampled_ms"] + r["host_gap_ms"]))
        assert r["sampled_vs_greedy_round"] == pytest.approx(
            r["round_sampled_ms"] / r["round_ms"])
        assert r["byte_ideal_speedup"] == pytest.approx(
            TAU * r["floor_plain_ms"] / (GAMMA * r["floor_draft_ms"] + r["floor_verify_ms"]))
        # each step's launches (`--launches`), by kernel and in all; a round launches its
        # γ drafts, its verify step and more (acceptance, selection)
        for kind in ("plain", "verify", "draft", "round", "round_sampled"):
            assert r[f"launches_{kind}"] == sum(r["launches"][kind].values()) > 0
        assert r["launches_round"] > GAMMA * r["launches_draft"] + r["launches_verify"]
        assert r["launches_round_sampled"] > r["launches_round"]
    # FP8 draft copies: the draft step reads fewer weight bytes, the other steps the same
    assert fp8["floor_draft_ms"] < row["floor_draft_ms"]
    assert fp8["floor_plain_ms"] == row["floor_plain_ms"]
    assert fp8["floor_verify_ms"] == row["floor_verify_ms"]


def test_step_profile_measures_exact_mode_against_the_default(tmp_path: Path) -> None:
    """§8's table: plain steps' and vegas's projected tokens per second in each mode, and
    exact mode's slowdown, computed from each mode's row."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "exact.json"
    run("step_profile.py", "--config", str(tmp_path), "--contexts", "64", "--batches", "2",
        "--reps", "1", "--min-tokens", "16", "--host-gap-tokens", "4",
        "--modes", "default", "exact", "--brief", "--out", str(out))
    data = json.loads(out.read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert sorted(rows) == ["default", "exact"]
    (cost,) = data["exact_cost"]
    assert (cost["context"], cost["batch"]) == (64, 2)
    for mode, r in rows.items():
        assert r["plain_ms"] > 0 and r["round_ms"] > 0
        assert cost[f"plain_tok_s_{mode}"] == pytest.approx(1e3 * 2 / r["plain_ms"])
        assert cost[f"vegas_tok_s_{mode}"] == pytest.approx(
            1e3 * 2 * TAU / (r["round_ms"] + r["host_gap_ms"]))
    for kind in ("plain", "vegas"):
        assert cost[f"{kind}_slowdown"] == pytest.approx(
            1 - cost[f"{kind}_tok_s_exact"] / cost[f"{kind}_tok_s_default"])


def test_step_profile_sets_copy_rows_and_sparse_tiles_per_cell(tmp_path: Path) -> None:
    """`--draft-copy-rows` (0: the library's `quant.DRAFT_COPY_ROWS`) and `--sparse-tiles`
    give a row each, side by side; a malformed tile setting is refused."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "cells.json"
    run("step_profile.py", "--config", str(tmp_path), "--contexts", "64", "--batches", "2",
        "--reps", "1", "--min-tokens", "16", "--host-gap-tokens", "4", "--brief",
        "--draft-weights", "fp8", "--draft-copy-rows", "0", "1", "--sparse-tiles", "library",
        "32:1:2", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    library = quant.DRAFT_COPY_ROWS
    assert [(r["sparse_tiles"], r["draft_copy_rows"]) for r in rows] == [
        ("library", library), ("library", 1), ("32:1:2", library), ("32:1:2", 1)]
    assert all(r["draft_ms"] > 0 for r in rows)
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--config",
                          str(tmp_path), "--contexts", "64", "--batches", "2",
                          "--sparse-tiles", "32:1", "--out", str(out)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "BLOCK_K:STAGES:WARPS" in bad.stderr


def test_method_sweep_pairs_prompts_and_checks_losslessness(tmp_path: Path) -> None:
    """§5: tokens per iteration per prompt of each variant (an ablation of vegas among them),
    every output equal to vanilla's."""
    out = tmp_path / "sweep.json"
    run("method_sweep.py", "--prompts", "2", "--min-context", "48", "--max-context", "64",
        "--max-tokens", "5", "--formats", "raw", "--variants", "vanilla", "vegas", "vegas-x0",
        "--min-tokens", "16", "--gamma", "2", "--device", "cpu", "--out", str(out))
    rows = json.loads(out.read_text())["results"]["raw"]
    assert list(rows) == ["vanilla", "vegas", "vegas-x0"]
    for name in ("vegas", "vegas-x0"):
        r = rows[name]
        assert len(r["per_prompt"]) == 2
        assert all(1 <= t <= 3 for t in r["per_prompt"])  # γ 2: at most 3 a round
        assert 1 <= r["tokens_per_iteration"] <= 3
        assert r["token_ids"] == rows["vanilla"]["token_ids"]


def test_prefill_bench_profiles_a_prefill(tmp_path: Path) -> None:
    """§7's busy share: time to first token within the profiled wall time, a fraction."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "prefill.json"
    run("prefill_bench.py", "--model", str(tmp_path), "--load-format", "dummy", "--device",
        "cpu", "--dtype", "float32", "--sections", "profile", "--context", "40", "--batches",
        "2", "--profile-kv-gb", "0.01", "--out", str(out))
    (row,) = json.loads(out.read_text())["profile"]
    assert (row["batch"], row["context"]) == (2, 40)
    assert 0 < row["ttft_ms"] <= row["wall_ms"]
    assert 0 <= row["gpu_busy_fraction"] <= 1


def test_cpu_methods_is_vegas_bench(tmp_path: Path) -> None:
    """§6: each method's decode rate and its speedup over vanilla's, tokens per iteration,
    and vegas's output equal to vanilla's."""
    out = tmp_path / "cpu"
    run("cpu_methods.py", "--contexts", "64", "--prompts", "1", "--max-tokens", "3",
        "--min-tokens", "8", "--gamma", "2", "--methods", "vanilla", "vegas", "--out", str(out))
    data = json.loads((out / "results.json").read_text())
    vanilla, vegas = data["summary"]
    assert (vanilla["method"], vegas["method"]) == ("vanilla", "vegas")
    assert vanilla["decode_tokens_per_s"] > 0 and vegas["decode_tokens_per_s"] > 0
    assert vanilla["speedup"] == 1.0
    assert vegas["speedup"] == pytest.approx(vegas["decode_tokens_per_s"]
                                             / vanilla["decode_tokens_per_s"])
    assert 1 <= vegas["tokens_per_iteration"] <= 3
    assert vegas["verdict"] == "identical"
    cells = {c["method"]: c for c in data["cells"]}
    assert cells["vegas"]["token_ids"] == cells["vanilla"]["token_ids"]
    assert (out / "report.md").exists()


def test_serve_load_reports_throughput_and_latency_per_method(tmp_path: Path) -> None:
    """§9: two methods behind the real server with the embedded model, three short requests
    two at a time: throughput, its ratio to vanilla's, and the latencies, sane."""
    out = tmp_path / "serve.json"
    run("serve_load.py", "--context", "48", "--requests", "3", "--min-tokens", "5",
        "--max-tokens", "8", "--concurrency", "2", "--gamma", "2", "--kv-cache-gb", "0.0625",
        "--methods", "vanilla", "vegas", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["vanilla", "vegas"]
    for r in rows:
        assert r["requests"] == 3 and r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
        assert r["output_tokens"] == r["asked_tokens"] and 15 <= r["asked_tokens"] <= 24
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["itl_gaps"] >= 2 and 0 < r["itl_p50_s"] <= r["itl_p99_s"]
        assert 0 < r["itl_per_token_s"]
        assert 0 <= r["itl_admitting_gaps"] <= r["itl_gaps"]
        if r["itl_admitting_gaps"]:
            assert 0 < r["itl_admitting_p50_s"] <= r["itl_admitting_p99_s"]
            assert r["itl_admitting_p99_over_itl_p50"] == pytest.approx(
                r["itl_admitting_p99_s"] / r["itl_p50_s"])
        assert 0 <= r["decode_host_share"] <= 1 and r["decode_wall_s"] > 0
        assert r["steps"] > r["prefill_steps"] >= 2
        # every decode iteration counted by kind, in paced steps and in decode-only ones
        assert r["paced_plain_steps"] + r["paced_rounds"] == r["paced_steps"]
        assert r["decode_only_plain_steps"] + r["decode_only_rounds"] == \
            r["steps"] - r["prefill_steps"]
        if r["method"] == "vanilla":
            assert r["paced_rounds"] == r["decode_only_rounds"] == 0
        assert 0 < r["prefill_step_p50_s"] <= r["prefill_step_max_s"]
        assert 0 < r["decode_step_p50_s"] <= r["decode_step_p99_s"]
        assert 0 <= r["paced_steps"] <= r["prefill_steps"]
    assert rows[0]["vs_vanilla"] == 1.0
    assert rows[1]["vs_vanilla"] == pytest.approx(
        rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"])


def test_host_loop_splits_an_iteration_into_forward_and_host_work(tmp_path: Path) -> None:
    """§4.6's host time per iteration: of the iterations in which every row decodes, the
    wall time is the timed forward, the selection and the host's share, each run's; plain
    decoding emits one token a row and iteration, vegas more; with and without streamed
    outputs."""
    out = tmp_path / "host.json"
    run("host_loop.py", "--batch", "2", "--prompt-tokens", "8", "--max-tokens", "12",
        "--repeats", "1", "--stream", "both", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["stream"]) for r in rows] == [
        ("vanilla", False), ("vanilla", True), ("vegas", False), ("vegas", True)]
    for r in rows:
        (one,) = r["runs"]
        assert r["iterations"] >= 1 and 0 < r["forward_ms"] and 0 < r["host_ms"]
        assert r["select_ms"] >= 0
        assert one["iteration_ms"] == pytest.approx(
            one["forward_ms"] + one["select_ms"] + one["host_ms"])
        if r["method"] == "vanilla":  # 12 tokens: the prefill's, its step's and 10 more
            assert r["iterations"] == 10 and r["tokens_per_iteration"] == 1
        else:
            assert 1 < r["tokens_per_iteration"] <= 7


def test_adaptive_costs_times_plain_steps_and_rounds_from_the_engines_reports(
        tmp_path: Path) -> None:
    """§1.3's costs by kind (a tiny random model on CPU): per run, the plain steps and rounds
    counted by kind and by bucket add up, each kind's time is positive where it ran, vanilla
    only steps plainly and a fixed γ only drafts, and the adaptive controller's counts (from
    the warm-up on) hold the timed run's."""
    out = tmp_path / "costs.json"
    run("adaptive_costs.py", "--tiny", "--batch", "2", "--max-tokens", "12", "--warmup", "4",
        "--gamma", "2", "--min-tokens", "16", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["label"] for r in rows] == [
        f"{mode} {name}" for mode in ("greedy", "sampled")
        for name in ("vanilla", "vegas", "vegas fixed", "stream", "stream fixed")]
    for r in rows:
        decoded = r["plain_n"] + r["round_n"]
        buckets = r["plain_and_rounds_by_bucket"]
        assert set(buckets) <= {"1", "2"}
        assert [sum(c[0] for c in buckets.values()), sum(c[1] for c in buckets.values())] \
            == [r["plain_n"], r["round_n"]]
        assert r["step_n"] >= decoded >= 1 and r["step_ms"] > 0 and r["select_ms"] >= 0
        for kind in ("plain", "round"):
            assert (r[f"{kind}_ms"] > 0) == (r[f"{kind}_n"] > 0)
        if r["label"].endswith("vanilla"):  # 12 tokens: the prefill's and 11 plain steps
            assert (r["plain_n"], r["round_n"], r["select_ms"]) == (11, 0, 0)
        elif r["label"].endswith("fixed"):
            assert r["plain_n"] == 0 and "rounds" not in r
        else:
            assert r["rounds"] >= r["round_n"] and r["plain_steps"] >= r["plain_n"]


def test_step_parts_times_the_steps_that_admit_a_prompt(tmp_path: Path) -> None:
    """§7's chunk late in a long prompt: per budget, a prefilling step's excess over a
    decode-only step, and the line of excess against prompt tokens."""
    out = tmp_path / "parts.json"
    run("step_parts.py", "--tiny", "--rows", "2", "--base-context", "60", "--context", "200",
        "--chunks", "64", "256", "--arrivals", "1", "--gap", "1", "--kv-cache-gb", "0.05",
        "--methods", "vanilla", "vegas", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["vanilla", "vegas"]
    for row in rows:
        assert row["decode_step_s"] > 0 and row["decode_steps"] >= 1
        assert set(row["per_chunk"]) == {"64", "256"}
        small, whole = row["per_chunk"]["64"], row["per_chunk"]["256"]
        assert small["steps"] >= 3 and small["tokens_p50"] == 64  # 200 tokens, 64 a step
        assert whole["steps"] >= 1 and whole["tokens_p50"] == 200
        for chunk in (small, whole):
            assert chunk["excess_s"] == pytest.approx(chunk["step_s"] - row["decode_step_s"])
            assert 0 < chunk["phase_s"]["prefill"] <= chunk["prefill_part_s"] < chunk["step_s"]
        assert row["excess_line"]["fixed_s"] is not None
        assert row["excess_line"]["per_token_s"] is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_launch_floor_says_in_one_line_that_it_needs_cuda(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "launch_floor.py"), "--out",
                           str(tmp_path / "floor.json")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and not (tmp_path / "floor.json").exists()
    assert len(done.stderr.strip().splitlines()) == 1 and "CUDA" in done.stderr


def test_kernel_bench_checks_and_times_every_kernel(tmp_path: Path) -> None:
    """§2.1: every kernel checked against its reference, then timed, with its bytes."""
    out = tmp_path / "kernels.json"
    # SmolLM2's shapes (with Llama-3.1-8B's too, the interpreter runs about three times as long)
    run("kernel_bench.py", "--smoke", "--models", "smollm2", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["errors"] == [] and data["checks"]
    assert set(data["checks"].values()) == {"ok"}
    assert {r["kernel"] for r in data["rows"]} >= {"paged", "sparse", "topk", "store_kv"}
    for row in data["rows"]:
        assert row["status"] == "ok" and row["time_us"] > 0 and row["total_bytes"] > 0


def test_cpu_products_times_ours_beside_torchs_for_each_shape_and_row_count(
        tmp_path: Path) -> None:
    """§6: dense_linear against F.linear per dtype, shape and row count, and the KV gather,
    each with both times and their ratio."""
    out = tmp_path / "products.json"
    stdout = run("cpu_products.py", "--shapes", "tiny", "--rows", "1", "3", "16", "--reps", "1",
                 "--stream-mb", "1", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["threads"] == 1
    linear = [r for r in data["rows"] if r["what"] == "linear"]
    assert Counter((r["dtype"], r["rows"]) for r in linear) == {
        (d, m): 2 for d in ("float32", "bfloat16") for m in (1, 3, 16)}
    assert [r["what"] for r in data["rows"]].count("gather") == 1
    for r in data["rows"]:
        assert r["torch_ms"] > 0 and r["ours_ms"] > 0
        assert r["speedup"] == pytest.approx(r["torch_ms"] / r["ours_ms"])
    assert len(stdout.strip().splitlines()) == len(data["rows"])


def test_selection_sweep_runs_each_cell_with_stream_and_vanilla(tmp_path: Path) -> None:
    """§1.4: tokens per iteration of vegas at a (window, pool) and of stream beside it, greedy
    and sampled; greedy outputs equal to vanilla's."""
    out = tmp_path / "selection.json"
    run("selection_sweep.py", "--device", "cpu", "--batch", "2", "--context", "64",
        "--max-tokens", "5", "--workloads", "generation", "--methods", "vegas",
        "--windows", "8", "--pools", "3", "--min-tokens", "16", "--ratio", "0.1",
        "--collects", "2", "all", "--kv-cache-gb", "0.0625", "--out", str(out))
    cells = json.loads(out.read_text())["cells"]
    assert [(c["sampling"], c["method"]) for c in cells] == [
        (s, m) for s in ("greedy", "sampled")
        for m in ("stream", "vegas", "vegas, collect all")]
    for c in cells:
        assert 1.0 <= c["tokens_per_iteration"] <= 7.0 and len(c["per_prompt"]) == 2
        assert (c["window"], c["pool"]) == ((0, 1) if c["method"] == "stream" else (8, 3))
        assert c["budget_mean"] >= 16
        # greedy speculative output is vanilla's (float32 on CPU), sampled is not compared
        assert c.get("same_as_vanilla") == (2 if c["sampling"] == "greedy" else None)


def test_prefix_share_holds_the_prefix_once_with_the_cache_on(tmp_path: Path) -> None:
    out = tmp_path / "share.json"
    run("prefix_share.py", "--device", "cpu", "--dtype", "float32", "--requests", "3",
        "--prefix-tokens", "80", "--own-tokens", "4", "--max-tokens", "2", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    off, on = rows["off"], rows["on"]
    assert off["prompt_tokens"] == on["prompt_tokens"] == 3 * 84
    # the cache off computes every prompt; on, the first one whole and the others' own tokens
    assert off["computed_tokens"] == 3 * 84 and on["computed_tokens"] == 84 + 2 * (84 - 80)
    assert on["peak_pages"] < off["peak_pages"]
    for row in (off, on):
        assert 0 < row["ttft_median_s"] <= row["ttft_max_s"] <= row["total_s"]


def test_adaptive_sweep_sets_adaptive_beside_every_fixed_gamma_in_each_cell(
        tmp_path: Path) -> None:
    """§1.3's sweep (a tiny random model on CPU): a row per (workload, context, batch) cell,
    generation once without a context; every run in each, positive rates, speedups and the
    adaptive run's ratios equal to their parts, the best fixed γ the fastest of the fixed
    runs, and the adaptive controller's summary kept."""
    out = tmp_path / "sweep.json"
    stdout = run("adaptive_sweep.py", "--tiny", "--workloads", "essays", "generation",
                 "--contexts", "64", "--batches", "2", "--max-tokens", "8",
                 "--generation-tokens", "8", "--fixed", "1", "2", "--gamma", "2",
                 "--trace", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["meta"]["gpu"] == "cpu" and data["meta"]["args"]["fixed"] == [1, 2]
    rows = data["rows"]
    assert [json.loads(line) for line in stdout.splitlines() if line.startswith("{")] == rows
    assert [(r["workload"], r["context"], r["batch"], r["max_tokens"]) for r in rows] == [
        ("essays", 64, 2, 8), ("generation", None, 2, 8)]
    fixed = ["fixed 1", "fixed 2"]
    for r in rows:
        runs = r["runs"]
        assert list(runs) == ["vanilla", "adaptive", *fixed]
        vanilla = runs["vanilla"]["decode_tokens_per_s"]
        for label, figures in runs.items():
            assert figures["decode_tokens_per_s"] > 0
            assert figures["decode_tokens_per_s_runs"] == [figures["decode_tokens_per_s"]]
            assert figures["vs_vanilla"] == pytest.approx(figures["decode_tokens_per_s"] / vanilla)
            assert ("controller" in figures) == (label == "adaptive")
        assert runs["vanilla"]["tokens_per_iteration"] == 1.0
        # the batch's decode iterations: vanilla's one per token after the prefill's
        assert runs["vanilla"]["batch_iterations_runs"] == [r["max_tokens"] - 1]
        for label in ["adaptive", *fixed]:
            (n,) = runs[label]["batch_iterations_runs"]
            assert 1 <= n <= r["max_tokens"] - 1
        for gamma, label in enumerate(fixed, 1):  # a round every iteration: 1 to γ + 1 tokens
            assert 1 <= runs[label]["tokens_per_iteration"] <= gamma + 1
        assert isinstance(runs["adaptive"]["controller"], dict)
        # --trace: the timed run's iterations (the warm-up's are in the summary only)
        assert [label for label in runs if "traces" in runs[label]] == ["adaptive"]
        (trace,) = runs["adaptive"]["traces"]
        chosen = runs["adaptive"]["controller"]["draft_lengths"]
        assert trace and all(n <= chosen[str(g)] for g, n in
                             Counter(drafted for _, drafted, _, _, _ in trace).items())
        for bucket, drafted, ms, emitted, costs in trace:
            assert bucket in (1, 2) and drafted in (0, 1, 2) and ms > 0
            assert 1 <= emitted <= drafted + 1 and set(costs) == {"0", "1", "2"}
        best = max(fixed, key=lambda label: runs[label]["decode_tokens_per_s"])
        assert r["best_fixed"] == {"label": best,
                                   "decode_tokens_per_s": runs[best]["decode_tokens_per_s"]}
        adaptive = runs["adaptive"]["decode_tokens_per_s"]
        assert r["adaptive_vs_best_fixed"] == pytest.approx(
            adaptive / runs[best]["decode_tokens_per_s"])
        assert r["adaptive_vs_vanilla"] == pytest.approx(adaptive / vanilla)
        assert r["adaptive_vs_vanilla"] == pytest.approx(runs["adaptive"]["vs_vanilla"])
    table = run("adaptive_sweep.py", "--table", str(out)).splitlines()  # BENCHMARKS.md's
    assert table[0].startswith("| workload, decoding |") and "fixed γ 1 / 2 × vanilla" in table[0]
    assert len(table) == 2 + len(rows)
    for line, r in zip(table[2:], rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == ("essays" if r["workload"] == "essays" else "generation, greedy")
        assert cells[4].split()[0] == f"{r['adaptive_vs_vanilla']:.2f}"
        assert f"**{r['runs'][r['best_fixed']['label']]['vs_vanilla']:.2f}**" in cells[5]
        chosen = r["runs"]["adaptive"]["controller"]["draft_lengths"]
        assert cells[7] == " / ".join(str(chosen[g]) for g in ("0", "1", "2"))


def test_draft_weights_acceptance_keeps_the_projections_asked_for(tmp_path: Path) -> None:
    """§1.2's acceptance cells: tokens per iteration of every --keep setting, with the share
    of the projections' parameters it reads from the model's weights (SmolLM2: down is a
    quarter of a layer's, edges:1 two of thirty layers); --draws: sampled cells average as
    many texts a prompt."""
    out = tmp_path / "keep.json"
    run("draft_weights_acceptance.py", "--draft-weights", "model", "fp8", "--methods", "vegas",
        "--workloads", "generation", "--prompts", "1", "--generation-tokens", "8",
        "--keep", "down", "edges:1", "--draws", "2", "--out", str(out))
    cells = json.loads(out.read_text())["cells"]
    for c in cells:  # sampled cells average two texts a prompt; greedy ones decode once
        draws = c.get("tokens_per_iteration_draws")
        if c["sampling"] == "greedy":
            assert draws is None
        else:
            assert len(draws) == 2 and c["tokens_per_iteration"] == pytest.approx(sum(draws) / 2)
    assert [(c["draft_weights"], c["keep"], c["sampling"]) for c in cells] == [
        ("model", "none", "greedy"), ("model", "none", "sampled")] + [
        ("fp8", keep, sampling) for keep in ("down", "edges:1")
        for sampling in ("greedy", "sampled")]
    shares = {c["keep"]: c["kept_share"] for c in cells if c["draft_weights"] == "fp8"}
    assert [c["kept_share"] for c in cells[:2]] == [1.0, 1.0]  # drafts on the model's weights
    assert shares["edges:1"] == pytest.approx(2 / 30)
    assert shares["down"] == pytest.approx(576 * 1536 / (960 * 576 + 576 * 576 + 3072 * 576
                                                         + 576 * 1536))
    assert all(1.0 <= c["tokens_per_iteration"] <= 7.0 for c in cells)
    # a projection the copies do not hold is refused before any weight moves
    script = benchmark_script("draft_weights_acceptance")
    copies = [{"q_proj": object(), "down_proj": object()}] * 2
    with pytest.raises(SystemExit, match="--keep lm_head: the copies hold q_proj, down_proj"):
        script.keep_model_weights(None, copies, "lm_head")


def test_draft_weights_agreement_compares_each_copy_with_the_model_on_the_same_texts(
        tmp_path: Path) -> None:
    """§1.2's paired figures: per workload and mode, each copy's share of greedy positions
    whose argmax parts from the model's, and its sampled distributions' distance to the
    model's, with the bound they put on tokens per iteration where --rates gives the model's
    drafts' acceptance."""
    rates = tmp_path / "rates.json"
    model_cell = {"draft_weights": "model", "method": "vegas", "keep": "none",
                  "workload": "generation", "acceptance_rate_per_position": [0.9, 0.81]}
    rates.write_text(json.dumps({"cells": [{**model_cell, "sampling": "greedy"},
                                           {**model_cell, "sampling": "sampled"}]}))
    out = tmp_path / "agree.json"
    run("draft_weights_agreement.py", "--kinds", "fp8", "int8", "--workloads", "generation",
        "--prompts", "2", "--new-tokens", "6", "--rates", str(rates), "--out", str(out))
    cells = json.loads(out.read_text())["cells"]
    assert [(c["sampling"], c["kind"]) for c in cells] == [
        ("greedy", "fp8"), ("greedy", "int8"), ("sampled", "fp8"), ("sampled", "int8")]
    for c in cells:
        figure = c["disagree" if c["sampling"] == "greedy" else "loss"]
        assert c["positions"] == 12 and 0.0 <= figure <= 1.0
        assert c["tokens_per_iteration_model"] == pytest.approx(2.71)
        assert c["tokens_per_iteration_bound"] <= 2.71 + 1e-12
    sampled = {c["kind"]: c["loss"] for c in cells if c["sampling"] == "sampled"}
    assert 0.0 < sampled["int8"] < sampled["fp8"]  # e4m3's 3 mantissa bits move q more


def test_fp8_gemm_times_int8_copies_with_a_scale_a_row_beside_the_groups() -> None:
    """`fp8_gemm.py --kinds int8 int8-row`: the library's INT8 copy (groups of 128) and one
    with a scale a row, the same values where every group of a row shares its largest
    magnitude."""
    script = benchmark_script("fp8_gemm")
    assert {"fp8", "int8", "int8-row", "int4", "bf16"} <= set(script.KINDS)
    w = torch.randn(8, 256)
    w[:, 0] = w[:, 128] = 10.0  # each group's largest magnitude is the row's
    row, grouped = script.COPIES["int8-row"](w), script.COPIES["int8"](w)
    assert row.group == 256 and grouped.group == 128
    assert row.scale.shape == (8, 1) and grouped.scale.shape == (8, 2)
    assert torch.equal(row.data, grouped.data)
    assert torch.equal(row.dequantize(torch.float32), grouped.dequantize(torch.float32))


def test_draft_weights_agreement_figures_and_bound() -> None:
    script = benchmark_script("draft_weights_agreement")
    from vegas_spec import SamplingParams
    from vegas_spec.sampling import BatchSampling

    logits = [torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])]
    assert script.figures(logits, logits, None) == 0.0
    swapped = [torch.tensor([[1.0, 2.0, 0.0], [0.0, 3.0, 1.0]])]
    assert script.figures(logits, swapped, None) == 0.5  # one argmax of two parts
    plain = BatchSampling.build([SamplingParams(temperature=1.0)], torch.device("cpu"))
    assert script.figures(logits, logits, plain) == pytest.approx(0.0, abs=1e-7)
    p, q = logits[0].softmax(-1), swapped[0].softmax(-1)
    total_variation = float((p - q).abs().sum(-1).mean() / 2)
    assert script.figures(logits, swapped, plain) == pytest.approx(total_variation, rel=1e-5)
    # shares of rounds accepting draft j: 0.9 and 0.81, each draft 0.9 given the one before
    assert script.tokens_per_iteration([0.9, 0.81]) == pytest.approx(2.71)
    assert script.tokens_per_iteration([0.9, 0.81], 0.1) == pytest.approx(1 + 0.8 + 0.64)
    assert script.tokens_per_iteration([0.9, 0.81], 1.0) == 1.0
