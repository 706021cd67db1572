"""generate() and the KV cache against transformers' generate on the same weights."""

import logging

import onnxruntime as ort
import pytest
import torch
from helpers import MODEL_ARCHES, load_pair
from helpers import left_padded_batch as left_padded_prompts
from transformers import WatermarkingConfig

from ortmodule import OrtModelForCausalLM, extend, load_tokenizer, runtime
from ortmodule import decoder as decoder_module
from ortmodule.cache import KVCache
from ortmodule.hf import CACHE_NAME

NEW_TOKENS = 32


def hf_generate(hf_model, ids, mask, **kwargs):
    with torch.inference_mode():
        return hf_model.generate(ids, attention_mask=mask, pad_token_id=2, **kwargs)


@pytest.fixture(scope="module")
def llama_pair(llama):
    return load_pair(llama)


def test_a_call_without_a_length_generates_transformers_default(llama_pair):
    """No max_new_tokens or max_length anywhere: transformers 5 generates its default 20 new tokens, within the
    model's positions (a prompt of 240 of 256 gets 16), where ortmodule refused every prompt of 20 tokens or more
    as over a max_length of 20 in all. A max_length given counts the prompt in; a full context is refused."""
    model, hf = llama_pair
    for width in (5, 30, 240):
        ids = torch.randint(3, 500, (2, width), generator=torch.Generator().manual_seed(width))
        mask = torch.ones_like(ids)
        expected = hf_generate(hf, ids, mask, do_sample=False, eos_token_id=None)
        assert expected.shape[1] == min(width + 20, 256)
        assert torch.equal(model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=2),
                           expected)
    ids = torch.randint(3, 500, (1, 30))
    assert model.generate(ids, max_length=40, do_sample=False).shape == (1, 40)
    with pytest.raises(ValueError, match="nothing to generate: max_length 20 is not above the prompt length 30"):
        model.generate(ids, max_length=20)
    with pytest.raises(ValueError, match="nothing to generate: the prompt's 256 tokens fill the model's 256 positions"):
        model.generate(torch.randint(3, 500, (1, 256)))


@pytest.mark.parametrize("options", [dict(max_new_tokens=20), dict(max_new_tokens=20, num_beams=2),
                                     dict(max_new_tokens=20, prompt_lookup_num_tokens=3), dict(max_length=270),
                                     dict(max_new_tokens=20, output_hidden_states=True, return_dict_in_generate=True),
                                     dict(embeds=True)])
