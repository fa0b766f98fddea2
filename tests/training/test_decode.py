"""The static-cache decoder of GRPO's rollouts (`fastft.training.objectives.decode`): each step's logits equal a full
forward of the sequence so far (fp32, ragged left-padded prompts, every supported tiny architecture, LoRA
patched in with non-zero adapters), stop tokens end rows, nucleus sampling keeps generate's token set, and a
CUDA graph replays what the eager steps draw."""

import numpy as np
import pytest
import torch

import fastft
from fastft.training.objectives.decode import StaticDecoder, nucleus_sample, supports
from fastft.training.objectives.rollout import Sampling, sample, static_decoding

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model(name, device="cpu", dtype=torch.float32):
    model, tokenizer = fastft.load_model(name, device=device, dtype=dtype)
    model = fastft.add_lora(model, r=4, alpha=8, gradient_checkpointing=False, seed=0)
    with torch.no_grad():  # a trained-looking adapter: B = 0 would hide a decode that skipped it
        for name_, parameter in model.named_parameters():
            if "lora_B" in name_:
                parameter.normal_(0, 0.05, generator=torch.Generator(device=parameter.device).manual_seed(1))
    return model.eval(), tokenizer


def _left_padded(prompts, pad):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def _greedy_reference(model, prompt, steps):
    """Greedy continuation of one unpadded prompt by full forwards (no cache): the logits of each step."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            last = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            logits.append(last)
            ids.append(int(last.argmax()))
    return torch.stack(logits), ids[len(prompt) :]


RAGGED = (5, 13, 1, 9)  # left-padded to 13: 8, 0, 12 and 4 pad slots


@pytest.mark.parametrize(
    "preset, lengths",
    [
        ("tiny-llama", RAGGED),
        ("tiny-qwen3", RAGGED),
        ("tiny-moe", RAGGED),
        ("tiny-mixtral", RAGGED),
        ("tiny-mistral", (70, 31, 66, 2)),  # its 64-token sliding window, crossed in the prompt and after it
    ],
)
def test_every_steps_logits_equal_a_full_forward_of_the_sequence_so_far(preset, lengths):
    model, _ = _model(preset)
    assert supports(model)
    rng = np.random.default_rng(3)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts = [rng.integers(3, vocab, n).tolist() for n in lengths]
    seen = []

    def greedy(logits):
        seen.append(logits.clone())
        return logits.argmax(-1)

    steps = 7
    decoder = StaticDecoder(model, len(prompts), max(lengths), steps, stops={-1}, pad=0, choose=greedy)
    output = decoder.decode(*_left_padded(prompts, pad=0))
    assert decoder.stats == dict(eager_steps=steps - 1, replays=0, captures=0, compactions=0)
    logits = torch.stack(seen, 1)  # [rows, steps, vocab]
    for row, prompt in enumerate(prompts):
        expected, tokens = _greedy_reference(model, prompt, steps)
        assert output[row].tolist() == tokens
        scale = expected.abs().max()
        assert ((logits[row] - expected).abs().max() / scale).item() < 1e-5


def test_a_prompt_prefilled_once_for_its_group_decodes_as_each_row_prefilled_alone():
    model, _ = _model("tiny-qwen3")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 500, n).tolist() for n in (7, 3)]
    seen = []

    def greedy(logits):
        seen.append(logits.clone())
        return logits.argmax(-1)

    decoder = StaticDecoder(model, 2 * 3, 7, 5, stops={-1}, pad=0, choose=greedy, group=3)
    output = decoder.decode(*_left_padded(prompts, pad=0))
    logits = torch.stack(seen, 1)  # [rows, steps, vocab]: rows 0-2 the first prompt's, 3-5 the second's
    for index, prompt in enumerate(prompts):
        expected, tokens = _greedy_reference(model, prompt, 5)
        for row in range(3 * index, 3 * index + 3):
            assert output[row].tolist() == tokens
            assert ((logits[row] - expected).abs().max() / expected.abs().max()).item() < 1e-5
    with pytest.raises(ValueError, match="whole number of groups"):
        StaticDecoder(model, 5, 7, 5, stops={-1}, pad=0, group=3)


def _compacting_and_full(model, prompts, stops, new_tokens, seed, rows, width):
    """The same seeded decode with `compact` on and off: ``{compact: (ids, log_probs, stats)}``."""
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in _left_padded(prompts, pad=0))
    runs = {}
    for compact in (True, False):
        generator = torch.Generator(device=device).manual_seed(seed)
        decoder = StaticDecoder(
            model,
            rows,
            width,
            new_tokens,
            stops,
            pad=0,
            temperature=1.5,
            generator=generator,
            group=4,
            keep_log_probs=True,
            compact=compact,
        )
        runs[compact] = (decoder.decode(ids, mask), decoder.log_probs, decoder.stats)
    return runs


def test_finished_rows_leave_the_batch_without_changing_what_any_row_draws():
    """Compaction (rows that stopped dropped from the batch and the KV cache) against the full batch to the end:
    the same seeded draws, the same tokens, the same log-probs, in fewer row-steps."""
    model, _ = _model("tiny-llama")
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts = [np.random.default_rng(7).integers(3, 500, n).tolist() for n in (6, 2, 9)]
    stops = set(range(3, vocab, 12))  # about one token in twelve ends a row: lengths from 1 to all 14
    runs = _compacting_and_full(model, prompts, stops, new_tokens=14, seed=3, rows=12, width=9)
    (ids, log_probs, stats), (full_ids, full_log_probs, full_stats) = runs[True], runs[False]
    ended = torch.isin(full_ids, torch.tensor(sorted(stops)))
    drawn = (ended.cumsum(1) - ended.long()) == 0  # up to and including each row's stop token
    lengths = drawn.sum(1).tolist()
    assert min(lengths) < 6 and max(lengths) > 10, lengths  # ragged: compaction has something to drop
    assert torch.equal(ids, full_ids)
    torch.testing.assert_close(log_probs[drawn], full_log_probs[drawn], rtol=1e-5, atol=1e-5)
    assert stats["compactions"] >= 1 and full_stats["compactions"] == 0
    generator = torch.Generator().manual_seed(3)
    reused = StaticDecoder(model, 12, 9, 14, stops, pad=0, temperature=1.5, generator=generator, group=4)
    reused.decode(*_left_padded(prompts, pad=0))
    generator.manual_seed(3)  # a decoder that compacted decodes its next batch from a full one again
    assert torch.equal(reused.decode(*_left_padded(prompts, pad=0)), ids)


def test_a_decoder_and_its_kv_cache_are_freed_when_dropped_without_the_garbage_collector():
    """No reference cycle: a rollout's KV cache must not outlive it into the training step (on the 8B shape a
    lambda over the decoder kept 0.75 GiB per rollout alive until the collector ran)."""
    import gc
    import weakref

    model, _ = _model("tiny-llama")
    prompts = [[3, 4, 5], [6, 7]]
    decoder = StaticDecoder(
        model, 4, 3, 4, stops={-1}, pad=0, generator=torch.Generator().manual_seed(0), group=2
    )
    decoder.decode(*_left_padded(prompts, pad=0))
    alive, cache = weakref.ref(decoder), weakref.ref(decoder.cache.keys[0])
    gc.disable()
    try:
        del decoder
        assert alive() is None and cache() is None
    finally:
        gc.enable()


def test_a_row_stops_at_its_first_stop_token_and_pads_after_it():
    model, _ = _model("tiny-llama")
    stop, pad = 7, 0
    script = iter([[5, 7, 9], [7, 6, 9], [5, 6, 9], [5, 6, 7], [5, 6, 9]])  # rows stop at steps 2, 1, 4

    def scripted(logits):
        return torch.tensor(next(script))

    decoder = StaticDecoder(model, 3, 4, 5, stops={stop}, pad=pad, choose=scripted, compact=False)
    output = decoder.decode(*_left_padded([[3, 4], [5, 6, 8, 9], [11]], pad))
    assert output.tolist() == [[5, 7, 0, 0, 0], [7, 0, 0, 0, 0], [9, 9, 9, 7, 0]]


def test_decoding_ends_early_once_every_row_has_stopped():
    model, _ = _model("tiny-llama")
    calls = []

    def stop_now(logits):
        calls.append(1)
        return torch.full((logits.shape[0],), 7)

    decoder = StaticDecoder(model, 2, 3, 64, stops={7}, pad=0, choose=stop_now)
    output = decoder.decode(*_left_padded([[3, 4, 5], [6]], 0))
    assert output[:, 0].tolist() == [7, 7] and (output[:, 1:] == 0).all()
    assert len(calls) == 1  # the prefill's draw; the first check (before any decode step) saw both stop


def test_nucleus_sampling_keeps_generates_token_set_and_follows_the_probabilities():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    temperature, top_p = 0.7, 0.8
    scores = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    allowed = torch.isfinite(scores)
    draws = torch.stack([nucleus_sample(logits, temperature, top_p) for _ in range(4000)], 1)  # [6, 4000]
    for row in range(6):
        counts = torch.bincount(draws[row], minlength=40).float()
        assert (counts[~allowed[row]] == 0).all()
        expected = scores[row].softmax(-1)
        assert (counts / counts.sum() - expected).abs().max() < 0.035  # 4,000 draws: ~4.5 sigma at p=0.5


def test_sampling_uses_the_static_decoder_where_supported_and_generate_elsewhere():
    llama, _ = _model("tiny-llama")
    oss, _ = fastft.load_model("tiny-gpt-oss")
    assert static_decoding(llama, None) and not static_decoding(llama, False)
    assert not supports(oss) and not static_decoding(oss, None)
    with pytest.raises(ValueError, match="leave static_decode=None"):
        static_decoding(oss, True)


def test_a_seeded_rollout_draws_the_same_completions_each_time_and_ends_rows_at_eos():
    model, tokenizer = _model("tiny-llama")
    prompts = [np.array(tokenizer("two plus two is")["input_ids"]), np.array([5, 6, 7])]
    sampling = Sampling(num_generations=3, max_new_tokens=6, temperature=1.3, top_p=0.9)
    first, truncated, _ = sample(model, tokenizer, prompts, sampling, (1, 2))
    again, _, _ = sample(model, tokenizer, prompts, sampling, (1, 2))
    other, _, _ = sample(model, tokenizer, prompts, sampling, (1, 3))
    assert len(first) == 6 and all(1 <= len(ids) <= 6 for ids in first)
    assert [ids.tolist() for ids in first] == [ids.tolist() for ids in again]
    assert [ids.tolist() for ids in first] != [ids.tolist() for ids in other]
    eos = tokenizer.eos_token_id
    for ids, cut in zip(first, truncated, strict=True):
        assert cut == (len(ids) == 6 and ids[-1] != eos)
        assert eos not in ids[:-1].tolist()


@gpu
@needs_cuda
def test_gpu_decode_steps_replay_one_graph_that_draws_what_eager_steps_draw():
    """bf16, ragged prompts: the graph-replayed steps give the eager steps' greedy tokens and, seeded, their
    sampled tokens too (the graph reads the generator's state at every replay)."""
    model, _ = _model("tiny-llama", device="cuda", dtype=torch.bfloat16)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 500, n).tolist() for n in (17, 40, 3, 29, 40, 8)]
    ids, mask = _left_padded(prompts, 0)

    def run(graphed, choose=None, seed=0):
        decoder = StaticDecoder(model, len(prompts), 40, 24, stops={-1}, pad=0, choose=choose)
        torch.manual_seed(seed)
        output = (
            decoder.decode(ids.cuda(), mask.cuda()) if graphed else _eager(decoder, ids.cuda(), mask.cuda())
        )
        return output, decoder.stats

    greedy = lambda logits: logits.argmax(-1)  # noqa: E731
    replayed, stats = run(True, greedy)
    eager, eager_stats = run(False, greedy)
    assert stats == dict(eager_steps=2, replays=21, captures=1, compactions=0) and eager_stats["replays"] == 0
    assert (replayed == eager).float().mean() > 0.95  # bf16: a near-tie may flip, late tokens then follow
    sampled, _ = run(True, None, seed=5)
    sampled_again, _ = run(True, None, seed=5)
    sampled_eagerly, _ = run(False, None, seed=5)
    assert torch.equal(sampled, sampled_again)
    assert (sampled == sampled_eagerly).float().mean() > 0.9  # the same noise: only bf16 near-ties differ


