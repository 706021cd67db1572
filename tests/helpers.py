"""What the tests share: the fixture architectures, the ortmodule / transformers model pairs,
padded batches, the live server and its worker hold, and the references several files compare
against. Tests import from here (fixtures live in conftest.py); no test module imports another."""

import inspect
import os
import random
import socket
import sys
import threading
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoModelForCausalLM,
    Cache,
    DynamicCache,
    Mistral3ForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from ortmodule import OrtModelForCausalLM
from ortmodule.cache import KVCache


def fuzz_seeds(variable: str, default: int, scale: float = 1) -> range:
    """The seeds of a fuzz test: `default` of them, or as many as the environment variable `variable`
    says, times `scale`; counted from `FUZZ_SEED_START` (0 unless set), so that a long run can draw
    cases that no earlier run drew (docs/reliability.md)."""
    start = int(os.environ.get("FUZZ_SEED_START", 0))
    return range(start, start + int(int(os.environ.get(variable, default)) * scale))


# Architectures every parity test runs on (Gemma 3 alternates sliding-window and full layers;
# the Gemma 4 packages mix KV head sizes per layer, and two of them are multimodal: an embedding
# model feeds the decoder; see ortmodule_dev/fixtures.py).
GEMMA4 = ["gemma4", "gemma4_embeds", "gemma4_mobius"]
ARCHES = ["llama", "qwen3", "gemma3", "phi3", "mistral", "qwen2", *GEMMA4]
# Packages lm-eval's hf backend cannot load as a reference (no AutoModelForCausalLM class):
# Qwen2.5-VL, whose decoder takes 3-D mRoPE position_ids. The model-level tests cover it.
MODEL_ARCHES = [*ARCHES, "qwen2_5_vl"]

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


_models = {}


def drop_restored_methods(obj) -> list[str]:
    """Take off `obj` the instance attributes that are its own class's methods bound to it (what
    `obj.name` gives anyway): pytest before 9.2 undoes `monkeypatch.setattr(obj, "method", ...)` on an
    instance by setting the method it read back *on the instance* (pytest #10644), where it hides every
    later test's patch of the class (`monkeypatch.setattr(Decoder, "step", ...)`) on the objects the
    tests share (load_pair's models). The names taken off."""
    own = getattr(obj, "__dict__", {})
    kind = type(obj)
    dropped = [name for name, value in own.items() if inspect.ismethod(value) and value.__self__ is obj
               and inspect.getattr_static(kind, name, None) is value.__func__]
    for name in dropped:
        del own[name]
    return dropped


def shared_objects():
    """The objects tests share between them: load_pair's models and their decoders."""
    for ort_model, hf_model in _models.values():
        yield from (ort_model, ort_model.decoder, hf_model)


def reference_class(fixture):
    """The transformers class of a fixture's checkpoint (the Qwen-VL models have no causal-LM auto class)."""
    vision_language = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen2_vl": Qwen2VLForConditionalGeneration,
                       "qwen3_vl": Qwen3VLForConditionalGeneration,
                       "qwen2_5_vl_builder": Qwen2_5_VLForConditionalGeneration,
                       "mistral3": Mistral3ForConditionalGeneration}
    return vision_language.get(fixture.spec.arch, AutoModelForCausalLM)


def load_pair(fixture, device="cpu"):
    """The ortmodule model and the transformers reference on the same weights (cached per session).
    transformers' Qwen-VL models keep the last prompt's `rope_deltas` for their cached steps, and a
    text prompt does not replace them: they are cleared here, so no test steps with another's."""
    key = (fixture.package_dir, device)
    if key not in _models:
        ort_model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=device)
        hf_model = reference_class(fixture).from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
        _models[key] = (ort_model, hf_model)
    hf_model = _models[key][1]
    if getattr(getattr(hf_model, "model", None), "rope_deltas", None) is not None:
        hf_model.model.rope_deltas = None
    return _models[key]