def test_a_generation_past_the_context_is_refused_before_it_runs(llama_pair, monkeypatch, options):
    """Every mode, transformers' loops too (beams, prompt lookup, hidden states, `inputs_embeds` alone with
    transformers' default of 20 new tokens), is refused before its first run where the longest row and
    the new tokens exceed the context; before, those loops failed at the step past it, after the work up to
    there. A left-padded row counts its own tokens."""
    from ortmodule import decoder as decoders

    model, _ = llama_pair
    ids = torch.randint(3, 500, (2, 250), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    options = dict(options)
    if options.pop("embeds", False):
        options["inputs_embeds"], ids = model.get_input_embeddings()(ids).detach(), None
    runs = []
    monkeypatch.setattr(decoders.Decoder, "prefill", lambda *a, **k: runs.append(a))
    with pytest.raises(ValueError, match="prompt of 250 tokens [+] 20 new tokens exceeds the model's context length"):
        model.generate(ids, attention_mask=mask, do_sample=False, **options)
    assert runs == []
    monkeypatch.undo()
    mask[:, :20] = 0  # rows of 230 tokens: room for 20 more
    assert model.generate(ids if ids is not None else torch.randint(3, 500, (2, 250)), attention_mask=mask,
                          max_new_tokens=20, do_sample=False, eos_token_id=None).shape == (2, 270)
    padded = torch.randint(3, 500, (2, 250), generator=torch.Generator().manual_seed(2))
    padded[:, :20] = model.generation_config.pad_token_id  # no mask: transformers masks out the pad tokens
    assert model.generate(padded, max_new_tokens=20, do_sample=False, eos_token_id=None).shape == (2, 270)


@pytest.mark.parametrize("arch", MODEL_ARCHES)
def test_greedy_equals_transformers(build, arch):
    model, hf = load_pair(build(arch))
    ids, mask = left_padded_prompts([6, 13], seed=3)  # 13 > Gemma 3's 8-token window
    expected = hf_generate(hf, ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
    assert tokens.device == model.device
    assert tokens.shape == expected.shape == (2, 13 + NEW_TOKENS)
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_fp16_greedy_picks_transformers_fp32_choice_within_half_precision(build, arch):
    """An fp16 package for a CPU (its decode steps run the builder's repeat_kv path): each token
    generated greedily is, given the tokens before it, transformers fp32's choice on the same
    weights, or within fp16's tolerance of it (near-ties may go either way, after which the
    sequences part: each step is checked on ortmodule's own sequence)."""
    model, hf = load_pair(build(arch, precision="fp16"))
    ids, mask = left_padded_prompts([6, 13], seed=3)
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
    full_mask = torch.cat([mask, torch.ones(2, NEW_TOKENS, dtype=mask.dtype)], 1)
    with torch.inference_mode():
        positions = (full_mask.cumsum(1) - 1).clamp(min=0)  # left padding: as transformers' generate counts
        logits = hf(tokens, attention_mask=full_mask, position_ids=positions).logits[:, 12:-1]  # each new token's
    chosen = logits.gather(2, tokens[:, 13:, None]).squeeze(2)
    assert (logits.max(-1).values - chosen).max().item() < 2e-2


def test_end_of_sequence_pads_the_row_like_transformers(llama_pair):
    model, hf = llama_pair
    ids, mask = left_padded_prompts([5, 11], seed=1)
    free = hf_generate(hf, ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    eos = int(free[0, 11 + 4])  # the token row 0 emits at step 4 becomes the end of sequence
    expected = hf_generate(hf, ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos)
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=2)
    assert torch.equal(tokens, expected)
    assert (tokens[0, 11 + 5 :] == 2).all()  # padded after its end, while row 1 goes on


def test_right_padded_prompts_decode_each_row_from_its_own_end_without_transformers_warning(llama_pair, monkeypatch):
    """Right-padded prompts (a tokenizer's default side) in ortmodule's loop: each row's new tokens are
    those of the row alone (greedy; seeded sampling runs). transformers' "right-padding was detected! For
    correct generation results, please set padding_side='left'" warning, which its own model gives for
    this batch, is not given: the results are correct (and transformers' loop refuses such a batch)."""
    model, hf = llama_pair
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    emitter = logging.getLogger("transformers.generation.utils")  # its own filters run before its handlers
    monkeypatch.setattr(emitter, "handlers", [*emitter.handlers, handler])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 2, 2, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, pad_token_id=2)
    for row, length in enumerate((6, 3)):
        alone = model.generate(ids[row : row + 1, :length], max_new_tokens=5, min_new_tokens=5, pad_token_id=2)
        assert torch.equal(batch[row, 6:], alone[0, length:])
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, pad_token_id=2,
                   generator=torch.Generator().manual_seed(3))
    assert not any("right-padding was detected" in message for message in warned), warned
    hf_generate(hf, ids, mask, max_new_tokens=1, do_sample=False)
    assert any("right-padding was detected" in message for message in warned)  # transformers' own model warns


def test_stops_when_every_row_has_ended(llama_pair):
    model, hf = llama_pair
    ids, mask = left_padded_prompts([7], seed=2)
    free = hf_generate(hf, ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    eos = int(free[0, 7 + 3])
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=2)
    assert torch.equal(tokens, hf_generate(hf, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos))
    assert tokens.shape[1] < 7 + NEW_TOKENS