@gpu
@needs_cuda
def test_gpu_a_decode_step_no_graph_can_hold_decodes_eagerly_with_one_warning():
    from fastft.runtime.model_state import model_state
    from fastft.training.graph import GraphCaptureWarning

    model, _ = _model("tiny-llama", device="cuda", dtype=torch.bfloat16)
    ids, mask = _left_padded([[3, 4, 5, 6, 7], [8, 9]], 0)

    def syncing(logits):
        logits.sum().item()  # a host read: a graph capture cannot hold it
        return logits.argmax(-1)

    decoder = StaticDecoder(model, 2, 5, 12, stops={-1}, pad=0, choose=syncing)
    with pytest.warns(GraphCaptureWarning, match="decode eagerly"):
        output = decoder.decode(ids.cuda(), mask.cuda())
    assert (
        decoder.stats == dict(eager_steps=11, replays=0, captures=0, compactions=0)
        and not model_state(model).decode_graphs
    )
    greedy = StaticDecoder(model, 2, 5, 12, stops={-1}, pad=0, choose=lambda logits: logits.argmax(-1))
    assert torch.equal(output, _eager(greedy, ids.cuda(), mask.cuda()))
    later = StaticDecoder(model, 2, 5, 12, stops={-1}, pad=0, choose=lambda logits: logits.argmax(-1))
    later.decode(ids.cuda(), mask.cuda())  # the model's later rollouts do not try again
    assert later.stats["replays"] == 0