def float32_logits_copy(fixture, folder):
    """A copy of a half-precision fixture package whose graph casts its logits to float32 at the
    end, as the builder's bf16 packages do (`/lm_head/MatMul` then `/lm_head/Cast`; ONNX Runtime has
    no bf16 kernels on a CPU, so fp16 stands in). The weights are a copy of the fixture's."""
    import shutil

    import onnx
    from onnx import TensorProto, helper

    folder.mkdir(parents=True)
    source = fixture.package_dir
    for name in ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "model.onnx.data"):
        shutil.copy(source / name, folder / name)
    proto = onnx.load(str(source / "model.onnx"), load_external_data=False)
    for node in proto.graph.node:
        node.output[:] = ["half_logits" if name == "logits" else name for name in node.output]
    proto.graph.node.append(helper.make_node("Cast", ["half_logits"], ["logits"], to=TensorProto.FLOAT,
                                             name="/lm_head/Cast"))
    output = next(o for o in proto.graph.output if o.name == "logits")
    assert output.type.tensor_type.elem_type == TensorProto.FLOAT16
    output.type.tensor_type.elem_type = TensorProto.FLOAT
    onnx.save(proto, str(folder / "model.onnx"))
    return folder


def right_padded_batch(lengths, vocab=512, seed=0, pad_id=2):
    """Random ids (above the special tokens) with a right-padded mask."""
    gen = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(4, vocab, (len(lengths), length), generator=gen)
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, pad_id), mask


def left_padded_batch(lengths, vocab=512, seed=0, pad_id=2):
    """Random ids (above the special tokens) with a left-padded mask, as HF tokenizers give for generate."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(4, vocab, (len(lengths), width), generator=gen)
    mask = (torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, pad_id), mask


def padded_rows(rows, left=True, pad_id=2):
    """Given token rows in one batch, padded on the left (as for generate) or the right, with their mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


def grouped_rows(context_lengths, widths, seed):
    """Rows of groups that share a context (lm-eval's multiple-choice shape), as
    `scoring.grouped_loglikelihood_totals` takes them: per group a random context of each length,
    continued by random tokens of each of `widths`. Returns (rows, groups, starts, targets)."""
    generator = torch.Generator().manual_seed(seed)
    rows, groups, starts, targets = [], [], [], []
    for group, context_length in enumerate(context_lengths):
        context = torch.randint(4, 500, (context_length,), generator=generator).tolist()
        for width in widths:
            rest = torch.randint(4, 500, (width,), generator=generator).tolist()
            rows.append((context + rest)[:-1])
            groups.append(group)
            starts.append(context_length - 1)
            targets.append(rest)
    return rows, groups, starts, targets


def kept_prefix_calls(seed):
    """`grouped_loglikelihood_totals` calls for `sharing.KeptPrefixes`, as (rows, groups, starts,
    targets) each: 40 tokens of examples prefilled (call 1), then rows that share exactly them, more
    than them, less of them (scored at the shorter prefix's last token, then after it), rows of 36
    other tokens beside them (prefilled: not kept), and both again."""
    rng = random.Random(seed)
    examples = [rng.randrange(4, 500) for _ in range(40)]
    other = [rng.randrange(4, 500) for _ in range(36)]

    def tokens(n):
        return [rng.randrange(4, 500) for _ in range(n)]

    extra = tokens(3)
    calls = [  # rows as (prefix, question), and the first position scored counted from the question
        ([(examples, tokens(6)), (examples, tokens(4)), (examples, tokens(9))], 0),
        ([(examples, tokens(5)), (examples, tokens(7))], 0),
        ([(examples + extra, tokens(4)), (examples + extra, tokens(6))], 0),
        ([(examples[:-5], tokens(5)), (examples[:-5], tokens(6))], 0),
        ([(examples[:-5], tokens(5)), (examples[:-5], tokens(6))], 2),
        ([(other, tokens(5)), (other, tokens(4)), (examples, tokens(3)), (examples, tokens(6))], 1),
        ([(other, tokens(3)), (examples, tokens(4)), (other, tokens(6)), (examples, tokens(2))], 1),
    ]
    out = []
    for pairs, scored in calls:
        rows = [prefix + question for prefix, question in pairs]
        starts = [len(prefix) - 1 + scored for prefix, _ in pairs]
        targets = [row[start + 1:] + [rng.randrange(4, 500)] for row, start in zip(rows, starts)]
        out.append((rows, [0 if prefix[:10] == examples[:10] else 1 for prefix, _ in pairs], starts, targets))
    return out