@pytest.mark.parametrize(
    "options",
    [
        dict(do_sample=True),
        dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
        dict(do_sample=True, min_p=0.05, temperature=1.3),
        dict(repetition_penalty=1.3, no_repeat_ngram_size=2),
        dict(renormalize_logits=True, bad_words_ids=[[7], [9, 10]], suppress_tokens=[5, 6], sequence_bias={(8,): -2.0}),
        dict(do_sample=True, typical_p=0.8, renormalize_logits=True),
        dict(do_sample=True, epsilon_cutoff=3e-4, eta_cutoff=1e-3, top_k=0),
        dict(begin_suppress_tokens=[11, 12], forced_eos_token_id=1, exponential_decay_length_penalty=(4, 1.5),
             eos_token_id=1),
        dict(do_sample=True, num_return_sequences=3, top_k=10),
        dict(encoder_repetition_penalty=1.5, min_new_tokens=5, eos_token_id=1),
        dict(do_sample=True, top_h=0.5, remove_invalid_values=True),
        dict(prefix_allowed_tokens_fn=lambda row, tokens: [10 + row, 11, 12 + int(tokens[-1]) % 7]),
        dict(watermarking_config=WatermarkingConfig(bias=4.0)),
    ],
    ids=["sample", "temperature-top_k-top_p", "min_p", "repetition", "renormalize-bad_words-suppress-bias",
         "typical_p", "epsilon-eta", "begin_suppress-forced_eos-decay", "num_return_sequences",
         "encoder_rep-min_new", "top_h", "prefix_allowed_tokens_fn", "watermarking"],
)
def test_sampling_and_processors_equal_transformers(llama_pair, options):
    """transformers samples with torch's global generator: the same seed draws the same tokens."""
    model, hf = llama_pair
    ids, mask = left_padded_prompts([4, 9], seed=4)
    torch.manual_seed(11)
    expected = hf_generate(hf, ids, mask, max_new_tokens=NEW_TOKENS, **options)
    torch.manual_seed(11)
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=2, **options)
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("options", [dict(do_sample=False), dict(do_sample=True, top_k=20, repetition_penalty=1.3)],
                         ids=["greedy", "sampled"])
def test_continuing_a_cache_runs_the_devices_loop_as_transformers_from_the_ids(llama_pair, options):
    """generate given the KVCache a first generate returned and the ids it made plus new ones (a left-padded
    batch): ortmodule's own loop continues the cache (the new columns one step over it), with transformers'
    tokens from the ids alone, draw for draw with the same seed (its processors see every id); `generator=`
    is taken there, reproducibly."""
    model, hf = llama_pair
    ids, mask = left_padded_prompts([4, 9], seed=4)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=2,
                           return_dict_in_generate=True)
    more = torch.cat([first.sequences, torch.tensor([[30, 31], [32, 33]])], 1)
    more_mask = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    torch.manual_seed(12)
    expected = hf_generate(hf, more, more_mask, max_new_tokens=NEW_TOKENS, **options)
    torch.manual_seed(12)
    cache = first.past_key_values
    tokens = model.generate(more, attention_mask=more_mask, past_key_values=cache, max_new_tokens=NEW_TOKENS,
                            pad_token_id=2, **options)
    assert torch.equal(tokens, expected)
    assert cache.get_seq_length() == tokens.shape[1] - 1  # continued in place, as transformers' cache would be
    if options["do_sample"]:
        def draw(seed):
            again = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=2,
                                   return_dict_in_generate=True).past_key_values
            return model.generate(more, attention_mask=more_mask, past_key_values=again, max_new_tokens=NEW_TOKENS,
                                  pad_token_id=2, generator=torch.Generator().manual_seed(seed), **options)

        assert torch.equal(draw(3), draw(3)) and not torch.equal(draw(3), draw(4))