@gpu
@needs_cuda
def test_gpu_a_grpo_run_samples_through_replayed_decode_steps():
    """The trainer's own path, profiler on: every rollout captures once (two eager warm-up steps) and
    replays the rest, with no capture warning, and the step's phases keep the rollout."""
    import warnings

    from fastft.data.rewards import exact_match
    from fastft.data.skills import generate
    from fastft.training.graph import GraphCaptureWarning
    from fastft.training.objectives.grpo import GRPOConfig, GRPOTrainer

    model, tokenizer = _model("tiny-llama", device="cuda", dtype=torch.bfloat16)
    config = GRPOConfig(max_steps=2, prompts_per_step=2, num_generations=4, max_new_tokens=12, warmup=0)
    trainer = GRPOTrainer(model, tokenizer, list(generate(8, seed=2)), [exact_match], config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphCaptureWarning)
        result = trainer.train()
    assert trainer.decode_stats["eager_steps"] == 2 * 2 and trainer.decode_stats["replays"] > 0
    assert all("rollout" in event.phases for event in result.steps)


@gpu
@needs_cuda
def test_gpu_a_batch_that_compacts_captures_a_graph_for_its_smaller_size_and_draws_what_the_full_one_does(
    monkeypatch,
):
    """The finished flags read every step (on a GPU every 16: too coarse for rows this short), rows ending at
    ragged lengths: the batch compacts, captures a new graph for its smaller size and replays it, and draws
    the full batch's tokens."""
    import fastft.training.objectives.decode as decode

    monkeypatch.setattr(decode, "_FINISHED_CHECK_EVERY", 1)
    model, _ = _model("tiny-llama", device="cuda", dtype=torch.bfloat16)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts = [np.random.default_rng(2).integers(3, 500, n).tolist() for n in (12, 30, 7, 30)]
    stops = set(range(3, vocab, 8))  # on the CPU in fp32: two compactions, some rows to the end
    runs = _compacting_and_full(model, prompts, stops, new_tokens=60, seed=4, rows=16, width=30)
    (compacted, _, stats), (full, _, full_stats) = runs[True], runs[False]
    assert stats["compactions"] >= 1 and stats["captures"] >= 2, stats  # one graph before, one after
    assert stats["replays"] > 0 and full_stats["compactions"] == 0 and full_stats["captures"] == 1, full_stats
    assert (compacted == full).float().mean() > 0.95  # bf16: a smaller batch may round a near-tie apart


def _eager(decoder, ids, mask):
    """`StaticDecoder.decode` with every step eager (the reference the graph must match)."""
    with torch.no_grad():
        decoder._prefill(ids, mask)
        for _ in range(decoder.new_tokens - 1):
            decoder._draw_noise()
            decoder._step()
            decoder.stats["eager_steps"] += 1
    return decoder.output.clone()