def split_stops(texts: list[str]) -> list[str]:
    """Two characters such that every text holds one in its first half, and neither is in every text."""
    def early(text, c):
        return c in text[: len(text) // 2]

    chars = sorted({c for text in texts for c in text if c.isalpha()})
    for x in chars:
        for y in chars:
            if all(early(t, x) or early(t, y) for t in texts) and not all(x in t for t in texts) \
                    and not all(y in t for t in texts):
                return [x, y]
    raise AssertionError(f"no two characters split {texts}")


def stop_requests(hf_lm, seed: int, rows: int = 8, max_gen_toks: int = 32):
    """lm-eval `generate_until` requests of `rows` prompts of random words whose rows write different stop
    sequences (two characters, `split_stops` of what lm-eval's `hf_lm` writes without any), neither of
    them every row: (the requests, `hf_lm`'s answers without stop sequences)."""
    from lm_eval.api.instance import Instance

    rng = random.Random(seed)
    tokenizer = hf_lm.tokenizer
    prompts = [" ".join(tokenizer.decode([rng.randrange(3, 500)]) for _ in range(rng.randint(3, 9)))
               for _ in range(rows)]
    free = hf_lm.generate_until([Instance("generate_until", None, (p, {"until": [], "max_gen_toks": max_gen_toks}), i)
                                 for i, p in enumerate(prompts)], disable_tqdm=True)
    until = split_stops(free)
    return [Instance("generate_until", None, (p, {"until": until, "max_gen_toks": max_gen_toks}), i)
            for i, p in enumerate(prompts)], free


OPENAI_NAME = "tiny-llama"
# A chat template for the fixture's tokenizer (the real SmolLM2 package brings its own).
# A chat template in the form of real ones: a role it refuses, as Gemma's and Mistral's templates refuse
# some (`raise_exception`), and a variable of its own (`chat_template_kwargs`), as Qwen3's `enable_thinking`.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}"
    "{% endif %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


# What /v1/score and ortmodule.score are checked with (tests/test_score_api.py, tests/test_score_server.py).
SCORE_QUERY = "the quick brown fox jumps over the lazy dog, and then it asks which of these"
SCORE_ITEMS = [" a cat", " is it true", " dog", " zebra crossing the road today at noon"]


def score_reference(hf, tokenizer, query, items, labels, apply_softmax, item_first):
    """SGLang's own check: one transformers forward per prompt, the last position's logits."""
    out = []
    for item in items:
        if isinstance(query, str):
            ids = tokenizer(item + query if item_first else query + item, return_tensors="pt").input_ids
        else:
            ids = torch.tensor([item + query if item_first else query + item])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids).logits[0, -1].double(), -1)[labels]
        out.append(torch.softmax(logprobs, -1) if apply_softmax else logprobs.exp())
    return torch.stack(out)


def labels_for(tokenizer):
    return [tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "c")] + [5, 300]


def tokenizer_with(package_dir, tokens: dict[int, str], template: str):
    """The fixture package's tokenizer with special tokens at the fixture's reserved ids (`tokens`:
    {id: text}; the ids before them filled with placeholders) and a chat template."""
    from ortmodule import load_tokenizer

    tokenizer = load_tokenizer(package_dir)
    names = [tokens.get(i, f"<|media{i}|>") for i in range(len(tokenizer), max(tokens) + 1)]
    tokenizer.add_special_tokens({"additional_special_tokens": names})
    assert tokenizer.convert_tokens_to_ids(list(tokens.values())) == list(tokens)
    tokenizer.chat_template = template
    return tokenizer


def steps_beside(model, hf, out, ref, mask, **asked):
    """Steps of two new tokens (one run at a time inside ortmodule: several tokens over a batch's
    cache) and of one, over ortmodule's and transformers' caches of a two-row prompt (`out`, `ref`,
    its `mask`), with the same keywords: yields each step's (ours, theirs)."""
    ours, theirs = out.past_key_values, ref.past_key_values
    generator = torch.Generator().manual_seed(4)
    for new in (2, 1):
        tokens = torch.randint(4, 500, (2, new), generator=generator)
        mask = torch.cat([mask, torch.ones(2, new, dtype=mask.dtype)], 1)
        out = model(tokens, attention_mask=mask, past_key_values=ours, **asked)
        with torch.inference_mode():
            ref = hf(tokens, attention_mask=mask, past_key_values=theirs, **asked)
        yield out, ref
        ours, theirs = out.past_key_values, ref.past_key_values


def check_config_default(model, ids, mask, name: str, field: str, count: int) -> None:
    """transformers' models read `config.<name>` (output_hidden_states, output_attentions) where the call
    says nothing: set, the output's `field` holds `count` tensors; the call's False still wins."""
    setattr(model.config, name, True)
    try:
        assert len(getattr(model(ids, attention_mask=mask), field)) == count
        assert getattr(model(ids, attention_mask=mask, **{name: False}), field) is None
    finally:
        setattr(model.config, name, False)


