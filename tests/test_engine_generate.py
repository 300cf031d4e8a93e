"""End-to-end generation on the real SmolLM2 model: greedy tokens equal transformers' greedy
tokens (short prompts, a batch of long prompts, chat mode), and stopping and seeded sampling
behave as documented."""

from __future__ import annotations

import gc
import time

import pytest
import torch
from conftest import essay_prompt

from vegas_spec.config import SamplingParams, SpecConfig

pytestmark = pytest.mark.slow

SHORT = ["The capital of France is", "def fibonacci(n):\n    ",
         "Once upon a time, in a small village by the sea,"]
EOS = 2  # <|im_end|>, SmolLM2's EOS


def hf_greedy(hf_model, ids: list[int], new: int) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt (ends at EOS if emitted)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                max_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def short_greedy(llm):
    return llm.generate(SHORT, SamplingParams(max_tokens=24))


def test_short_prompts_match_transformers(llm, hf_model, short_greedy) -> None:
    for prompt, out in zip(SHORT, short_greedy, strict=True):
        ids = llm.tokenizer(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(hf_model, ids, 24)
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_long_prompt_batch_matches_transformers(llm, hf_model, essays) -> None:
    """Three prompts of about 150, 2,048 and 400 tokens decode together (different lengths, pages
    and positions in one batch); each must give transformers' tokens for it alone."""
    prompts = [essay_prompt(llm.tokenizer, essays, n, offset=i)
               for i, n in enumerate((150, 2048, 400))]
    lengths = [len(p) for p in prompts]
    assert len(set(lengths)) == 3 and max(lengths) >= 2000
    outs = llm.generate(prompts, SamplingParams(max_tokens=8))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(hf_model, prompt, 8)
    assert len(llm.engine.runner.cache.free_pages) == llm.engine.runner.cache.num_pages


@pytest.fixture(scope="module")
def chat_answer(llm):
    return llm.generate("What is the capital of France?", SamplingParams(max_tokens=48),
                        chat=True)[0]


def test_chat_template_matches_transformers(llm, hf_model, chat_answer) -> None:
    tok = llm.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    assert chat_answer.prompt_token_ids == ids
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert chat_answer.token_ids == hf_greedy(hf_model, ids, 48)
    assert "Paris" in chat_answer.text


def test_eos_stops_generation(llm, chat_answer) -> None:
    out = chat_answer
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1]
    assert len(out.token_ids) < 48
    assert "<|im_end|>" not in out.text
    more = len(out.token_ids) + 6
    ignored = llm.generate([out.prompt_token_ids],
                           SamplingParams(max_tokens=more, ignore_eos=True))[0]
    assert ignored.token_ids[: len(out.token_ids)] == out.token_ids
    assert len(ignored.token_ids) == more and ignored.finish_reason == "length"


def test_stop_string_truncates_text(llm, short_greedy) -> None:
    full = short_greedy[2]
    words = full.text.split()
    assert len(words) >= 6
    stop = " " + words[4]
    cut = full.text.index(stop)
    out = llm.generate(SHORT[2], SamplingParams(max_tokens=24, stop=(stop, "no such text")))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert stop not in out.text
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_generate_makes_no_step_outputs_and_equals_the_step_loop(llm, short_greedy,
                                                                 monkeypatch) -> None:
    """generate steps without per-step outputs (texts decoded once, at the end); a loop over
    step() that reads every delta ends with the same ids, text, finish reason and stats."""
    engine, made = llm.engine, []
    output = engine._output
    monkeypatch.setattr(engine, "_output", lambda seq: made.append(seq) or output(seq))
    stop = " " + short_greedy[2].text.split()[3]
    params = [SamplingParams(max_tokens=12)] * 2 + [SamplingParams(max_tokens=12, stop=(stop,))]
    outs = llm.generate(SHORT, params)
    assert not made
    # greedy: the first 12 of the fixture's 24 tokens
    assert [o.token_ids for o in outs[:2]] == [o.token_ids[:12] for o in short_greedy[:2]]
    rids = [engine.add_request(p, sp) for p, sp in zip(SHORT, params)]
    final, texts = {}, dict.fromkeys(rids, "")
    while engine.has_unfinished():
        for o in engine.step():
            final[o.request_id] = o
            texts[o.request_id] += o.delta_text
    assert made
    for rid, out in zip(rids, outs, strict=True):
        step = final[rid]
        assert (step.token_ids, step.text, step.finish_reason, step.stats["sequence"]) == \
            (out.token_ids, out.text, out.finish_reason, out.stats["sequence"])
        assert texts[rid] == out.text and out.text
    assert outs[2].finish_reason == "stop" and stop not in outs[2].text


