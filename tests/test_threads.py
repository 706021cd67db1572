"""One model, many threads: forward, generate and score called concurrently give exactly what the
same calls give one after another (each thread prefills into its own scratch KV buffer; caches of
generate, score and `use_cache` belong to their call), scores whose items run several to a row of
the extend run too, generations whose prompts' rests run in one extend run over their common
beginning (shared_prompts.py), and batches stepped by several tokens over their caches (decoder.py)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import load_pair

import ortmodule


def calls(vocab: int):
    """A mixed list of calls, each a function of the model returning tensors: mostly prefills of
    different shapes (long enough for runs on several threads to overlap), some generate and score."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(40):
        batch, length = 1 + i % 4, 40 + (37 * i) % 200
        ids = torch.randint(4, vocab, (batch, length), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, : i % 4] = 0  # some rows left-padded
        kind = i % 8
        if i % 16 == 5:  # a batch stepped by 6 tokens over its cache: on a CPU one run of the writing extender
            out.append(lambda m, ids=ids, mask=mask: m(ids[:, -6:], attention_mask=mask, past_key_values=m(
                ids[:, :-6], attention_mask=mask[:, :-6], use_cache=True).past_key_values).logits)
        elif kind in (0, 4, 5):
            out.append(lambda m, ids=ids, mask=mask: m(ids, attention_mask=mask).logits)
        elif kind == 6:  # hidden states: the second session's runs
            out.append(lambda m, ids=ids, mask=mask: torch.cat(
                [s.flatten() for s in m(ids, attention_mask=mask, output_hidden_states=True).hidden_states]))
        elif kind in (1, 7):
            out.append(lambda m, ids=ids, mask=mask: m(ids, attention_mask=mask, cont_len=2).logits)
        elif kind == 2:
            if i % 16 == 10:  # prompts that begin alike: on a CPU the rests in one run of the writing extender
                ids[1:, : length - 8], mask = ids[0, : length - 8], torch.ones_like(ids)
            out.append(lambda m, ids=ids, mask=mask: m.generate(ids, attention_mask=mask, max_new_tokens=4,
                                                                do_sample=False))
        elif i % 16 == 3:
            query, items = ids[0].tolist(), [[int(t)] for t in ids[-1, :3]]
            out.append(lambda m, q=query, it=items: torch.tensor(ortmodule.score(m, None, q, it, [5, 6, 7])))
        else:  # the query run once, items of 1-7 tokens several to a row of the extend run (sharing.choose_lanes)
            query, items = ids[0].tolist(), [ids[-1, : 1 + (i + j) % 7].tolist() for j in range(6)]
            out.append(lambda m, q=query, it=items: torch.tensor(
                ortmodule.score(m, None, q, it, [5, 6, 7], reuse_prefix=True)))
    return out


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_concurrent_calls_equal_sequential_ones(build, arch):
    """Also for LFM2, whose convolution states have their own place in each thread's scratch buffer."""
    model, _ = load_pair(build(arch))
    work = calls(model.package.vocab_size) * 3  # 120 calls on 4 threads
    expected = [fn(model) for fn in work]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda fn: fn(model), work))
    wrong = [i for i, (a, b) in enumerate(zip(got, expected)) if not torch.equal(a, b)]
    assert not wrong, f"{len(wrong)} of {len(work)} concurrent results differ from the sequential ones"


def lazy_calls(seed: int) -> list:
    """Calls whose sessions or graphs a model makes at their first use (attention weights, runs from
    embeddings, the backbone without the head, beams and prompt lookup over the extend graph, a loss)."""
    gen, out = torch.Generator().manual_seed(seed), []
    for i in range(24):
        ids = torch.randint(4, 500, (1 + i % 3, 20 + 7 * i % 60), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, : i % 3] = 0
        out.append([
            lambda m, ids=ids, mask=mask: torch.cat([a.flatten() for a in m(ids, attention_mask=mask,
                                                                              output_attentions=True).attentions]),
            lambda m, ids=ids, mask=mask: m(inputs_embeds=m.get_input_embeddings()(ids), attention_mask=mask).logits,
            lambda m, ids=ids, mask=mask: m.model(ids, attention_mask=mask).last_hidden_state,
            lambda m, ids=ids, mask=mask: m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                                     num_beams=2),
            lambda m, ids=ids[-1:]: m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                               do_sample=False, prompt_lookup_num_tokens=3),  # one row, as it takes
            lambda m, ids=ids, mask=mask: m(ids, attention_mask=mask, labels=ids).loss.reshape(1),
        ][i % 6])
    return out