def hf_greedy(hf, ids: list[int], new: int, **options) -> list[int]:
    """transformers' greedy continuation of one prompt: `new` tokens, no end-of-sequence stop
    (`options`: more of `generate`'s, e.g. `repetition_penalty`)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0, **options)
    return out[0, len(ids):].tolist()


def grammar_greedy(hf, tokenizer, ids: list[int], grammar: str, new: int, after: str | None = None,
                   bias: dict[int, float] | None = None) -> tuple[list[int], bool]:
    """transformers' greedy tokens after `ids` kept to an llguidance `grammar` (a logits processor written here on
    llguidance's own matcher: the tokens it cannot take next masked; generation stopped where it is complete, or
    at the end token), and whether the grammar was complete. `after`: the output is free until its text holds
    this marker, the grammar holding what follows it (vLLM's structured output after a thinking model's
    reasoning); `bias`: added to these tokens' logits first (OpenAI's `logit_bias`)."""
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    matcher = LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=hf.config.vocab_size), grammar)
    seen, held = [], []  # the tokens the matcher took; those before the marker ended, which it never sees

    def catch_up(input_ids):
        for token in input_ids[0, len(ids) + len(seen) + len(held):].tolist():
            if after is not None and after not in tokenizer.decode(held):
                held.append(token)
            else:
                matcher.consume_token(token)
                seen.append(token)

    class Mask(LogitsProcessor):
        def __call__(self, input_ids, scores):
            catch_up(input_ids)
            for token, value in (bias or {}).items():
                scores[:, token] += value
            if after is not None and after not in tokenizer.decode(held):
                return scores
            allowed = torch.tensor(list(matcher.compute_logit_bias())) > 0
            return scores.masked_fill(~allowed[None], float("-inf"))

    class Complete(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            catch_up(input_ids)
            return torch.tensor([matcher.is_stopped()])

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=new, do_sample=False, pad_token_id=0,
                          logits_processor=LogitsProcessorList([Mask()]),
                          stopping_criteria=StoppingCriteriaList([Complete()]))
    tokens = out[0, len(ids):].tolist()
    catch_up(out)
    return tokens, matcher.is_stopped()


def expected_text(tokenizer, tokens: list[int], stop=()) -> tuple[str, str]:
    """What a completion of these greedy tokens reads: cut at end-of-sequence, then before a stop."""
    eos = tokenizer.eos_token_id
    reason = "length"
    if eos in tokens:
        tokens, reason = tokens[: tokens.index(eos)], "stop"
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    if cuts:
        text, reason = text[: min(cuts)], "stop"
    return text, reason


class LiveServer:
    """uvicorn in a thread on a free port of 127.0.0.1."""

    def __init__(self, app):
        import httpx
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.app = app
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def stop(self):
        self.client.close()
        self.server.should_exit = True
        self.thread.join(10)


def served_live(fixture, chat_template: str, added: tuple[str, ...] = (), special: bool = False, **settings):
    """`ortmodule serve`'s app over a fixture package, live, its tokenizer given `chat_template` and the tokens
    `added` (ids from the tokenizer's size: the fixture's model vocabulary must hold them; `special`: as special
    tokens): (server, model, transformers model, tokenizer)."""
    from ortmodule import load_tokenizer
    from ortmodule.serving import create_app

    model, hf = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    tokenizer.chat_template = chat_template
    if added:
        tokenizer.add_tokens(list(added), special_tokens=special)
        assert len(tokenizer) <= hf.config.vocab_size
    return LiveServer(create_app(model, tokenizer, name=OPENAI_NAME, window_ms=20, **settings)), model, hf, tokenizer


def hold_worker(served):
    """Make the server's model thread block on the work it runs (a batch of score or prompt jobs, a
    prefill of new generations) until `release` is set, once the jobs have left the queue; returns
    the events (`started`: work is held, `release`) and the list of the batch sizes run."""
    started, release, scored = threading.Event(), threading.Event(), []
    engine = served.engine
    start_together, prefill_short = engine.start_together, engine.generations._prefill_short

    def held_batch(kind, jobs):
        scored.append(len(jobs))
        started.set()
        release.wait(30)
        return start_together(kind, jobs)

    def held_prefill(rows):
        started.set()
        release.wait(30)
        return prefill_short(rows)

    engine.start_together, engine.generations._prefill_short = held_batch, held_prefill
    return started, release, scored


def hold_decode(served):
    """Make the server's model thread block in its next decode step (a running batch's) until `release`
    is set; returns the events (`started`: a step is held, `release`). Later steps run unheld."""
    started, release = threading.Event(), threading.Event()
    generations = served.engine.generations
    decode = generations.decode

    def held_decode():
        if not started.is_set():
            started.set()
            release.wait(30)
        return decode()

    generations.decode = held_decode
    return started, release


def one_held_one_waiting(live: LiveServer, pool, started, body: dict, path: str = "/v1/completions") -> tuple:
    """With the worker held (`hold_worker`'s `started`): one request of `body` in the worker and one
    waiting in the queue (a server of `max_queue=1` is then full); the futures of their responses."""
    import httpx

    first = pool.submit(httpx.post, live.url + path, json=body, timeout=60)
    assert started.wait(30)
    second = pool.submit(httpx.post, live.url + path, json=body, timeout=60)
    deadline = time.monotonic() + 10
    while live.client.get("/metrics?format=json").json()["waiting"] < 1:
        assert time.monotonic() < deadline, "the second request never reached the queue"
        time.sleep(0.02)
    return first, second


class ScalarReads(TorchDispatchMode):
    """Counts torch's reads of one value out of a tensor (`bool()`, `int()`, `.item()`): on CUDA
    each waits for the device's queued work, which the scoring paths never do before their answers."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
             torch.ops.aten.item.default)

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


