"""The benchmark scripts still run (tiny sizes, CPU): their figures are recorded in
BENCHMARKS.md, so an API change must not silently break them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from vegas_spec.kernels import paged_attention as pa

ROOT = Path(__file__).resolve().parents[2]
# tests/models/test_qwen3_moe.py's tiny model, with room for step_profile's contexts
TINY_MOE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2}


def run(script: str, *args: str) -> str:
    """Runs benchmarks/SCRIPT ARGS in a process of its own, on one torch thread: its tiny
    sizes gain nothing from more, and more threads wait on each other when the cores are
    busy (with pytest-xdist's other workers) -> its standard output."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def test_step_profile_reports_every_step_against_its_floor(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "steps.json"
    run("step_profile.py", "--config", str(tmp_path), "--contexts", "200", "--batches", "2",
        "--reps", "2", "--min-tokens", "16", "--host-gap-tokens", "8", "--score-tiles",
        "library", "64:2:f32-blocks:0:128", "--out", str(out))
    row, other = json.loads(out.read_text())["rows"]
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    library = pa.score_tiles(head_dim)
    assert row["score_tiles"] == f"{library.block_k}:{library.stages}:{library.store}"
    assert other["score_tiles"] == "64:2:f32-blocks"  # the option's parts, as given
    assert (other["score_split_max"], other["score_maxnreg"]) == (None, 128)
    assert other["verify_ms"] > 0
    assert (row["context"], row["batch"], row["budget"]) == (200, 2, 16)
    for kind in ("plain", "verify", "draft"):
        assert row[f"{kind}_ms"] > 0 and row[f"floor_{kind}_ms"] > 0
    assert row["round_ms"] > 0 and row["round_unplanned_ms"] > 0 and row["round_sampled_ms"] > 0
    assert row["sampled_vs_greedy_round"] == pytest.approx(row["round_sampled_ms"] /
                                                           row["round_ms"])
    assert row["projected_sampled_speedup"] > 0
    assert row["select_ms"] > 0 and row["select_reference_ms"] > 0
    assert row["ideal_speedup_at_7_tokens_round"] > 0
    assert row["floor_draft_ms"] < row["floor_plain_ms"] < row["floor_verify_ms"]
    # a dense model's steps read every weight once (CPU runs count 1e10 bytes/s)
    assert row["weight_bytes_plain"] == row["weight_bytes_verify"] == row["weight_bytes"]
    assert row["floor_plain_ms"] == 1e3 * (row["weight_bytes"] + row["kv_bytes"]) / 1e10
    assert row["floor_verify_ms"] == 1e3 * (row["weight_bytes"] + row["kv_bytes"]
                                            + row["score_bytes"]) / 1e10
    assert "experts_hit_plain" not in row and "byte_ideal_speedup_expected" not in row
    # vegas's two score rows' logits, one per query head, written and read back
    layers, heads = (TINY[k] for k in ("num_hidden_layers", "num_attention_heads"))
    per_key = 2 * 4 * heads * 2 + 4 * 2  # float32 logits of 2 rows x heads, 2 scores
    assert row["score_bytes"] == 2 * 200 * layers * per_key
    assert row["floor_verify_over_plain"] == pytest.approx(
        row["floor_verify_ms"] / row["plain_ms"])
    assert row["verify_noscores_ms"] > 0 and row["quest_draft_ms"] > 0
    assert row["tokens_per_iteration"] == 6.3 and row["projected_speedup"] > 0
    assert row["byte_ideal_speedup"] > 0 and isinstance(row["host_gap_ms"], float)


def test_step_profile_draft_weights_side_by_side(tmp_path: Path) -> None:
    """An engine with FP8 draft copies beside one drafting on the model's weights: the FP8
    draft step's byte floor counts one byte per projection weight."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "steps.json"
    run("step_profile.py", "--config", str(tmp_path), "--contexts", "64", "--batches", "2",
        "--reps", "1", "--min-tokens", "16", "--host-gap-tokens", "4", "--brief",
        "--draft-weights", "model", "fp8", "--out", str(out))
    model, fp8 = json.loads(out.read_text())["rows"]
    assert (model["draft_weights"], fp8["draft_weights"]) == ("model", "fp8")
    assert fp8["floor_draft_ms"] < model["floor_draft_ms"]
    assert fp8["floor_plain_ms"] == model["floor_plain_ms"] and fp8["draft_ms"] > 0


def test_step_profile_counts_the_experts_each_step_hits(tmp_path: Path) -> None:
    """A mixture of experts (the tiny Qwen3-MoE of tests/models, 8 experts, top-2): each
    step's floor counts only the experts its tokens hit, counted from its routing and
    expected under uniform routing. One sequence: the plain and draft steps hit 2 experts a
    layer, the verify step's 7 rows more; 16 sequences: the verify step hits all 8, every
    weight."""
    config = transformers.Qwen3MoeConfig(**TINY_MOE)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(str(tmp_path))
    out = tmp_path / "steps.json"
    stdout = run("step_profile.py", "--config", str(tmp_path), "--contexts", "64", "--batches",
                 "1", "16", "--reps", "1", "--min-tokens", "16", "--host-gap-tokens", "4",
                 "--brief", "--out", str(out))
    one, many = json.loads(out.read_text())["rows"]
    layers, experts, k = 2, 8, 2
    per = 4 * 3 * TINY_MOE["hidden_size"] * TINY_MOE["moe_intermediate_size"]  # float32
    dense = one["weight_bytes"] - layers * experts * per
    for step in ("plain", "draft"):
        assert one[f"experts_hit_{step}"] == one[f"experts_hit_{step}_expected"] == k
        assert one[f"weight_bytes_{step}"] == dense + layers * k * per
    assert k < one["experts_hit_verify"] <= experts
    assert one["experts_hit_verify_expected"] == pytest.approx(experts * (1 - 0.75 ** 7))
    assert one["weight_bytes_verify"] == dense + layers * one["experts_hit_verify"] * per
    assert one["floor_plain_ms"] == 1e3 * (one["weight_bytes_plain"] + one["kv_bytes"]) / 1e10
    assert one["floor_verify_ms"] > one["floor_plain_ms"] > one["floor_draft_ms"]
    assert many["experts_hit_verify"] == experts  # 112 tokens: all hit
    assert many["weight_bytes_verify"] == many["weight_bytes"]
    assert k < many["experts_hit_plain"] <= experts
    assert many["weight_bytes_plain"] <= many["weight_bytes_verify"]
    for row in (one, many):
        assert row["byte_ideal_speedup"] > 0 and row["byte_ideal_speedup_expected"] > 0
        assert row["projected_speedup"] > 0
    # the closing table: one line a (context, batch)
    assert f"| 64 | 1 | {k}.0 ({k}.0) | " in stdout and "| 64 | 16 | " in stdout


def test_step_profile_measures_exact_mode_against_the_default(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "exact.json"
    run("step_profile.py", "--config", str(tmp_path), "--contexts", "64", "--batches", "2",
        "--reps", "2", "--min-tokens", "16", "--modes", "default", "exact", "--brief",
        "--host-gap-tokens", "8", "--max-model-len", "100", "--rank-widths", "library",
        "whole", "--sparse-splits", "paged", "--topk-min-warps", "1", "--split-fill", "3:2",
        "--max-lanes", "16", "--verify-tiles", "32:3:96", "--out", str(out))
    data = json.loads(out.read_text())
    assert {(r["sparse_splits"], r["topk_min_warps"], r["max_lanes"], r["verify_tiles"])
            for r in data["rows"]} == {("paged", 1, 16, "32:3:96")}
    assert {r["split_fill"] for r in data["rows"]} == {"3:2"}
    assert [(r["mode"], r["rank_width"]) for r in data["rows"]] == [
        ("default", "library"), ("default", "whole"), ("exact", "library"), ("exact", "whole")]
    assert {r["max_model_len"] for r in data["rows"]} == {100}
    assert "quest_draft_ms" not in data["rows"][0]
    costs = data["exact_cost"]
    assert [c["rank_width"] for c in costs] == ["library", "whole"]
    for cost in costs:
        assert (cost["context"], cost["batch"]) == (64, 2)
        for kind in ("plain", "vegas"):
            assert cost[f"{kind}_tok_s_default"] > 0 and cost[f"{kind}_tok_s_exact"] > 0
            assert cost[f"{kind}_slowdown"] < 1


def test_method_sweep_pairs_prompts_and_checks_losslessness(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    run("method_sweep.py", "--prompts", "2", "--min-context", "48", "--max-context", "64",
        "--max-tokens", "5", "--formats", "raw", "--variants", "vanilla", "vegas-acc",
        "--min-tokens", "16", "--gamma", "2", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["meta"]["lengths"] == [48, 64]
    rows = data["results"]["raw"]
    assert list(rows) == ["vanilla", "vegas-acc"]  # an ablation swapped in for vegas
    assert len(rows["vegas-acc"]["per_prompt"]) == 2
    assert rows["vegas-acc"]["token_ids"] == rows["vanilla"]["token_ids"]


def test_prefill_bench_profiles_a_prefill(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "prefill.json"
    run("prefill_bench.py", "--model", str(tmp_path), "--load-format", "dummy", "--device",
        "cpu", "--dtype", "float32", "--sections", "profile", "--context", "40", "--batches",
        "2", "--profile-kv-gb", "0.01", "--out", str(out))
    (row,) = json.loads(out.read_text())["profile"]
    assert row["batch"] == 2 and 0 < row["ttft_ms"] <= row["wall_ms"]
    # the cProfile table of the host side (which functions lead by self time varies with load)
    assert any("function calls" in line for line in row["host_profile"])
    assert any("tottime" in line for line in row["host_profile"])


def test_cpu_methods_is_vegas_bench(tmp_path: Path) -> None:
    out = tmp_path / "cpu"
    run("cpu_methods.py", "--contexts", "64", "--prompts", "1", "--max-tokens", "3",
        "--min-tokens", "8", "--gamma", "2", "--methods", "vanilla", "vegas", "--out", str(out))
    data = json.loads((out / "results.json").read_text())
    assert [c["key"] for c in data["cells"]] == ["essays|64|1|vanilla",
                                                 "essays|64|1|vegas|g2|r0.05"]
    assert data["cells"][1]["token_ids"] == data["cells"][0]["token_ids"]
    assert (out / "report.md").exists()


def test_serve_load_reports_throughput_and_latency_per_method(tmp_path: Path) -> None:
    """Two methods behind the real server with the embedded model, three short requests two
    at a time: every figure of the report is there and sane."""
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
            assert r["itl_admitting_p99_over_itl_p50"] > 0
        assert 0 <= r["decode_host_share"] <= 1 and r["decode_wall_s"] > 0
        assert r["steps"] > r["prefill_steps"] >= 2
        assert 0 < r["prefill_step_p50_s"] <= r["prefill_step_max_s"]
        assert 0 < r["decode_step_p50_s"] <= r["decode_step_p99_s"]
        assert 0 <= r["paced_steps"] <= r["prefill_steps"]
        if r["paced_steps"]:
            assert 0 < r["paced_tokens_p50"] <= r["paced_tokens_max"]
            assert r["paced_prefill_part_p50_s"] > 0 and r["paced_decode_part_p50_s"] > 0
        assert set(r["pacer"]) == {"decode_s", "tokens", "budget"}
        assert r["pacer"]["budget"] > 0 and 0 <= r["paced_whole"] <= r["paced_steps"]
    assert rows[0]["vs_vanilla"] == 1.0
    assert rows[1]["vs_vanilla"] == rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]


@pytest.fixture(scope="module")
def host_loop_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """host_loop.py's rows of vanilla and vegas, each without and with every step's outputs
    streamed: one run for the two tests below."""
    out = tmp_path_factory.mktemp("host_loop") / "host.json"
    run("host_loop.py", "--batch", "2", "--prompt-tokens", "8", "--max-tokens", "12",
        "--repeats", "1", "--stream", "both", "--out", str(out))
    return json.loads(out.read_text())["rows"]


def test_host_loop_splits_the_host_work_by_phase(host_loop_rows: list[dict]) -> None:
    rows = [r for r in host_loop_rows if not r["stream"]]
    assert [r["method"] for r in rows] == ["vanilla", "vegas"]
    vanilla = rows[0]
    # 11 decode-only steps after the prefill's first token
    assert vanilla["iterations"] >= 8 and vanilla["host_ms"] > 0 and vanilla["graph"] > 0
    assert vanilla["host_ms"] == pytest.approx(sum(vanilla[p] for p in (
        "schedule", "inputs", "commit", "rows", "select", "outputs")))


def test_host_loop_streams_every_steps_outputs(host_loop_rows: list[dict]) -> None:
    rows = [r for r in host_loop_rows if r["stream"]]
    assert [r["method"] for r in rows] == ["vanilla", "vegas"]
    row = rows[0]
    assert row["iterations"] >= 8 and row["outputs"] > 0


def test_step_parts_times_prefilling_steps_by_part(tmp_path: Path) -> None:
    out = tmp_path / "parts.json"
    run("step_parts.py", "--tiny", "--rows", "2", "--base-context", "60", "--context", "200",
        "--chunks", "64", "256", "--arrivals", "1", "--gap", "1", "--kv-cache-gb", "0.05",
        "--methods", "vanilla", "vegas", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["vanilla", "vegas"]
    for row in rows:
        for name in ("wall", "parts"):
            s = row[name]
            assert s["decode_step_s"] > 0 and s["decode_steps"] >= 1
            assert set(s["per_chunk"]) == {"64", "256"}
            assert s["per_chunk"]["64"]["steps"] >= 3  # 200 tokens in chunks of 64
            assert s["per_chunk"]["64"]["parts_s"]["forward"] > 0
        assert row["parts"]["per_chunk"]["256"]["parts_s"]["join"] > 0


def test_decode_profile_takes_the_prefill_out(tmp_path: Path) -> None:
    """On CPU: the embedded model's operators of a decode, the prefill-only run subtracted."""
    out = tmp_path / "decode.json"
    run("decode_profile.py", "--context", "32", "--batch", "2", "--max-tokens", "3",
        "--gamma", "2", "--rows", "5", "--kv-cache-gb", "0.0625", "--out", str(out))
    data = json.loads(out.read_text())
    summary, kernels = data["summary"], data["kernels"]
    assert summary["iterations"] > 0 and summary["tokens_per_iteration"] >= 1
    assert summary["decode_kernel_ms"] > 0 and summary["decode_kernels"] > 0
    assert len(kernels) == 5 and kernels[0]["ms"] > 0 and kernels[0]["calls"] > 0
    assert summary["verify_passes"] == 0  # no Triton kernel on the CPU path


def test_decode_profile_sums_the_events_as_the_profilers_event_list_does() -> None:
    """decode_profile reads the profiler's raw events (prof.events() is slow on a CPU's many
    operators): the same names, calls and self times, a nested repeat of a name folded."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import decode_profile
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(32, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("step"), record_function("step"):
                torch.nn.functional.linear(x, x).softmax(-1).to(torch.float64).sum()
    want: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        if e.device_type.name == "CPU":
            t, c = want.get(e.name, (0.0, 0))
            want[e.name] = (t + e.self_cpu_time_total, c + 1)
    assert want["step"][1] == 3 and "aten::linear" in want  # the inner "step"s folded
    got = decode_profile.event_totals(prof, cuda=False)
    assert {k: c for k, (_, c) in got.items()} == {k: c for k, (_, c) in want.items()}
    assert {k: t for k, (t, _) in got.items()} == pytest.approx(
        {k: t for k, (t, _) in want.items()})


def test_gc_probe_times_the_collections_of_a_command(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    run("gc_probe.py", "--out", str(out), "--", "generate", "--prompt", "The capital of",
        "--max-tokens", "2", "--kv-cache-gb", "0.0625")
    data = json.loads(out.read_text())
    assert data["tracked_objects"] > 0 and data["seconds"] > 0
    assert data["generations"], "a command this size still collects"
    for row in data["generations"].values():
        assert row["collections"] > 0 and row["longest_ms"] <= row["total_ms"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_launch_floor_says_in_one_line_that_it_needs_cuda(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "launch_floor.py"), "--out",
                           str(tmp_path / "floor.json")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and not (tmp_path / "floor.json").exists()
    assert done.stderr.strip() == "launch_floor: needs a CUDA GPU (it times CUDA graphs)"


def test_layer_overlap_says_in_one_line_that_it_needs_cuda(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layer_overlap.py"),
                           "--config", str(ROOT / "benchmarks" / "configs" / "llama-3.1-8b"),
                           "--out", str(tmp_path / "l2.json")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and not (tmp_path / "l2.json").exists()
    assert done.stderr.strip() == "layer_overlap: needs a CUDA GPU (sm_90 prefetch and launches)"


def test_step_profile_sparse_splits_setting_sets_programs_per_sm() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import step_profile
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    library = {64: 3}
    assert step_profile.sparse_programs(library, "library", 128) is library
    assert step_profile.sparse_programs(library, "paged", 128) is None
    assert step_profile.sparse_programs(library, "8", 128) == {64: 3, 128: 8}
    assert step_profile.sparse_programs(None, "4", 64) == {64: 4}
    assert step_profile.sparse_splits_arg("12") == "12"
    for bad in ("0", "-2", "wave"):
        with pytest.raises(Exception, match="library, paged or a positive integer"):
            step_profile.sparse_splits_arg(bad)


def test_step_profile_verify_tiles_setting() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import step_profile
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert step_profile.parse_verify_tiles("library") is None
    assert step_profile.parse_verify_tiles("64:2") == pa.VerifyTiles(64, 2, None)
    assert step_profile.parse_verify_tiles("64:3:128") == pa.VerifyTiles(64, 3, 128)
    assert step_profile.parse_verify_tiles("64:3:0") == pa.VerifyTiles(64, 3, None)
    assert step_profile.verify_tiles_arg("128:2") == "128:2"
    for bad in ("64", "a:2", "64:2:128:1"):
        with pytest.raises(Exception, match="bad verify tiles"):
            step_profile.verify_tiles_arg(bad)


def test_kernel_bench_checks_and_times_every_kernel(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    # SmolLM2's shapes: every kernel checked against its reference and timed (with
    # Llama-3.1-8B's too, the interpreter runs about three times as long)
    run("kernel_bench.py", "--smoke", "--models", "smollm2", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["errors"] == [] and data["checks"]
    assert set(data["checks"].values()) == {"ok"}
    assert {r["kernel"] for r in data["rows"]} >= {"paged", "sparse", "topk", "store_kv"}
    for row in data["rows"]:
        assert row["status"] == "ok" and row["time_us"] > 0 and row["total_bytes"] > 0
    paged = [r for r in data["rows"] if r["kernel"] == "paged"]
    assert all(r["splits"] >= 1 for r in paged)


def test_selection_sweep_runs_every_cell_with_stream_and_vanilla(tmp_path: Path) -> None:
    out = tmp_path / "selection.json"
    run("selection_sweep.py", "--device", "cpu", "--batch", "2", "--context", "64",
        "--max-tokens", "5", "--workloads", "essays", "generation", "--methods", "vegas",
        "lastq", "--windows", "8", "--pools", "3", "--min-tokens", "16", "--ratio", "0.1",
        "--kv-cache-gb", "0.0625", "--out", str(out))
    data = json.loads(out.read_text())
    cells = data["cells"]
    assert data["meta"]["dtype"] == "float32"
    assert [(c["workload"], c["sampling"], c["method"]) for c in cells] == [
        (w, s, m) for w in ("essays", "generation") for s in ("greedy", "sampled")
        for m in ("stream", "vegas", "lastq")]
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
    assert off["computed_tokens"] == 3 * 84 and on["computed_tokens"] == 84 + 2 * (84 - 80)
    assert on["peak_pages"] < off["peak_pages"] and on["ttft_max_s"] > 0