def test_a_fresh_models_first_calls_on_many_threads_equal_sequential_ones(build):
    """On a model just loaded, the sessions and graphs made at first use (hidden states, attention weights,
    embeddings, the extend graph and its writing twin, the measured costs) are made by whichever of 6 threads
    asks first while the others run: every result equals the same call's on another fresh model, one call
    after another."""
    import random

    path = build("llama").package_dir
    work = calls(500) + lazy_calls(3)
    random.Random(3).shuffle(work)
    alone = ortmodule.OrtModelForCausalLM.from_pretrained(path)
    expected = [fn(alone) for fn in work]
    fresh = ortmodule.OrtModelForCausalLM.from_pretrained(path)
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda fn: fn(fresh), work))
    wrong = [i for i, (a, b) in enumerate(zip(got, expected)) if a.shape != b.shape or not torch.allclose(a, b)]
    assert not wrong, f"{len(wrong)} of {len(work)} results on a fresh model's threads differ from the sequential ones"


def test_a_generation_whose_decode_steps_another_thread_holds_runs_without_them(build, monkeypatch):
    """Two generations of one shape at once: the second finds the fixed-address steps (steps.py) held by
    the first and steps over a cache of its own, binding its inputs anew, with transformers' tokens."""
    from ortmodule import generation, steps

    model, ref = load_pair(build("llama"))
    ids = torch.randint(4, model.package.vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40, do_sample=False)
    expected = ref.generate(ids, **args)
    lent, lend = [], steps.lend
    monkeypatch.setattr(generation.fixed_steps, "lend", lambda *a: lent.append(lend(*a)) or lent[-1])
    held = lend(model.decoder, 2, 30 + 40)  # what the first thread's generation holds
    assert held is not None
    try:
        alongside = model.generate(ids, **args)
    finally:
        held.release()
    assert lent == [None] and torch.equal(alongside, expected)
    alone = model.generate(ids, **args)
    assert lent[-1] is not None and torch.equal(alone, expected)


def test_threads_asking_for_hidden_states_at_once_share_one_session(build):
    """The hidden-states session is made once when several threads ask for it together."""
    from ortmodule import variants

    model = ortmodule.OrtModelForCausalLM.from_pretrained(build("llama").package_dir)
    ids = torch.arange(4, 40).view(4, 9)
    made = []
    original = variants.Variant.__init__

    def counted(self, *args):
        made.append(self)
        original(self, *args)

    variants.Variant.__init__ = counted
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda row: model(ids[row : row + 1], output_hidden_states=True).hidden_states[-1],
                                range(4)))
    finally:
        variants.Variant.__init__ = original
    assert len(made) == 1
    alone = [model(ids[row : row + 1], output_hidden_states=True).hidden_states[-1] for row in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(got, alone))


def test_one_lm_eval_backend_refuses_a_second_thread_and_two_backends_share_a_model(llama):
    import threading

    from lm_eval.api.instance import Instance

    from ortmodule import load_tokenizer
    from ortmodule.lm_eval import OrtModuleLM

    model, _ = load_pair(llama)
    tokenizer = load_tokenizer(llama.package_dir)
    first, second = (OrtModuleLM(pretrained=model, tokenizer=tokenizer, batch_size=4) for _ in range(2))
    requests = [Instance("loglikelihood", {}, ("The quick brown fox", " jumps"), i) for i in range(3)]
    expected = first.loglikelihood(requests)
    entered, release = threading.Event(), threading.Event()
    score = first._totals_on_device

    def held(*args, **kwargs):
        entered.set()
        release.wait(30)
        return score(*args, **kwargs)

    first._totals_on_device = held
    worker = threading.Thread(target=first.loglikelihood, args=(requests,))
    worker.start()
    try:
        assert entered.wait(30)
        with pytest.raises(RuntimeError, match="already running requests on another thread"):
            first.loglikelihood(requests)
        assert second.loglikelihood(requests) == expected  # another backend on the same model runs meanwhile
    finally:
        release.set()
        worker.join(30)
    del first._totals_on_device
    assert first.loglikelihood(requests) == expected