class BlockingUploads:
    """Records where ortmodule's code copies host data to a device other than through
    `inputs.to_device`: `torch.tensor(..., device=...)`, `torch.as_tensor(..., device=...)` and
    `tensor.to(device)` without `non_blocking`. On CUDA such a copy (from pageable memory) makes the
    host wait for every run queued on the stream, so the device idles while the host builds the
    next one. A CPU cannot tell a host tensor from a device one, so here every such call made by
    ortmodule counts: its rule is that host data goes up through `to_device` alone
    (tests/test_cuda.py checks on a GPU that the calls return before the device catches up)."""

    def __init__(self):
        self.calls: list[str] = []

    def _record(self):
        caller = sys._getframe(2)
        if caller.f_globals.get("__name__", "").startswith("ortmodule") and caller.f_code.co_name != "to_device":
            self.calls.append(f"{caller.f_globals['__name__']}:{caller.f_lineno} ({caller.f_code.co_name})")

    def __enter__(self):
        self.saved = torch.tensor, torch.as_tensor, torch.Tensor.__dict__.get("to")
        tensor, as_tensor, to = torch.tensor, torch.as_tensor, torch.Tensor.to

        def made(make):
            def call(data, *args, **kwargs):
                if kwargs.get("device") is not None:
                    self._record()
                return make(data, *args, **kwargs)
            return call

        def moved(self_tensor, *args, **kwargs):
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            if device is not None and not non_blocking:
                self._record()
            return to(self_tensor, *args, **kwargs)

        torch.tensor, torch.as_tensor, torch.Tensor.to = made(tensor), made(as_tensor), moved
        return self

    def __exit__(self, *exc):
        torch.tensor, torch.as_tensor = self.saved[:2]
        if self.saved[2] is None:
            del torch.Tensor.to
        else:
            torch.Tensor.to = self.saved[2]


class CachePair:
    """ortmodule and transformers stepped side by side, each with its own cache and the caller's mask; or,
    without `reference_cache`, ortmodule's alone (the caller runs transformers afresh: `caches[1]` None)."""

    def __init__(self, models, ids, mask, reference_cache: bool = True):
        self.models, self.mask = models, mask
        positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)  # what transformers' generate passes
        # transformers' sliding and linear-attention (hybrid) layers keep what a crop needs only once
        # recording: from before the prompt, or a hybrid's crop into the prompt is silently wrong there.
        recording = DynamicCache(config=models[1].config)
        recording.activate_past_recording()
        runs = zip(models, ({}, {"past_key_values": recording})) if reference_cache else [(models[0], {})]
        with torch.inference_mode():
            outs = [m(ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra) for m, extra in runs]
        self.caches = [out.past_key_values for out in outs] + ([] if reference_cache else [None])
        assert isinstance(self.caches[0], KVCache) and isinstance(self.caches[0], Cache)
        assert self.caches[1] is None or isinstance(self.caches[1], DynamicCache)

    def step(self, tokens):
        """Append one token per row (`[B]`, or `[B, s]`: s tokens in one forward call) to both; the
        logits of each at the last (None for a reference without its cache)."""
        tokens = tokens[:, None] if tokens.dim() == 1 else tokens
        new = tokens.shape[1]
        self.mask = torch.cat([self.mask, torch.ones(self.mask.shape[0], new, dtype=self.mask.dtype)], 1)
        positions = self.mask.cumsum(1)[:, -new:] - 1
        with torch.inference_mode():
            return [None if c is None else m(tokens, attention_mask=self.mask, position_ids=positions,
                                              past_key_values=c, use_cache=True).logits[:, -1]
                    for m, c in zip(self.models, self.caches)]

    def each(self, method, *args):
        for cache in self.caches:
            if cache is not None:
                getattr(cache, method)(*args)

    def agree(self, tokens):
        ours, theirs = self.step(tokens)
        assert (ours - theirs).abs().max().item() < 1e-4
        assert self.caches[0].get_seq_length() == self.caches[1].get_seq_length() == self.mask.shape[1]