def test_generator_seed_reproduces_a_sample(llama_pair):
    model, _ = llama_pair
    ids, mask = left_padded_prompts([4, 9], seed=4)

    def sample(seed):
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True,
                              generator=torch.Generator().manual_seed(seed))

    first = sample(5)
    assert torch.equal(first, sample(5))
    assert not torch.equal(first, sample(6))


def test_stop_strings_equal_transformers(llama_pair, llama):
    model, hf = llama_pair
    tokenizer = load_tokenizer(llama.package_dir)
    batch = tokenizer(["The quick brown", "Paris is the capital of"], return_tensors="pt", padding=True,
                      padding_side="left")
    free = hf_generate(hf, batch.input_ids, batch.attention_mask, max_new_tokens=NEW_TOKENS)
    width = batch.input_ids.shape[1]

    def first_new_word(row, after):
        """The first token of the row's generation, from step `after` on, whose text is a word not seen before."""
        texts = [tokenizer.decode(t) for t in free[row, width:]]
        return next(t for i,
                    t in enumerate(texts) if i >= after and t.strip().isalpha() and t not in "".join(texts[:i]))

    stops = [first_new_word(0, 3), first_new_word(1, 3)]
    expected = hf_generate(hf, batch.input_ids, batch.attention_mask, max_new_tokens=NEW_TOKENS,
                           stop_strings=stops, tokenizer=tokenizer)
    tokens = model.generate(**batch, max_new_tokens=NEW_TOKENS, stop_strings=stops, tokenizer=tokenizer,
                            pad_token_id=2)
    assert torch.equal(tokens, expected)
    assert tokens.shape[1] < width + NEW_TOKENS