def test_a_cache_run_from_two_threads_at_once_is_refused_not_raced(llama, monkeypatch):
    """A KVCache holds one batch's sequences: while one thread's step runs over it, another
    thread's step over the same cache gets a RuntimeError naming the problem, and the first step's
    result is the one it would have had alone."""
    import threading

    from ortmodule import runtime

    model, _ = load_pair(llama)
    ids = torch.randint(4, model.package.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    alone = model(ids, use_cache=True).past_key_values
    expected = model(ids[:, :1], past_key_values=alone).logits
    cache = model(ids, use_cache=True).past_key_values
    entered, release = threading.Event(), threading.Event()
    run = runtime.Session.run

    def held_run(session, binding):
        entered.set()
        release.wait(10)
        run(session, binding)

    monkeypatch.setattr(runtime.Session, "run", held_run)
    results = {}
    first = threading.Thread(target=lambda: results.update(first=model(ids[:, :1], past_key_values=cache).logits))
    first.start()
    assert entered.wait(10)
    with pytest.raises(RuntimeError, match="this KVCache is being run by another thread"):
        model(ids[:, :1], past_key_values=cache)
    release.set()
    first.join(10)
    assert torch.equal(results["first"], expected)
    assert cache.longest == 13  # the refused step left the cache as the first step made it


def overlaps(intervals_a, intervals_b) -> int:
    """How many pairs of (start, end) intervals, one from each list, overlap in time."""
    return sum(1 for a0, a1 in intervals_a for b0, b1 in intervals_b if a0 < b1 and b0 < a1)


def test_a_run_that_may_capture_a_cuda_graph_runs_alone():
    """ONNX Runtime captures CUDA graphs in CUDA's global mode, which another thread's allocation or
    synchronisation breaks: `runtime.CAPTURES` lets a run that may capture go alone among ortmodule's
    CUDA runs, while the others still run side by side (timed intervals from 4 + 1 threads)."""
    import threading
    import time

    from ortmodule import runtime

    guard, shared, alone, lock = runtime.CaptureGuard(), [], [], threading.Lock()

    def run(exclusive: bool, into: list):
        for _ in range(15):
            with guard.run(exclusive):
                start = time.perf_counter()
                time.sleep(0.003)
                end = time.perf_counter()
            with lock:
                into.append((start, end))

    threads = [threading.Thread(target=run, args=(False, shared)) for _ in range(4)]
    threads.append(threading.Thread(target=run, args=(True, alone)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(shared) == 60 and len(alone) == 15
    assert overlaps(alone, shared) == 0
    assert overlaps(shared, shared) > len(shared)  # beyond each interval with itself: the shared runs overlapped


def test_a_capture_waits_for_the_calls_of_other_threads():
    """A thread inside an entry point makes CUDA calls between its runs too (pinning a batch, torch's
    allocations, a copy to the host), each of which would break another thread's capture: a capture
    waits until the other threads' whole calls end (`runtime.entry_point` holds `CAPTURES` around
    them; nested holds pass), and two threads inside calls that both reach a capture take turns rather
    than wait for each other."""
    import threading
    import time

    from ortmodule import runtime

    guard, busy, captures, lock = runtime.CaptureGuard(), {}, {}, threading.Lock()

    def work(name: str, seconds: float, into: dict):
        start = time.perf_counter()
        time.sleep(seconds)
        with lock:
            into.setdefault(name, []).append((start, time.perf_counter()))

    def call(name: str, capture: bool):
        with guard.run(False):  # the entry point
            for _ in range(3):
                with guard.run(False):  # a run inside it
                    work(name, 0.01, busy)
                work(name, 0.01, busy)  # the call's own CUDA work between runs
            if capture:
                with guard.run(True):
                    work(name, 0.01, captures)
            work(name, 0.01, busy)

    threads = [threading.Thread(target=call, args=(name, name != "plain"), daemon=True)
               for name in ("a", "b", "plain")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "two captures inside calls waited for each other"
    assert sorted(captures) == ["a", "b"]
    for name in ("a", "b"):
        others = [span for other in ("a", "b", "plain") if other != name
                  for span in busy[other] + captures.get(other, [])]
        assert overlaps(captures[name], others) == 0, f"{name}'s capture ran beside another thread's work"
    assert not guard._inside and not guard._waiting


def test_an_entry_point_holds_the_capture_guard():
    """`runtime.entry_point` counts its thread as inside ortmodule for `CAPTURES` during the call."""
    import threading

    from ortmodule import runtime

    @runtime.entry_point
    def inside() -> bool:
        return threading.get_ident() in runtime.CAPTURES._inside

    assert inside() and threading.get_ident() not in runtime.CAPTURES._inside


def test_a_session_with_cuda_graphs_runs_one_run_at_a_time():
    """ONNX Runtime does not support `Run` on a session with CUDA graphs from several threads at once:
    such a session's runs go one at a time (its `lock`), other sessions' side by side; each thread's
    first runs of a graph id (where ONNX Runtime may capture it) run alone (`runtime.CAPTURES`), later
    ones (replays) not. A CUDA session stands in here: what `Session.run` holds around ONNX Runtime's
    run is the same on any device (tests/test_cuda.py runs the threads on a GPU)."""
    import threading
    import time

    from ortmodule import runtime

    def intervals(session, graph_id: int) -> tuple[list, list]:
        spans, capturing, lock = [], [], threading.Lock()

        def work():
            for _ in range(6):
                with session._guarded(graph_id):
                    start = time.perf_counter()
                    alone = runtime.CAPTURES._capturing
                    time.sleep(0.003)
                    end = time.perf_counter()
                with lock:
                    spans.append((start, end))
                    capturing.append(alone)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        return spans, capturing

    cuda = object()  # a stream: the session counts as a CUDA session
    graphs = runtime.Session(None, stream=cuda, cuda_graphs=True)
    spans, capturing = intervals(graphs, -1)
    assert len(spans) == 24 and overlaps(spans, spans) == len(spans)  # each with itself only
    spans, capturing = intervals(graphs, 7)
    assert capturing.count(True) == 4 * runtime.RUNS_BEFORE_REPLAY  # each thread's first runs of graph 7
    plain = runtime.Session(None, stream=cuda)
    spans, capturing = intervals(plain, -1)
    assert overlaps(spans, spans) > len(spans) and not any(capturing)