_IMAGE_TASK = """task: {name}
custom_dataset: !function {name}_utils.docs
test_split: test
output_type: generate_until
doc_to_image: !function {name}_utils.doc_to_image
doc_to_text: "<image> Say {{{{word}}}}:"
doc_to_target: "{{{{word}}}}"
generation_kwargs: {generation}
metric_list:
  - metric: exact_match
metadata:
  version: 0
"""
_IMAGE_TASK_UTILS = '''import datasets

import numpy as np
from PIL import Image


def docs(**kwargs):
    rows = [dict(word=w, seed=i, h={height} + {step} * (i % 3), w={width} - {step} * (i % 2))
            for i, w in enumerate("{words}")]
    return {{"test": datasets.Dataset.from_list(rows)}}


def doc_to_image(doc):
    pixels = np.random.RandomState(doc["seed"]).rand(doc["h"], doc["w"], 3) * 255
    return [Image.fromarray(pixels.astype("uint8"))]
'''


def check_copies_take_their_images(model, inputs, options) -> None:
    """generate's copies of each row (num_return_sequences, top_k=1: each greedy) take their row's
    images: the same tokens as greedy, and the first step's logits copy for copy (tokens alone can
    agree on random weights where the images are swapped)."""
    scored = dict(options, return_dict_in_generate=True, output_logits=True)
    greedy = model.generate(**inputs, **scored, do_sample=False)
    copies = model.generate(**inputs, **scored, do_sample=True, top_k=1, num_return_sequences=2)
    assert torch.equal(copies.sequences, greedy.sequences.repeat_interleave(2, 0))
    assert torch.allclose(copies.logits[0], greedy.logits[0].repeat_interleave(2, 0), atol=1e-5, rtol=1e-5)


def check_hidden_states_with_images(model, hf, inputs, layers: int):
    """`output_hidden_states=True` over a prompt batch with images into a cache: as many states as
    transformers gives (`layers` + 1) and each of them equal at the real positions, the backbone's last
    one too. Returns
    ortmodule's output (its cache continues the prompt)."""
    real = inputs["attention_mask"].bool()
    out = model(**inputs, use_cache=True, output_hidden_states=True)
    with torch.no_grad():
        expected = hf(**inputs, output_hidden_states=True)
    assert len(out.hidden_states) == len(expected.hidden_states) == layers + 1
    for ours, theirs in zip(out.hidden_states, expected.hidden_states):
        assert torch.allclose(ours[real], theirs[real], atol=1e-4, rtol=1e-4)
    # the backbone (`model.base_model`, as trl's distillation calls a teacher's) over the images too
    last = model.base_model(**inputs, use_cache=False).last_hidden_state
    assert torch.allclose(last[real], expected.hidden_states[-1][real], atol=1e-4, rtol=1e-4)
    return out


GREEDY_AND_SAMPLED = (dict(do_sample=False), dict(do_sample=True, top_k=20))


def check_generate_modes(model, hf, inputs, options, modes=GREEDY_AND_SAMPLED) -> None:
    """`generate` in each of `modes` gives transformers' tokens, both seeded alike (sampling draws
    the same numbers in the same order)."""
    for mode in modes:
        torch.manual_seed(7)
        expected = hf.generate(**inputs, **options, **mode)
        torch.manual_seed(7)
        assert torch.equal(model.generate(**inputs, **options, **mode), expected), mode