class RecordingStreamer:
    """transformers' streamer interface: the prompt once, each new token, then the end."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.tolist())

    def end(self):
        self.calls.append("end")


def test_streamers_and_stopping_criteria_are_served_as_by_transformers(llama_pair, llama):
    """A `streamer` gets transformers' calls (the prompt, each token, the end), a `TextIteratorStreamer`
    read from another thread the generated text; a caller's `StoppingCriteria` and `max_time` stop
    where transformers' do; beams with a streamer refused in transformers' words."""
    import threading

    from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

    model, hf = llama_pair
    ids = torch.tensor([[5, 6, 7, 8]])
    options = dict(max_new_tokens=6, do_sample=False)
    calls = []
    for m in (model, hf):
        streamer = RecordingStreamer()
        calls.append((m.generate(ids, streamer=streamer, **options).tolist(), streamer.calls))
    assert calls[0] == calls[1] and calls[0][1][-1] == "end" and len(calls[0][1]) == 8
    tokenizer = load_tokenizer(llama.package_dir)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    thread = threading.Thread(target=model.generate, kwargs=dict(inputs=ids, streamer=streamer, **options))
    thread.start()
    assert "".join(streamer) == tokenizer.decode(calls[0][0][0][4:])
    thread.join()

    class SeventhToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 7)

    criteria = StoppingCriteriaList([SeventhToken()])
    stopped = [m.generate(ids, stopping_criteria=criteria, **options) for m in (model, hf)]
    assert stopped[0].shape[1] == 7 and torch.equal(*stopped)

    class Seen(StoppingCriteria):  # what a criterion sees, the last token's sequence included, as transformers calls it
        def __init__(self):
            self.lengths = []

        def __call__(self, input_ids, scores, **kwargs):
            self.lengths.append(input_ids.shape[1])
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    seen = [Seen(), Seen()]
    for m, criterion in zip((model, hf), seen):
        m.generate(ids, stopping_criteria=StoppingCriteriaList([criterion]), **options)
    assert seen[0].lengths == seen[1].lengths == list(range(5, 11))
    timed = [m.generate(ids, max_time=0.0, **options) for m in (model, hf)]
    assert torch.equal(*timed)
    with pytest.raises(ValueError, match="`streamer` cannot be used with beam search"):
        model.generate(ids, num_beams=2, streamer=RecordingStreamer(), **options)


def test_max_length_and_generation_config(llama_pair):
    model, hf = llama_pair
    ids, mask = left_padded_prompts([5, 8], seed=6)
    expected = hf_generate(hf, ids, mask, max_length=20)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_length=20, pad_token_id=2), expected)
    config = model.generation_config
    config = type(config)(**{**config.to_dict(), "max_new_tokens": 5, "pad_token_id": 2})
    assert model.generate(ids, attention_mask=mask, generation_config=config).shape == (2, 13)


def test_scores_and_logits_come_back_on_request(llama_pair):
    model, hf = llama_pair
    ids, mask = left_padded_prompts([5, 8], seed=6)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True,
                         output_scores=True, output_logits=True, pad_token_id=2)
    with torch.inference_mode():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True,
                          output_scores=True, output_logits=True, pad_token_id=2)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(out.logits) == 6
    for mine, theirs in zip(out.logits, ref.logits):
        assert (mine - theirs).abs().max().item() < 1e-4


def test_a_returned_cache_is_the_callers_own(llama_pair):
    """Decode steps keep their cache for the next generation of the same shape; the cache returned
    with `return_dict_in_generate` is a copy, which continues as transformers' does after another
    generation of that shape has run."""
    model, hf = llama_pair
    ids, mask = left_padded_prompts([6, 9], seed=12)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True, pad_token_id=2)
    other, _ = left_padded_prompts([7, 9], seed=13)
    model.generate(other, max_new_tokens=5, pad_token_id=2)  # the same shape: the steps' own cache is rewritten
    more_mask = torch.cat([mask, mask.new_ones(2, 5)], 1)
    ours = model.generate(out.sequences, attention_mask=more_mask, past_key_values=out.past_key_values,
                          max_new_tokens=4, pad_token_id=2)
    assert torch.equal(ours, hf_generate(hf, out.sequences, more_mask, max_new_tokens=4))


def test_decode_steps_bound_again_each_step_as_on_cuda(llama, monkeypatch):
    """On CUDA every run binds its inputs anew (`Decoder.rebind`); the fixed decode steps do so to
    the same buffers. Forced here on the CPU: the same tokens as transformers, twice (the second
    generation on the kept steps)."""
    model, hf = load_pair(llama)
    monkeypatch.setattr(model.decoder, "rebind", True)
    ids, mask = left_padded_prompts([6, 13], seed=14)
    expected = hf_generate(hf, ids, mask, max_new_tokens=NEW_TOKENS)
    for _ in range(2):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=2),
                           expected)


def test_without_the_lm_head_rewrite(llama):
    model = OrtModelForCausalLM.from_pretrained(llama.package_dir, rewrite_lm_head=False)
    _, hf = load_pair(llama)
    ids, mask = left_padded_prompts([6, 13], seed=3)
    expected = hf_generate(hf, ids, mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=2), expected)


def test_the_cache_is_bound_once_and_never_copied_to_the_host(llama_pair, monkeypatch):
    """The KV buffers are bound as past and present once, by the prefill's binding and the decode
    steps' (kept for the next generation of that shape, which binds nothing), and nothing of the
    decode loop (KV, logits, tokens) is copied to the host: no eos, no criteria, no host sync."""
    model, hf = llama_pair
    ids, mask = left_padded_prompts([6, 13], seed=3)
    layers = model.package.decoder.layers
    model.decoder.fixed.clear()  # decode steps kept from the tests before: this one counts the first binding
    kv_names = {name for kv in layers for name in (kv.past_key, kv.past_value, kv.present_key, kv.present_value)}
    bound = []
    bind_input, bind_output = runtime.bind_input, runtime.bind_output
    monkeypatch.setattr(runtime, "bind_input", lambda b, n, t: (bound.append((n, t.data_ptr())), bind_input(b, n, t)))
    monkeypatch.setattr(runtime, "bind_output", lambda b, n, t: (bound.append((n, t.data_ptr())), bind_output(b, n, t)))
    runs = []
    run = runtime.Session.run
    monkeypatch.setattr(runtime.Session, "run", lambda s, b, *graph: (runs.append(1), run(s, b, *graph)))
    expected = hf_generate(hf, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=None)

    def refuse(*args, **kwargs):
        raise AssertionError("a host copy in the decode loop")

    # transformers' preparation and the input checks read a few flags before the loop; from the
    # prefill on, nothing may be read back. (`Tensor.numpy` is left alone: it raises for a device
    # tensor, and on the CPU it is a view, no copy, which `inputs.argmax` takes for NumPy's argmax.)
    prefill = model.decoder.prefill

    def prefill_then_refuse(*args, **kwargs):
        for name in ("tolist", "item", "cpu", "__bool__"):
            monkeypatch.setattr(torch.Tensor, name, refuse)
        monkeypatch.setattr(ort.OrtValue, "numpy", refuse)
        return prefill(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(model.decoder, "prefill", prefill_then_refuse)
        try:
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                    pad_token_id=2)
        finally:
            monkeypatch.undo()
    assert torch.equal(tokens, expected)
    assert len(runs) == NEW_TOKENS  # one prefill and one run per further token
    kv_binds = [(n, p) for n, p in bound if n in kv_names]
    assert len(kv_binds) == 2 * 4 * len(layers)  # once each, in the prefill's binding and the steps'
    assert {p for n, p in kv_binds if "past" in n} == {p for n, p in kv_binds if "present" in n}  # shared
    assert len({p for _, p in kv_binds}) == 2 * len(layers)  # one buffer per layer for keys, one for values
    bound.clear()
    again = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=2)
    assert torch.equal(again, expected)
    assert not [n for n, _ in bound if n in kv_names]  # the same shape: the same buffers, still bound


STEPPING = ["llama", "gemma4", "gemma4_mobius", "qwen2_5_vl"]  # GQA, mixed head sizes, concatenating attention, mRoPE


@pytest.mark.parametrize("arch", STEPPING)
def test_stepping_forward_with_the_cache_equals_generate(build, arch):
    model, hf = load_pair(build(arch))
    ids, mask = left_padded_prompts([6, 13], seed=3)
    expected = hf_generate(hf, ids, mask, max_new_tokens=NEW_TOKENS)
    out = model(ids, attention_mask=mask, use_cache=True)
    assert isinstance(out.past_key_values, KVCache)
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(NEW_TOKENS - 1):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        out = model(tokens[-1][:, None], attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    assert torch.equal(torch.stack(tokens, 1), expected[:, 13:])
    cache = out.past_key_values
    assert cache.get_seq_length() == 13 + NEW_TOKENS - 1 and len(cache) == len(model.package.decoder.layers)
    for (key, value), kv in zip(cache, model.package.decoder.layers):
        assert key.shape == value.shape == (2, kv.num_kv_heads, 13 + NEW_TOKENS - 1, kv.head_size)


@pytest.mark.parametrize("arch", STEPPING)
def test_a_multi_token_step_matches_the_full_forward(build, arch):
    model, _ = load_pair(build(arch))
    ids, _ = left_padded_prompts([20], seed=8)
    first = model(ids[:, :7], use_cache=True)
    rest = model(ids[:, 7:], past_key_values=first.past_key_values, use_cache=True)
    full = model(ids).logits
    assert (rest.logits - full[:, 7:]).abs().max().item() < 1e-4
    assert (first.logits - full[:, :7]).abs().max().item() < 1e-4


TEXT_IDS = 505  # below the multimodal fixtures' media placeholders, whose ids differ from transformers' by design


def stepped_as_transformers(model, hf, steps, seeds, after=None):
    """Three left-padded prompts (`seeds`: theirs, the steps' tokens'), then each of `steps` (new tokens
    a row, `logits_to_keep`) over the cache, its logits against transformers' on the same weights
    (`after(new)` called after each), then generate going on from the cache as transformers does from
    the whole text (its one new token: the last of the text; transformers' own cache from a forward
    over left-padded rows took absolute positions, which its generate does not continue)."""
    ids, mask = left_padded_prompts([6, 13, 9], vocab=TEXT_IDS, seed=seeds[0])
    width = sum(new for new, _ in steps) + 1
    extra = torch.randint(4, TEXT_IDS, (3, width), generator=torch.Generator().manual_seed(seeds[1]))
    more = extra
    with torch.no_grad():
        reference = hf(ids, attention_mask=mask, use_cache=True)
    out = model(ids, attention_mask=mask, use_cache=True)
    cache, theirs = out.past_key_values, reference.past_key_values
    for new, keep in steps:
        step, mask = more[:, :new], torch.cat([mask, torch.ones(3, new, dtype=mask.dtype)], 1)
        more = more[:, new:]
        out = model(step, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=keep)
        with torch.no_grad():
            reference = hf(step, attention_mask=mask, past_key_values=theirs, use_cache=True, logits_to_keep=keep)
        assert out.logits.shape == reference.logits.shape
        assert (out.logits - reference.logits).abs().max().item() < 1e-4, (new, keep)
        cache, theirs = out.past_key_values, reference.past_key_values
        if after is not None:
            after(new)
    assert cache.get_seq_length() == 13 + extra.shape[1] - 1
    mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
    options = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=2, eos_token_id=None)
    with torch.no_grad():
        expected = hf.generate(torch.cat([ids, extra], 1), **options)
    assert torch.equal(model.generate(torch.cat([ids, extra], 1), past_key_values=cache, **options), expected)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "lfm2", "gemma4", "gemma4_mobius", "qwen2_5_vl"])
def test_a_multi_token_step_over_a_batch_equals_transformers(build, arch):
    """ONNX Runtime's GroupQueryAttention refuses several new tokens over a cache for more than one
    row; such a step runs in the extend graph or one token at a time, so that a batch continues by
    several tokens as in transformers (scoring code that extends a cached prefix, generate continuing
    a returned cache with more text): the logits asked for (all, `logits_to_keep` as a count or as
    positions) and the steps after it are transformers' on the same weights, past a sliding window too."""
    model, hf = load_pair(build(arch))
    stepped_as_transformers(model, hf, ((5, 0), (4, 2), (2, torch.tensor([0, 1]))), seeds=(12, 5))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_multi_token_step_over_a_batch_runs_in_one_run_on_a_cpu(build, arch, monkeypatch):
    """Where a step's tokens pay for it (3 or more a row), a batch's several tokens run in the writing
    extender (every row's tokens over its past in one run, a prefill chunk at a time), not a decode step
    a token: transformers' logits (all, or positions in the first and last chunk only, none in the
    middle one); 2 tokens, too few to pay, a decode step each; then generate from the cache."""
    _, hf = load_pair(build(arch))
    model = OrtModelForCausalLM.from_pretrained(build(arch).package_dir, prefill_chunk=4)
    assert extend.writing_extender(model.decoder) is not None  # made (and checked by a run) before the count
    runs = {"extend": 0, "token": 0}
    real_run, real_step = extend.Extender.run, decoder_module.Decoder.step

    def counted_run(self, *args, **kwargs):
        runs["extend"] += 1
        return real_run(self, *args, **kwargs)

    def counted_step(self, tokens, *args, **kwargs):
        runs["token"] += tokens.shape[1] == 1
        return real_step(self, tokens, *args, **kwargs)

    expected = {10: {"extend": 3, "token": 0}, 2: {"extend": 0, "token": 2}, 9: {"extend": 3, "token": 0},
                1: {"extend": 0, "token": 1}}

    def counted(new):
        assert runs == expected[new], (new, runs)
        runs.update(extend=0, token=0)

    monkeypatch.setattr(extend.Extender, "run", counted_run)
    monkeypatch.setattr(decoder_module.Decoder, "step", counted_step)
    steps = ((10, 0), (2, 0), (9, torch.tensor([0, 8])), (1, 0))
    stepped_as_transformers(model, hf, steps, seeds=(21, 6), after=counted)