def test_max_tokens_respected(llm) -> None:
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 5, 9)]
    outs = llm.generate(SHORT, params)
    assert [len(o.token_ids) for o in outs] == [1, 5, 9]
    assert all(o.finish_reason == "length" for o in outs)


def test_seeded_sampling_is_reproducible(llm) -> None:
    prompt = "Write a short poem about the sea:"

    def sample(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8, seed=seed,
                                ignore_eos=True)
        return llm.generate(prompt, params)[0].token_ids

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
    # A seeded sequence draws the same tokens whatever else shares its batch.
    batch = llm.generate([SHORT[0], prompt], [
        SamplingParams(temperature=0.7, max_tokens=10, seed=7),
        SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8, seed=1234, ignore_eos=True)])
    assert batch[1].token_ids == first
    greedy = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert greedy.token_ids != first


def test_no_garbage_collection_runs_between_steps(llm, monkeypatch) -> None:
    """The collector is paused while `generate` steps (a full collection stops the loop for
    tens of milliseconds), and its state is restored after."""
    inside = []
    collections = []
    step = llm.engine.step

    def timed_step(*args, **kwargs):
        inside.append(True)
        try:
            return step(*args, **kwargs)
        finally:
            inside.pop()

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start" and inside:
            collections.append(info["generation"])

    monkeypatch.setattr(llm.engine, "step", timed_step)
    threshold = gc.get_threshold()
    gc.callbacks.append(on_collection)
    gc.set_threshold(1)  # unpaused, every step would collect
    try:
        assert gc.isenabled()
        llm.generate(SHORT[:2], SamplingParams(max_tokens=6))
        assert gc.isenabled()
        gc.disable()
        llm.generate(SHORT[:1], SamplingParams(max_tokens=3))
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_collection)
    assert collections == []


def test_generate_leaves_no_cyclic_garbage(llm) -> None:
    """What makes pausing the collector safe: a step makes no reference cycles, so a long
    `generate` leaves nothing for the collector (cycles would otherwise wait, with any
    device memory they hold, until the next collection)."""
    for spec in (None, SpecConfig(method="vegas", min_tokens=8)):
        # what a first call makes once (its first speculative round included)
        llm.generate(SHORT[:2], SamplingParams(max_tokens=4, ignore_eos=True), speculative=spec)
        gc.collect()
        # 12 tokens: at least two rounds of vegas (γ = 6: at most 7 tokens a round)
        llm.generate(SHORT[:2], SamplingParams(max_tokens=12, ignore_eos=True),
                     speculative=spec)
        assert gc.collect() == 0, spec


def test_a_text_longer_than_any_context_is_refused_before_tokenizing(llm) -> None:
    """10 M characters cannot fit the 8K-token context whatever the tokens (none is longer
    than the vocabulary's longest): refused from its length, without tokenizing (seconds
    and gigabytes for a text this long)."""
    from vegas_spec.config import PromptError
    from vegas_spec.tokenizer import longest_token

    text = "word " * 2_000_000
    assert len(text) > llm.max_model_len * longest_token(llm.tokenizer)
    started = time.perf_counter()
    with pytest.raises(PromptError, match="10,000,000 characters"):
        llm.generate(text)
    assert time.perf_counter() - started < 1.0
    # a text under that bound is tokenized and refused by its token count, as before
    with pytest.raises(PromptError, match="tokens but the model's context is"):
        llm.generate("word " * 9000)