def check_image_step_and_loss(model, hf, inputs, cache, marks=lambda ids: {}) -> None:
    """After a prompt batch with images (`inputs`, three rows) into `cache`: a token more on each row
    gives transformers' logits over the whole sequence (`marks(ids)`: the processor's token-type
    keywords for those ids), and the prompt's loss is transformers'."""
    tokens = torch.tensor([[7], [8], [9]])
    mask = torch.cat([inputs["attention_mask"], torch.ones(3, 1, dtype=torch.int64)], 1)
    step = model(tokens, attention_mask=mask, past_key_values=cache)
    ids = torch.cat([inputs["input_ids"], tokens], 1)
    with torch.no_grad():
        whole = hf(**dict(inputs, input_ids=ids, attention_mask=mask, **marks(ids)))
        real = inputs["attention_mask"].bool()
        after_padding = torch.cat([torch.ones_like(real[:, :1]), real[:, :-1]], 1) == 0
        labels = inputs["input_ids"].masked_fill(~real | after_padding, -100)
        expected_loss = hf(**inputs, labels=labels).loss
    assert torch.allclose(step.logits[:, -1], whole.logits[:, -1], atol=1e-4, rtol=1e-4)
    assert torch.allclose(model(**inputs, labels=labels).loss, expected_loss, atol=1e-5, rtol=1e-5)


def check_half_precision_images(model, hf, inputs) -> None:
    """A fp16 package (mobius-onnx's `--dtype f16`) with images against transformers' fp32 on the same
    weights: fp16 logits within fp16's rounding (a wrong feature or position is off by about the
    logits' scale) and the same greedy tokens."""
    assert model.dtype == torch.float16
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        expected = hf(**inputs).logits[real]
    ours = model(**inputs).logits[real]
    assert ours.dtype == torch.float16
    assert (ours.float() - expected).abs().max() < 0.01 * expected.abs().max()
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    if hasattr(hf.model, "rope_deltas"):  # Qwen-VL's offsets from the forward above
        hf.model.rope_deltas = None
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **options), hf.generate(**inputs, **options))


def check_image_task(folder, name, sizes, processor, hf, package_dir, **options) -> None:
    """ortmodule-multimodal's responses to `image_task_responses`' task equal hf-multimodal's, one a
    document, not all empty."""
    responses = image_task_responses(folder, name, sizes, processor, hf, package_dir, **options)
    assert len(responses["hf"]) == len(sizes[3]) and any(responses["hf"])
    assert responses["ortmodule"] == responses["hf"]


def hf_multimodal(hf, processor, **options):
    """lm-eval's `hf-multimodal` backend on the transformers model `hf` on the CPU, given the processor object."""
    from lm_eval.models.hf_vlms import HFMultimodalLM

    class Reference(HFMultimodalLM):
        def _create_tokenizer(self, *args, **kwargs):
            self.processor, self.tokenizer = processor, processor.tokenizer

    return Reference(pretrained=hf, device="cpu", **options)


def image_task_responses(folder, name, sizes, processor, hf, package_dir, hf_batch_size=3, batch_size=3,
                         generation=None, hf_responses=None, **options) -> dict:
    """An offline lm-eval task of MMMU's form (`doc_to_image`, `generate_until`) named `name` in
    `folder`, its documents' images of `sizes` (first height, first width, step between documents,
    and one word per document), run by lm-eval's `hf-multimodal` on `hf` (`hf_batch_size`) and by
    ortmodule-multimodal on the package (`batch_size`, the model arguments `options`), both with
    `processor` and the task's `generation` arguments (greedy, to a new line, 6 new tokens unless
    given): {"hf": responses, "ortmodule": responses}. `hf_responses`: hf-multimodal's of an earlier call on the
    same task and model, taken instead of running it again."""
    import json

    import lm_eval

    from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM
    from ortmodule.tasks import task_manager

    height, width, step, words = sizes
    generation = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False, **(generation or {})}
    (folder / f"{name}.yaml").write_text(_IMAGE_TASK.format(name=name, generation=json.dumps(generation)))
    (folder / f"{name}_utils.py").write_text(_IMAGE_TASK_UTILS.format(height=height, width=width, step=step,
                                                                        words=words))

    responses = {} if hf_responses is None else {"hf": hf_responses}
    hf_options = {key: value for key, value in options.items() if key not in ("token_budget", "max_batch_size")}
    backends = (("hf", lambda: hf_multimodal(hf, processor, batch_size=hf_batch_size, **hf_options)),
                ("ortmodule", lambda: OrtModuleMultimodalLM(package_dir, processor=processor, batch_size=batch_size,
                                                            device="cpu", **options)))
    for kind, lm in ((kind, make()) for kind, make in backends if kind not in responses):
        result = lm_eval.simple_evaluate(model=lm, tasks=[name], log_samples=True,
                                         task_manager=task_manager([name], folder))
        samples = sorted(result["samples"][name], key=lambda sample: sample["doc_id"])
        responses[kind] = [sample["resps"][0][0] for sample in samples]
    return responses