def test_a_multi_token_step_over_a_batch_of_a_4_bit_package_gives_its_prefill_logits(build):
    """A 4-bit package's several tokens a row over a batch's cache run in one run on a CPU, in ONNX
    Runtime's fp32 path over the 4-bit weights as every run of several tokens a row (nbits.py): the
    logits of the package's own prefill of the whole rows, where a decode step a token (int8
    activations) gives others."""
    model = OrtModelForCausalLM.from_pretrained(build("llama", precision="int4").package_dir)
    ids = torch.randint(4, 500, (3, 21), generator=torch.Generator().manual_seed(9))
    whole = model(ids).logits[:, 13:]
    stepped = model(ids[:, 13:], past_key_values=model(ids[:, :13], use_cache=True).past_key_values).logits
    assert (stepped - whole).abs().max().item() < 1e-4


def test_the_cache_goes_by_either_name_as_in_transformers(llama_pair):
    """transformers 5.24 renamed `past_key_values` to `cache`: forward takes either name, and its output
    names the field as the installed transformers' own model does."""
    model, hf = llama_pair
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(4))
    theirs = hf(ids, use_cache=True)
    assert list(model(ids, use_cache=True).keys()) == list(theirs.keys())
    step = theirs.logits[:, -1:].argmax(-1)
    expected = hf(step, **{CACHE_NAME: theirs[CACHE_NAME]}).logits
    for name in ("cache", "past_key_values"):
        ours = model(step, **{name: model(ids, use_cache=True)[CACHE_NAME]})
        assert (ours.logits - expected).abs().max().item() < 1e-4, name
    cache = model(ids, use_cache=True)[CACHE_NAME]
    with pytest.raises(ValueError, match="as past_key_values or as cache, not both"):
        model(step, cache=cache, past_key_values=cache)