def png_url(size, seed):
    """A random RGB picture of `size` (h, w) as a base64 PNG data: URL, and the picture."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    state = np.random.RandomState(seed)
    picture = Image.fromarray((state.rand(*size, 3) * 255).astype("uint8"))
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode(), picture


class ImageChats:
    """Two chats with images for a server named "vl": one image after text; a system message, then two
    images around text (pictures of `sizes`, the first image used twice)."""

    def __init__(self, sizes):
        (first, one), (second, two) = png_url(sizes[0], 1), png_url(sizes[1], 2)
        self.chats = [
            [{"role": "user", "content": [{"type": "text", "text": "what is in the picture"},
                                          {"type": "image_url", "image_url": {"url": first}}]}],
            [{"role": "system", "content": "look closely"},
             {"role": "user", "content": [{"type": "image_url", "image_url": {"url": second, "detail": "auto"}},
                                          {"type": "text", "text": "and this one"},
                                          {"type": "image_url", "image_url": {"url": first}}]}],
        ]
        self.pictures = [[one], [two, one]]

    @staticmethod
    def chat(server, messages, **options):
        body = {"model": "vl", "messages": messages, "temperature": 0, "max_tokens": 8, **options}
        return server.client.post("/v1/chat/completions", json=body)

    @staticmethod
    def completion(server):
        body = {"model": "vl", "prompt": [5, 6, 7, 8], "temperature": 0, "max_tokens": 8}
        return server.client.post("/v1/completions", json=body)

    def send(self, server, **options):
        """The two chats (with the request's `options`) and a text completion at once: their answers,
        the completion's last."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(self.chat, server, messages, **options) for messages in self.chats]
            answers.append(pool.submit(self.completion, server))
            return [answer.result() for answer in answers]

    def check(self, server, tokenizer, hf, process, **options) -> list:
        """Send the chats (with log-probabilities and the request's `options`) beside a completion: each answer's
        tokens, their log-probabilities (within 1e-4) and its prompt's length as transformers' greedy `generate`
        (`hf`) on `process(text, images)`, the processor's output for the template's text and the chat's
        images; the completion as alone. The processor outputs, for the caller's own checks."""
        answers, made = self.send(server, logprobs=True, **options), []
        for messages, images, answer in zip(self.chats, self.pictures, answers):
            assert answer.status_code == 200, answer.text
            made.append(process(tokenizer.decode(self.template_ids(tokenizer, messages)), images))
            with torch.no_grad():
                out = hf.generate(**made[-1], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  return_dict_in_generate=True, output_logits=True)
            tokens = out.sequences[0, made[-1]["input_ids"].shape[1]:]
            choice = answer.json()["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == expected_text(tokenizer, tokens.tolist())
            chosen = [torch.log_softmax(step[0], -1)[token].item() for step, token in zip(out.logits, tokens)]
            served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
            assert len(served) == len(chosen) and max(abs(a - b) for a, b in zip(served, chosen)) < 1e-4
            assert answer.json()["usage"]["prompt_tokens"] == made[-1]["input_ids"].shape[1]
        assert answers[-1].status_code == 200
        assert answers[-1].json()["choices"][0]["text"] == self.completion(server).json()["choices"][0]["text"]
        return made

    @staticmethod
    def template_ids(tokenizer, messages) -> list[int]:
        """The chat template's ids of `messages`, each image part rendered as `{"type": "image"}`."""
        parts = [[{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]
                 if isinstance(m["content"], list) else m["content"] for m in messages]
        return tokenizer.apply_chat_template([{**m, "content": c} for m, c in zip(messages, parts)],
                                             add_generation_prompt=True, return_dict=False)


def mis_scale_attention(monkeypatch, factor: float = 2.0) -> None:
    """Every extend and prefill graph ortmodule makes from here on with its `Attention` nodes' scale
    multiplied by `factor`: a rewrite that computes something else, for the first-run checks."""
    import onnx

    from ortmodule import extend

    made = extend.extend_graph_bytes

    def mis_scaled(*args, **kwargs):
        proto = onnx.load_from_string(made(*args, **kwargs))
        for node in proto.graph.node:
            for attribute in node.attribute:
                if node.op_type == "Attention" and attribute.name == "scale":
                    attribute.f *= factor
        return proto.SerializeToString()

    monkeypatch.setattr(extend, "extend_graph_bytes", mis_scaled)