# ---- bad input ----------------------------------------------------------------------------------


def test_generation_past_the_context_is_refused(llama_pair):
    model, _ = llama_pair
    with pytest.raises(ValueError,
                       match="prompt of 250 tokens \\+ 10 new tokens exceeds the model's context length 256"):
        model.generate(torch.full((1, 250), 5), max_new_tokens=10)


def test_unsupported_generation_options_are_named(llama_pair):
    model, _ = llama_pair
    ids = torch.full((1, 4), 5)
    with pytest.raises(ValueError, match="generator= applies to greedy decoding and sampling"):
        model.generate(ids, max_new_tokens=3, num_beams=2, generator=torch.Generator())
    with pytest.raises(ValueError, match="arguments it does not use: frobnicate"):
        model.generate(ids, max_new_tokens=3, frobnicate=True)
    with pytest.raises(ValueError, match="stop strings.*could not locate a tokenizer"):
        model.generate(ids, max_new_tokens=3, stop_strings=["x"])
    with pytest.raises(ValueError, match="max_length 4 is not above the prompt length 4"):
        model.generate(ids, max_length=4)


def test_bad_cache_steps_are_refused(llama_pair):
    model, _ = llama_pair
    ids, mask = left_padded_prompts([3, 5], seed=1)
    out = model(ids, attention_mask=mask, use_cache=True)
    with pytest.raises(TypeError, match="past_key_values must be the KVCache this model returned"):
        model(ids[:, :1], past_key_values=((torch.zeros(1),),))
    with pytest.raises(ValueError, match=r"attention_mask shape \(2, 5\) does not match .* expected \(2, 6\)"):
        model(ids[:, :1], attention_mask=mask, past_key_values=out.past_key_values)
    with pytest.raises(ValueError, match="token id 600"):
        model(torch.tensor([[5], [600]]), past_key_values=out.past_key_values)
