"""The CUDA path on a real GPU: parity with transformers (fp32, fp16, bf16 packages and the real
SmolLM2), tensors that stay on the device (device-to-host copies counted with torch's profiler,
which records every CUDA copy in the process, ONNX Runtime's included), ONNX Runtime ordered on
torch's current stream without host syncs (also after the caller switches streams), allocation
failures as the "out of memory." RuntimeError that batch-size searches retry on, and flat device
memory over 1,000 calls of varying shapes. Skipped where torch sees no GPU (CI)."""

import asyncio
import collections
import gc
import json
import shutil
import time

import onnx
import onnxruntime as ort
import pytest
import torch
from accelerate.utils.memory import should_reduce_batch_size
from helpers import (
    MODEL_ARCHES,
    grouped_rows,
    kept_prefix_calls,
    left_padded_batch,
    reference_class,
    right_padded_batch,
    stop_requests,
)
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from ortmodule import (
    OrtModelForCausalLM,
    extend,
    generation,
    graph,
    load_tokenizer,
    projections,
    runtime,
    scoring,
    sharing,
)
from ortmodule.inputs import pad_right
from ortmodule.serving.jobs import ScoreJob
from ortmodule_dev import fixtures

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP32_TOL = 1e-4


def device_to_host_copies(fn) -> int:
    """How many device-to-host copies `fn` makes, counted by the CUDA profiler (CUPTI)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if "memcpy" in event.name.lower() and "dtoh" in event.name.lower())


class OwnHostReads(TorchDispatchMode):
    """Counts the device-to-host reads torch makes (ortmodule's own: `.item()`, `.tolist()`,
    `.cpu()`), apart from those ONNX Runtime makes inside a run."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.on_cuda = collections.Counter()  # the ops seen with a CUDA tensor among their arguments

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        sources = [a for a in args if isinstance(a, torch.Tensor)]
        aten = torch.ops.aten
        reads = (
            (func is aten._local_scalar_dense.default and sources[0].is_cuda)
            # under torch.inference_mode() (as scoring runs) `.cpu()` reaches the mode as `aten.to.*`, not `_to_copy`
            or (func.overloadpacket in (aten._to_copy, aten.to) and sources[0].is_cuda and out.device.type == "cpu")
            or (func is aten.copy_.default and sources[0].device.type == "cpu" and sources[1].is_cuda)
        )
        self.count += int(reads)
        if any(source.is_cuda for source in sources):
            self.on_cuda[str(func)] += 1
        return out

    def __str__(self) -> str:  # what a failed count shows: whether the call's work was seen on the device at all
        return f"{self.count} host reads; ops seen on CUDA tensors: {dict(self.on_cuda) or 'none'}"


def own_host_reads(fn) -> int:
    with OwnHostReads() as reads:
        fn()
    return reads.count


def queued_behind_a_long_kernel(name: str, call):
    """`call()` queued on the current stream behind a ~1 s kernel: its result, once it is checked
    that the call returned within 0.5 s with the device still busy (no host sync in it)."""
    torch.cuda._sleep(int(2e9))
    start = time.perf_counter()
    out = call()
    host_time = time.perf_counter() - start
    done = torch.cuda.Event()
    done.record()
    still_busy = not done.query()
    torch.cuda.synchronize()
    print(f"{name}: host time behind a ~1 s kernel {host_time:.3f} s (device still busy: {still_busy})")
    assert still_busy and host_time < 0.5, f"{name}: the call waited for the device ({host_time:.2f} s)"
    return out


def real_positions_diff(logits, expected, mask) -> float:
    real = mask.bool()
    return (logits.float().cpu() - expected.float().cpu())[real].abs().max().item()


@pytest.fixture(scope="module")
def llama_cuda(build):
    """A package exported for CUDA in fp16, whose every attention node runs on the GPU (ONNX
    Runtime's CUDA GroupQueryAttention takes fp16 and bf16 only: fp32 attention runs on the CPU)."""
    fixture = build("llama", precision="fp16", execution_provider="cuda")
    return fixture, OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")


def test_fp32_package_on_cuda_warns(build):
    fixture = build("llama")
    with pytest.warns(UserWarning, match="fp32 package.*--precision bf16 --device cuda"):
        OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")


def test_counters_see_copies():
    """Both counters see a copy when there is one (so that a zero below means something)."""
    x = torch.ones(8, device="cuda")
    assert device_to_host_copies(lambda: x.cpu()) == 1
    assert device_to_host_copies(lambda: x + 1) == 0
    assert own_host_reads(lambda: x.cpu()) == 1
    assert own_host_reads(lambda: x.sum().item()) == 1
    assert own_host_reads(lambda: x.tolist()) == 1
    assert own_host_reads(lambda: x + 1) == 0
    with torch.inference_mode():  # where `.cpu()` is dispatched as aten.to.dtype_layout
        assert own_host_reads(lambda: x.cpu()) == 1
        assert own_host_reads(lambda: x.to("cpu", non_blocking=True)) == 1
        assert own_host_reads(lambda: x.to(torch.float16)) == 0


@pytest.mark.filterwarnings("ignore:.*fp32 package")
@pytest.mark.parametrize("arch", MODEL_ARCHES)
def test_cpu_export_on_cuda_matches_transformers(build, arch):
    """Every fixture architecture's fp32 package on CUDA (fp32 MatMul, no TF32), right and left padded."""
    fixture = build(arch)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda:0")
    assert model.device == torch.device("cuda", 0)
    hf = reference_class(fixture).from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    ids, mask = right_padded_batch([20, 12, 5], seed=3)
    for layout in (mask, mask.flip(1)):
        with torch.no_grad():
            expected = hf(input_ids=ids, attention_mask=layout).logits
        logits = model(ids.cuda(), attention_mask=layout.cuda()).logits
        assert logits.device == torch.device("cuda", 0)
        assert real_positions_diff(logits, expected, layout) < FP32_TOL


@pytest.mark.filterwarnings("ignore:.*fp32 package")
def test_hidden_states_on_cuda_match_transformers(build):
    """`output_hidden_states=True` on CUDA: a prompt with a cache and a step, on the device, as transformers."""
    fixture = build("llama")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda:0")
    hf = reference_class(fixture).from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    ids, mask = left_padded_batch([9, 6], seed=3)
    tokens, longer = torch.tensor([[7], [8]]), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    out = model(ids.cuda(), attention_mask=mask.cuda(), use_cache=True, output_hidden_states=True)
    step = model(tokens.cuda(), attention_mask=longer.cuda(), past_key_values=out.past_key_values,
                 output_hidden_states=True)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, use_cache=True, output_hidden_states=True)
        ref_step = hf(tokens, attention_mask=longer, past_key_values=ref.past_key_values, output_hidden_states=True)
    for ours, theirs in zip(out.hidden_states, ref.hidden_states):
        assert ours.device == torch.device("cuda", 0)
        assert real_positions_diff(ours, theirs, mask) < FP32_TOL
    for ours, theirs in zip(step.hidden_states, ref_step.hidden_states):
        assert (ours.cpu() - theirs).abs().max().item() < FP32_TOL

    # the backbone (model.model: the graph without its LM head) on the device, as transformers' backbone
    last = model.model(ids.cuda(), attention_mask=mask.cuda()).last_hidden_state
    assert last.device == torch.device("cuda", 0)
    assert real_positions_diff(last, ref.hidden_states[-1], mask) < FP32_TOL


@pytest.mark.filterwarnings("ignore:.*fp32 package")
def test_embeddings_on_cuda_match_transformers(build):
    """`/v1/embeddings`' work on CUDA (serving/jobs.EmbedJob over scoring.pooled_hidden_states): each pooling, in
    batches of a small budget, normalized on the device and copied back, as transformers' final states."""
    from ortmodule.serving.jobs import EmbedJob

    fixture = build("llama")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda:0")
    hf = reference_class(fixture).from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    prompts = [[5, 6, 7], [9] * 14, [300, 4], [11, 12, 13, 14, 15]]
    loop = asyncio.new_event_loop()
    try:
        for pooling in ("LAST", "MEAN", "CLS"):
            jobs = [EmbedJob(prompts[:2], True, loop, 12, pooling), EmbedJob(prompts[2:], False, loop, 12, pooling)]
            rows = [row for got in EmbedJob.start_together(model, jobs)() for row in got]
            for k, (row, prompt) in enumerate(zip(rows, prompts)):
                with torch.no_grad():
                    states = hf.model(torch.tensor([prompt])).last_hidden_state[0]
                state = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[pooling]
                expected = torch.nn.functional.normalize(state, dim=-1) if k < 2 else state
                assert row.device.type == "cpu" and (row - expected).abs().max().item() < FP32_TOL
    finally:
        loop.close()


@pytest.mark.filterwarnings("ignore:.*fp32 package")
def test_attentions_on_cuda_are_refused_naming_why(build):
    """ONNX Runtime's CUDA GroupQueryAttention returns no weights: `output_attentions=True` on CUDA is a
    NotSupportedError that says to load on the CPU, and the model answers after it."""
    from ortmodule import NotSupportedError

    model = OrtModelForCausalLM.from_pretrained(build("llama").package_dir, device="cuda:0")
    ids = torch.tensor([[5, 6, 7]], device="cuda:0")
    with pytest.raises(NotSupportedError, match="load the package on the CPU"):
        model(ids, output_attentions=True)
    assert model(ids).logits.shape == (1, 3, 512)


@pytest.mark.filterwarnings("ignore:.*fp32 package")
def test_inputs_embeds_on_cuda_give_the_ids_logits(build):
    """`get_input_embeddings()` on the device and `inputs_embeds` of them: the ids' logits, then a step."""
    model = OrtModelForCausalLM.from_pretrained(build("llama").package_dir, device="cuda:0")
    ids, mask = left_padded_batch([9, 6], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    embeds = model.get_input_embeddings()(ids)
    assert embeds.device == torch.device("cuda", 0)
    plain = model(ids, attention_mask=mask, use_cache=True)
    out = model(inputs_embeds=embeds, attention_mask=mask, use_cache=True)
    assert real_positions_diff(out.logits, plain.logits, mask.cpu()) < FP32_TOL
    longer = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    step = model(inputs_embeds=model.get_input_embeddings()(ids[:, -1:]), attention_mask=longer,
                 past_key_values=out.past_key_values)
    expected = model(ids[:, -1:], attention_mask=longer, past_key_values=plain.past_key_values)
    assert (step.logits - expected.logits).abs().max().item() < FP32_TOL


@pytest.mark.filterwarnings("ignore:.*fp32 package")
def test_images_on_cuda_give_the_cpus_logits(build, tmp_path):
    """A Qwen2.5-VL prompt with an image, then one with an image and a video (random pixels of the
    processor's shape; the checkpoint's config.json beside the package for the video) on CUDA: the
    vision and embedding models and the mRoPE prefill on the device, then a step, as on the CPU."""
    fixture = build("qwen2_5_vl")
    package = tmp_path / "package"
    shutil.copytree(fixture.package_dir, package)
    shutil.copy(fixture.hf_dir / "config.json", package / "config.json")
    generator = torch.Generator().manual_seed(0)
    image = dict(pixel_values=torch.randn(32, 96, generator=generator), image_grid_thw=torch.tensor([[1, 8, 4]]))
    video = dict(image, pixel_values_videos=torch.randn(96, 96, generator=generator),
                 video_grid_thw=torch.tensor([[3, 4, 8]]), second_per_grid_ts=torch.tensor([1.3]))
    prompts = [(torch.tensor([[5, 6, 7, 509] + [511] * 8 + [508, 20, 21]]), image),
               (torch.tensor([[5, 509] + [511] * 8 + [508, 6, 509] + [510] * 24 + [508, 20]]), video)]
    outputs = []
    for device in ("cpu", "cuda:0"):
        model = OrtModelForCausalLM.from_pretrained(package, device=device)
        for ids, media in prompts:
            given = {name: value.to(device) for name, value in media.items()}
            out = model(ids.to(device), **given, use_cache=True)
            step = model(torch.tensor([[30]], device=device), past_key_values=out.past_key_values)
            outputs.append((out.logits.cpu(), step.logits.cpu()))
    half = len(outputs) // 2
    for on_cuda, on_cpu in zip(outputs[half:], outputs[:half]):
        for a, b in zip(on_cuda, on_cpu):
            assert (a - b).abs().max().item() < FP32_TOL


def test_gemma3_images_on_cuda_give_the_cpus_logits(build):
    """A Gemma 3 prompt with two images attended both ways (token_type_ids: blocks.py's graph, its KV
    heads repeated for CUDA's kernel) and one without the marks (causal), then a step, on CUDA as on
    the CPU."""
    fixture = build("gemma3_vl", num_layers=4)
    ids = torch.tensor([[5, 6, 510, 511, 511, 511, 511, 509, 7, 510, 511, 511, 511, 511, 509, 8, 9]])
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    outputs = []
    for device in ("cpu", "cuda:0"):
        model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=device)
        for marks in ((ids == 511).long(), None):
            given = {} if marks is None else {"token_type_ids": marks.to(device)}
            out = model(ids.to(device), pixel_values=pixels.to(device), use_cache=True, **given)
            step = model(torch.tensor([[30]], device=device), past_key_values=out.past_key_values)
            outputs.append((out.logits.cpu(), step.logits.cpu()))
    for on_cuda, on_cpu in zip(outputs[2:], outputs[:2]):
        for a, b in zip(on_cuda, on_cpu):
            assert (a - b).abs().max().item() < FP32_TOL
    assert (outputs[0][0] - outputs[1][0]).abs().max().item() > 1e-2  # the blocks matter


# `ortmodule export --device cuda` unpacks the query/key/value projections (exporter.CUDA_OPTIONS).
UNPACKED = (("fuse_qkv", "false"),)


@pytest.mark.parametrize("precision,tolerance,options",
                         [("fp16", 2e-2, ()), ("bf16", 1e-1, ()), ("bf16", 1e-1, UNPACKED)],
                         ids=["fp16", "bf16", "bf16-unpacked"])
def test_half_precision_packages(build, precision, tolerance, options):
    """fp16 and bf16 packages exported for CUDA (and the bf16 export as `ortmodule export` makes it,
    its projections unpacked) against transformers in fp32 on the same weights."""
    fixture = build("llama", precision=precision, execution_provider="cuda", extra_options=options)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    assert model.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    ids, mask = right_padded_batch([24, 9], seed=5)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
    logits = model(ids, attention_mask=mask).logits
    assert logits.device.type == "cuda"
    assert real_positions_diff(logits, expected, mask) < tolerance * expected.abs().max().item()
    agree = (logits.float().cpu().argmax(-1) == expected.argmax(-1))[mask.bool()].float().mean().item()
    assert agree > 0.9
    prompt = ids[:1, :8]
    ours = model.generate(prompt, max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert ours.device.type == "cuda"
    assert (ours.cpu() == theirs).float().mean().item() > 0.8


@pytest.fixture(scope="module")
def smollm2_cuda():
    fixture = fixtures.build(fixtures.SMOLLM2)
    with pytest.warns(UserWarning, match="fp32 package"):
        model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    reference = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).to("cuda").eval()
    return fixture, model, reference, load_tokenizer(fixture.package_dir)


@pytest.mark.filterwarnings("ignore:.*fp32 package")
def test_real_model_fp32_on_cuda(smollm2_cuda):
    """SmolLM2-135M's fp32 package on CUDA: logits as transformers' on CUDA, greedy chat identical."""
    _, model, reference, tokenizer = smollm2_cuda
    tokenizer.padding_side = "left"
    texts = ["The capital of France is Paris, and the capital of Germany is", "Water boils at"]
    batch = tokenizer(texts, return_tensors="pt", padding=True).to("cuda")
    with torch.no_grad():
        expected = reference(**batch).logits
    logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits
    assert real_positions_diff(logits, expected, batch.attention_mask.cpu()) < 5e-4
    chats = [[{"role": "user", "content": q}] for q in ["What is the capital of France?", "Name three colors."]]
    prompt = tokenizer.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt", padding=True,
                                           return_dict=True).to("cuda")
    with torch.no_grad():
        theirs = reference.generate(**prompt, max_new_tokens=30, do_sample=False)
    ours = model.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=30,
                          do_sample=False)
    assert torch.equal(ours, theirs)


def test_real_model_bf16_cuda_export():
    """SmolLM2-135M exported in bf16 for CUDA: loglikelihoods within bf16 tolerance of transformers
    in bf16 on the same weights, and the same greedy choice at (nearly) every position."""
    fixture = fixtures.build(fixtures.SMOLLM2_BF16_CUDA)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    reference = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.bfloat16).to("cuda").eval()
    tokenizer = load_tokenizer(fixture.package_dir)
    batch = tokenizer(["Water boils at one hundred degrees Celsius at sea level, and freezes at zero."],
                      return_tensors="pt").to("cuda")
    with torch.no_grad():
        expected = torch.log_softmax(reference(**batch).logits.float(), -1)
    ours = torch.log_softmax(model(batch.input_ids).logits.float(), -1)
    targets = batch.input_ids[:, 1:, None]
    ours_ll, their_ll = ours[:, :-1].gather(2, targets), expected[:, :-1].gather(2, targets)
    assert (ours_ll - their_ll).abs().max().item() < 0.25  # bf16 logits carry ~3 significant digits
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.9


def test_real_bf16_package_logits_without_the_cast_and_with_a_float32_head(tmp_path):
    """The real bf16 package ends in a cast of bf16 logits to float32: the sessions write bf16
    (forward still returns float32), within one bf16 step of the package's own graph's logits;
    `rewrite_lm_head="float32"` writes float32 sums, within one bf16 rounding of them, nearly none of
    them a bf16 number; loglikelihoods on both stay within bf16 tolerance of the unrewritten graph's."""
    fixture = fixtures.build(fixtures.SMOLLM2_BF16_CUDA)
    plain = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda", rewrite_lm_head=False)
    rounded = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda", cache_dir=tmp_path)
    precise = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda", rewrite_lm_head="float32",
                                                  cache_dir=tmp_path)
    assert (plain.decoder.head_dtype, rounded.decoder.head_dtype, precise.decoder.head_dtype) == (
        torch.float32, torch.bfloat16, torch.float32)
    ids, mask = right_padded_batch([40, 23], vocab=49152, seed=26)
    real = mask.bool().cuda()
    reference, ours = plain(ids, attention_mask=mask).logits[real], rounded(ids, attention_mask=mask).logits[real]
    assert ours.dtype == torch.float32 and torch.equal(ours, ours.bfloat16().float())
    assert ((ours - reference).abs() <= reference.abs() * 2**-7 + 1e-3).all()  # GEMMs of other shapes: a step
    finer = precise(ids, attention_mask=mask).logits[real]
    assert ((finer - ours).abs() <= ours.abs() * 2**-7 + 1e-3).all()
    assert (finer != finer.bfloat16().float()).float().mean().item() > 0.9
    # The float32 head runs in TF32 (its inputs are bf16 values, which TF32 holds exactly): float32's
    # sums but for their order, against the same head on the CUDA cores (`use_tf32=0`).
    options = {name: s.ort_session.get_provider_options()["CUDAExecutionProvider"]["use_tf32"]
               for name, s in (("precise", precise.decoder.session), ("rounded", rounded.decoder.session))}
    assert options == {"precise": "1", "rounded": "0"}
    cores = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda", rewrite_lm_head="float32",
                                                cache_dir=tmp_path, provider_options={"use_tf32": "0"})
    exact = cores(ids, attention_mask=mask).logits[real]
    assert (finer - exact).abs().max().item() < 1e-3 < (ours - exact).abs().max().item()
    starts, targets = [20, 5], [ids[0, 21:40].tolist(), ids[1, 6:23].tolist()]
    expected = scoring.loglikelihood(plain, ids, mask, starts, targets)
    for each in (rounded, precise):
        for (lp, _), (ref, _) in zip(scoring.loglikelihood(each, ids, mask, starts, targets), expected):
            assert abs(lp - ref) < 0.5  # 19 and 17 targets, each within bf16's rounding


def test_forward_makes_no_device_to_host_copy(llama_cuda):
    """Host inputs: checked on the host, copied up once, logits left on the device: ortmodule reads
    nothing back. Device inputs: the checks' flags are its one small read. (ONNX Runtime's own
    copies inside a run, counted by the profiler, are printed for the record.)"""
    _, model = llama_cuda
    ids, mask = right_padded_batch([20, 12, 5], seed=1)
    model(ids, attention_mask=mask, cont_len=4)  # warm
    assert own_host_reads(lambda: model(ids, attention_mask=mask, cont_len=4)) == 0
    assert own_host_reads(lambda: model(ids, attention_mask=mask.flip(1))) == 0
    on_device = ids.cuda(), mask.cuda()
    assert own_host_reads(lambda: model(on_device[0], attention_mask=on_device[1], cont_len=4)) == 1
    total = device_to_host_copies(lambda: model(ids, attention_mask=mask, cont_len=4))
    print(f"device-to-host copies in one forward, ONNX Runtime's own: {total}")


def test_generate_loop_reads_the_device_rarely(llama_cuda):
    """No eos: no read at all inside the loop; with eos, the stop flag every STOP_CHECK_EVERY steps.
    transformers' preparation and the input checks read a few flags before the loop, the same for
    any length: the loop's reads are the difference between a long and a short generation."""
    _, model = llama_cuda
    prompt = torch.randint(4, 512, (2, 8))
    steps, short = 32, 8

    def reads(new, eos):
        return own_host_reads(lambda: model.generate(prompt, max_new_tokens=new, eos_token_id=eos, pad_token_id=0,
                                                     do_sample=False))

    assert reads(steps, None) - reads(short, None) == 0
    unreachable = 511  # eos id that the greedy path never emits here (checked below)
    out = model.generate(prompt, max_new_tokens=steps, eos_token_id=unreachable, pad_token_id=0)
    assert out.shape[1] == 8 + steps and not (out[:, 8:] == unreachable).any()
    assert reads(steps, unreachable) - reads(short, unreachable) <= (steps - short) // generation.STOP_CHECK_EVERY + 1
    total = device_to_host_copies(lambda: model.generate(prompt, max_new_tokens=steps, eos_token_id=None,
                                                         pad_token_id=0))
    print(f"device-to-host copies in a {steps}-step generate, ONNX Runtime's own: {total}")


@pytest.mark.filterwarnings("ignore:.*fp32 package")
def test_generate_stops_where_transformers_does(build):
    """The deferred stop check cuts the output where transformers' per-step check stops (an fp32
    package: its attention on the CPU, so the decode steps bind their inputs anew each step)."""
    fixture = build("llama")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    prompt = torch.randint(4, 512, (1, 6), generator=torch.Generator().manual_seed(7))
    free = model.generate(prompt, max_new_tokens=20, eos_token_id=None, pad_token_id=0).cpu()
    with torch.no_grad():
        free_hf = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, eos_token_id=None,
                              pad_token_id=0, do_sample=False)
    assert torch.equal(free, free_hf)
    eos = int(free[0, 6 + 3])  # the 4th generated token: transformers stops right after it
    ours = model.generate(prompt, max_new_tokens=20, eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True,
                          output_scores=True)
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, eos_token_id=eos,
                             pad_token_id=0, do_sample=False)
    assert torch.equal(ours.sequences.cpu(), theirs)
    assert len(ours.scores) == theirs.shape[1] - 6


@pytest.mark.filterwarnings("ignore:.*fp32 package")
def test_generate_until_stops_each_row_on_cuda(build):
    """lm-eval's `generate_until` on CUDA (an fp32 package beside transformers fp32 on CUDA), each row
    stopped at its own stop sequences (`lm_eval.StopSequences`; on CUDA a stopped row stays in the steps,
    given pad tokens): the `hf` backend's answers, with rows writing different stop sequences."""
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    # hf's batches (max_batch_size): CUDA's kernels differ with a batch's rows, and generation batches
    # would otherwise take all 8 requests (lm_eval.generation_batches)
    ours = OrtModuleLM(pretrained=str(fixture.package_dir), device="cuda", batch_size=4, max_batch_size=4)
    theirs = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", batch_size=4, device="cuda")
    requests, free = stop_requests(theirs, seed=4)
    expected = theirs.generate_until(requests, disable_tqdm=True)
    assert all(len(a) < len(b) for a, b in zip(expected, free))  # every answer cut by a stop sequence
    assert ours.generate_until(requests, disable_tqdm=True) == expected


def test_score_makes_one_copy_to_the_host(llama_cuda):
    fixture, model = llama_cuda
    tokenizer = load_tokenizer(fixture.package_dir)
    items = ["a b c", "d e", "f g h i"]
    scoring.score(model, tokenizer, "query text", items, [5, 6, 7])
    assert scoring.label_logprobs(model, [[[5, 6, 7], [5, 6, 8]]], [5, 6], 64, None).is_cuda
    with OwnHostReads() as reads:  # a failed count's message lists the ops seen on the device
        scoring.score(model, tokenizer, "query text", items, [5, 6, 7])
    assert reads.count == 1, str(reads)
    ids, mask = right_padded_batch([12, 9], seed=2)
    targets = [[int(ids[0, 10]), int(ids[0, 11])], [int(ids[1, 8])]]
    assert own_host_reads(lambda: scoring.loglikelihood(model, ids, mask, [9, 7], targets)) == 1


@pytest.mark.parametrize("share", ["false", "true", "auto"])
def test_lm_eval_reads_the_answers_back_once(llama_cuda, share):
    """lm-eval's loglikelihood requests in several batches (fixed size, and auto's token budget),
    shared contexts or not: ortmodule reads the device once per call, all the answers together,
    so the host builds the next batch while one runs. The answers equal each request's alone."""
    from ortmodule.lm_eval import OrtModuleLM

    fixture, model = llama_cuda
    tokenizer = load_tokenizer(fixture.package_dir)
    generator = torch.Generator().manual_seed(3)
    requests = []
    for q in range(6):
        context = torch.randint(4, 500, (int(torch.randint(8, 40, (1,), generator=generator)),),
                                generator=generator).tolist()
        width = 1 if q % 2 else 5
        requests += [(("", ""), context, torch.randint(4, 500, (width,), generator=generator).tolist())
                     for _ in range(4)]
    one = OrtModuleLM(pretrained=model, tokenizer=tokenizer, batch_size=1, share_contexts="false")
    expected = one._loglikelihood_tokens(requests, disable_tqdm=True)  # every request alone
    for batch_size in (4, "auto"):
        lm = OrtModuleLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, share_contexts=share,
                         token_budget=64)
        lm._loglikelihood_tokens(requests, disable_tqdm=True)  # warm
        got = []

        def run(lm=lm, got=got):
            got.extend(lm._loglikelihood_tokens(requests, disable_tqdm=True))

        assert own_host_reads(run) == 1
        for (lp, _), (ref_lp, _) in zip(got, expected, strict=True):
            assert abs(lp - ref_lp) < 0.05  # fp16: batches differ from batch 1 in the last digits


@pytest.mark.parametrize("switch", [False, True], ids=["load-stream", "other-stream"])
def test_runs_on_torch_stream_without_sync(build, switch):
    """Work queued before a call (the ids' copy up, behind a ~1 s kernel) is seen by ONNX Runtime,
    its logits are seen by the torch work after it, and the call returns before the device catches
    up (no host sync). With `switch`, the caller moves to another stream after loading."""
    fixture = build("llama", precision="fp16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    ids_a, mask = right_padded_batch([16, 10], seed=4)
    ids_b, _ = right_padded_batch([16, 10], seed=5)
    expected = model(ids_b, attention_mask=mask).logits.clone()
    model(ids_a, attention_mask=mask).logits.clone()  # A's ids and logits are what stale buffers hold
    torch.cuda.synchronize()
    stream = torch.cuda.Stream() if switch else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        logits = queued_behind_a_long_kernel("a forward", lambda: model(ids_b, attention_mask=mask).logits.clone())
    assert torch.equal(logits, expected)


def test_decode_steps_on_another_stream(build):
    """generate on a stream other than the load stream gives the same tokens as on the load stream."""
    fixture = build("llama", precision="fp16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    prompt = torch.randint(4, 512, (3, 10), generator=torch.Generator().manual_seed(9))
    expected = model.generate(prompt, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(1e9))
        tokens = model.generate(prompt, max_new_tokens=24, eos_token_id=None, pad_token_id=0).clone()
    torch.cuda.synchronize()
    assert torch.equal(tokens, expected)


@pytest.mark.filterwarnings("ignore:.*fp32 package")
def test_out_of_memory_is_the_error_batch_searches_retry(build):
    """An ONNX Runtime allocation failure (its arena capped by `gpu_mem_limit`) is a RuntimeError
    that accelerate's `should_reduce_batch_size` (lm-eval's --batch_size auto) retries on, and the
    model still answers a smaller batch."""
    fixture = build("llama")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda",
                                                provider_options={"gpu_mem_limit": 24 * 2**20})
    ids = torch.randint(4, 512, (256, 256))
    with pytest.raises(RuntimeError, match="out of memory.") as caught:
        model(ids, cont_len=1)
    assert should_reduce_batch_size(caught.value)
    small = torch.randint(4, 512, (2, 16))
    reference = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    assert torch.allclose(model(small).logits, reference(small).logits, atol=FP32_TOL)
    # torch's own CUDA allocation failure, from the logits buffer, is one too.
    with pytest.raises(RuntimeError, match="out of memory.") as caught:
        model(torch.randint(4, 512, (4096, 256)))  # 4096 x 256 x 512 fp32 logits: 2 TiB
    assert should_reduce_batch_size(caught.value)


def test_no_device_memory_growth_over_1000_calls(build):
    """1,000 forwards, cached decode steps and scores of varying shapes: the device memory in use
    (torch's and ONNX Runtime's arenas together, from the driver) does not grow after warm-up.
    The decoder keeps the decode steps of its last two generation shapes (`FixedSteps.KEPT`), so
    each count is taken after the same two generations (`settle`), whose steps are then the kept ones."""
    fixture = build("llama", precision="fp16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    generator = torch.Generator().manual_seed(0)

    def call(i):
        batch = int(torch.randint(1, 9, (), generator=generator))
        length = int(torch.randint(1, 129, (), generator=generator))
        ids = torch.randint(4, 512, (batch, length), generator=generator)
        if i % 10 == 0:
            model.generate(ids, max_new_tokens=4, eos_token_id=None, pad_token_id=0)
        else:
            model(ids, cont_len=None if i % 3 else int(torch.randint(1, length + 1, (), generator=generator)))

    def settle():
        for shape in ((1, 8), (2, 8)):
            model.generate(torch.randint(4, 512, shape), max_new_tokens=4, eos_token_id=None, pad_token_id=0)
        # the counts are process-wide: earlier tests' garbage, collected during the calls, is not this model's
        gc.collect()
        torch.cuda.synchronize()

    model(torch.randint(4, 512, (8, 128)))  # the largest shape first
    model.generate(torch.randint(4, 512, (8, 128)), max_new_tokens=4, eos_token_id=None, pad_token_id=0)
    for i in range(100):
        call(i)
    settle()
    free_before, _ = torch.cuda.mem_get_info()
    allocated_before = torch.cuda.memory_allocated()
    for i in range(1000):
        call(i)
    settle()
    free_after, _ = torch.cuda.mem_get_info()
    growth = (free_before - free_after) / 2**20
    print(f"device memory in use grew by {growth:.1f} MiB over 1,000 calls")
    assert torch.cuda.memory_allocated() == allocated_before, \
        f"torch's allocated memory {allocated_before} before the calls, {torch.cuda.memory_allocated()} after"
    assert growth < 16


def test_a_dropped_model_gives_its_device_memory_back(build):
    """`del model` returns its weights' and arenas' device memory at once, with Python's cyclic
    garbage collector off: nothing ortmodule keeps (decode steps, the extend and prefill runners)
    holds the decoder and its sessions in a reference cycle (tests/test_modeling.py checks the
    references on the CPU; this, the memory on the device)."""
    import gc

    fixture = build("llama", precision="fp16", execution_provider="cuda", hidden_size=1024, intermediate_size=2816,
                    num_layers=4, num_heads=8, num_kv_heads=4, vocab_size=32000)
    weights = fixture.parameters() * 2  # fp16

    def load_and_use():
        model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda", prefill_attention="onnx")
        ids = torch.randint(4, 32000, (4, 64), generator=torch.Generator().manual_seed(0))
        model(ids, cont_len=2)
        model.generate(ids, max_new_tokens=4, eos_token_id=None, pad_token_id=0)
        scoring.label_logprobs(model, [[[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11]]], [1, 2], 4096, True)
        torch.cuda.synchronize()
        return model

    load_and_use()  # dropped at once: CUDA kernels and libraries are loaded once for the process
    torch.cuda.empty_cache()
    gc.collect()
    gc.disable()
    try:
        free_before, _ = torch.cuda.mem_get_info()
        model = load_and_use()
        held = free_before - torch.cuda.mem_get_info()[0]
        del model
        torch.cuda.empty_cache()
        kept = free_before - torch.cuda.mem_get_info()[0]
    finally:
        gc.enable()
    print(f"a model of {weights >> 20} MiB of weights held {held >> 20} MiB; after del, {kept >> 20} MiB")
    assert held > weights and kept < weights // 4


def test_measured_costs_are_kept_on_cuda(build, tmp_path, monkeypatch):
    """kept_costs.py on a GPU: the second load of a package reads the costs the first measured, its
    check prefill (2 rows of 64 tokens, launch-bound on a GPU) within 1.5x of the first's time; the
    record names the GPU."""
    from ortmodule import costs, kept_costs

    monkeypatch.setenv("ORTMODULE_CACHE", str(tmp_path))
    calls, real = [], costs.measure
    monkeypatch.setattr(costs, "measure", lambda decoder, *shown: calls.append(decoder) or real(decoder, *shown))
    fixture = build("qwen3", precision="bf16", execution_provider="cuda")
    first = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda").measured_costs()
    checks = [costs.check_seconds(OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda").decoder)
              for _ in range(3)]
    later = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda").measured_costs()
    (entry,) = (tmp_path / "costs").glob("*.json")
    record = json.loads(entry.read_text())
    print(f"costs {first}; check {record['check_seconds'] * 1e3:.2f} ms, then {[round(c * 1e3, 2) for c in checks]}")
    assert later == first and len(calls) == 1
    assert record["machine"] == kept_costs.machine(torch.device("cuda"))
    assert torch.cuda.get_device_name() in record["machine"]


def test_cuda_graph_decode_steps(build):
    """With the CUDA provider's `enable_cuda_graph`, generation's decode steps are captured as CUDA
    graphs and replayed: the same tokens as without, for a new shape, the same shape again (a
    replay), several rows of different lengths, scores and a returned cache that continues; the
    prefills and forwards between them run uncaptured. Per-token times printed for the record."""
    fixture = build("llama", precision="fp16", execution_provider="cuda")
    plain = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda",  # off, whatever the default
                                                provider_options={"enable_cuda_graph": "0"})
    graphs = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda",
                                                 provider_options={"enable_cuda_graph": "1"})
    assert not plain.decoder.session.cuda_graphs
    assert graphs.decoder.session.cuda_graphs
    gen = torch.Generator().manual_seed(11)
    for batch, width, new in [(1, 9, 40), (1, 9, 40), (3, 14, 24), (1, 30, 40)]:
        prompt = torch.randint(4, 512, (batch, width), generator=gen)
        mask = torch.ones_like(prompt)
        mask[1:, :3] = 0  # rows of different lengths, left-padded
        expected = plain.generate(prompt, attention_mask=mask, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
        ours = graphs.generate(prompt, attention_mask=mask, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
        assert torch.equal(ours, expected), (batch, width, new)
        ids, rmask = right_padded_batch([12, 7], seed=batch)  # a forward between generations runs uncaptured
        assert torch.equal(graphs(ids, attention_mask=rmask).logits, plain(ids, attention_mask=rmask).logits)
    prompt = torch.randint(4, 512, (2, 10), generator=gen)
    kept = [model.generate(prompt, max_new_tokens=12, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                           output_scores=True) for model in (plain, graphs)]
    assert torch.equal(kept[0].sequences, kept[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(kept[0].scores, kept[1].scores))
    graphs.generate(prompt, max_new_tokens=12, eos_token_id=None, pad_token_id=0)  # reuses the fixed cache
    more = [model.generate(out.sequences, past_key_values=out.past_key_values, max_new_tokens=6, eos_token_id=None,
                           pad_token_id=0) for model, out in zip((plain, graphs), kept)]
    assert torch.equal(more[0], more[1])  # the returned cache was the caller's own copy

    def per_token(model, new=128):
        prompt = torch.randint(4, 512, (1, 16), generator=gen)
        model.generate(prompt, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start) / new

    print(f"batch-1 decode, ms per token: {per_token(plain):.3f} without CUDA graphs, {per_token(graphs):.3f} with")


def test_cuda_graph_on_the_real_model():
    """The real SmolLM2's bf16 CUDA package: greedy tokens with CUDA graphs equal those without."""
    fixture = fixtures.build(fixtures.SMOLLM2_BF16_CUDA)
    tokenizer = load_tokenizer(fixture.package_dir)
    prompt = tokenizer(["The capital of France is"], return_tensors="pt").input_ids
    outputs = []
    for options in ({"enable_cuda_graph": "0"}, {"enable_cuda_graph": "1"}):
        model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda", provider_options=options)
        outputs.append(model.generate(prompt, max_new_tokens=48, eos_token_id=None, pad_token_id=0))
    assert torch.equal(outputs[0], outputs[1])


def test_cuda_graphs_by_default(build, monkeypatch):
    """With `runtime.CUDA_GRAPHS_BY_DEFAULT` on, a bf16 package's main session captures its decode
    steps unless the caller says otherwise, the rewrites' sessions (extend and prefill graphs) are
    made without the option, and generation, forwards and scoring give what they give with it off;
    an fp32 package (attention on the CPU) loads without it."""
    monkeypatch.setattr(runtime, "CUDA_GRAPHS_BY_DEFAULT", True)
    fixture = build("qwen3", precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    plain = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda",
                                                provider_options={"enable_cuda_graph": "0"})
    assert model.decoder.session.cuda_graphs and not plain.decoder.session.cuda_graphs
    assert "enable_cuda_graph" not in (model.decoder.run_provider_options or {})
    gen = torch.Generator().manual_seed(3)
    for batch, width, new in [(1, 12, 30), (1, 12, 30), (3, 20, 16)]:
        prompt = torch.randint(4, 512, (batch, width), generator=gen)
        mask = torch.ones_like(prompt)
        mask[1:, :4] = 0
        settings = dict(attention_mask=mask, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
        assert torch.equal(model.generate(prompt, **settings), plain.generate(prompt, **settings)), (batch, width)
    ids, mask = left_padded_batch([30, 11, 22], seed=4)
    assert torch.equal(model(ids.cuda(), attention_mask=mask.cuda()).logits,
                       plain(ids.cuda(), attention_mask=mask.cuda()).logits)
    rows = [[5, 9, 12, 7, 33, 8], [4, 41, 17], [6, 2, 9, 19, 5, 71, 3]]
    padded, rmask = pad_right(rows)
    starts, targets = [2, 0, 1], [[7, 33, 8], [41, 17], [9, 19, 5]]
    assert torch.equal(*(scoring.loglikelihood_totals(m, padded, rmask, starts, targets) for m in (model, plain)))
    fp32 = OrtModelForCausalLM.from_pretrained(build("qwen3").package_dir, device="cuda")
    assert not fp32.decoder.session.cuda_graphs


def test_threads_on_a_package_with_cuda_graphs(build):
    """With CUDA graphs on (the default for a bf16 package), generations, forwards and scores from four
    threads at once give what the same calls give one after another, bit for bit: ONNX Runtime does not
    support concurrent runs of a session with CUDA graphs, so ortmodule runs them one at a time
    (`runtime.Session.lock`), and a run that may capture a graph runs alone (`runtime.CAPTURES`: the
    capture breaks on another thread's CUDA calls)."""
    from concurrent.futures import ThreadPoolExecutor

    fixture = build("qwen3", precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    assert model.decoder.session.cuda_graphs
    gen, work = torch.Generator().manual_seed(5), []
    for i in range(24):
        batch, width = 1 + i % 3, 8 + (29 * i) % 90
        ids = torch.randint(4, 512, (batch, width), generator=gen).cuda()
        if i % 3 == 0:  # decode steps: each new shape captured on the thread that first steps it
            work.append(lambda ids=ids, new=6 + i % 5: model.generate(ids, max_new_tokens=new, eos_token_id=None,
                                                                       pad_token_id=0, do_sample=False))
        elif i % 3 == 1:
            work.append(lambda ids=ids: model(ids).logits)
        else:
            query, items = ids[0].tolist(), [[int(t)] for t in ids[0, :4]]
            work.append(lambda q=query, it=items: torch.tensor(scoring.score(model, None, q, it, [5, 6, 7])))
    expected = [fn() for fn in work]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda fn: fn(), work * 2))
    wrong = [i for i, (a, b) in enumerate(zip(got, expected * 2)) if not torch.equal(a, b)]
    assert not wrong, f"{len(wrong)} of {len(got)} concurrent results differ from the sequential ones"
    assert not model.decoder.graphs_failed, "a capture failed beside another thread's work (the fallback hid it)"


def test_tail_at_the_kept_positions_on_cuda(build, monkeypatch, tmp_path):
    """On CUDA the tail after the last attention runs at the kept positions only (tail.py): the
    logits at `cont_len` positions are those of the graph that gathers just before the head, to
    bf16's rounding, and as close to transformers fp32's."""
    fixture = build("qwen3", precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    nodes = onnx.load_from_string(model.decoder.graph_bytes).graph.node
    assert any(n.name.startswith("/ortmodule/tail/") for n in nodes)
    monkeypatch.setattr(graph, "gather_tail", lambda *args: False)
    head_only = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda", cache_dir=tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    ids, mask = left_padded_batch([40, 17, 6], seed=15)  # the last 3 positions of every row are real
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits[:, -3:]
    ours = model(ids.cuda(), attention_mask=mask.cuda(), cont_len=3).logits
    theirs = head_only(ids.cuda(), attention_mask=mask.cuda(), cont_len=3).logits
    tail_mask = mask[:, -3:]
    noise = real_positions_diff(theirs, expected, tail_mask)
    assert real_positions_diff(ours, theirs, tail_mask) <= 2 * noise + 1e-3
    assert real_positions_diff(ours, expected, tail_mask) <= 1.5 * noise + 1e-3


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_unpacked_projections_on_cuda(build, arch, monkeypatch, tmp_path):
    """On CUDA a packed query/key/value projection that a Split node splits (Qwen3's export, with
    query/key norms) becomes three MatMuls (projections.py): ONNX Runtime folds the weights' slices
    at load (no Slice left in the optimized graph), and the logits are the packed graph's and as
    close to transformers fp32's. GroupQueryAttention's packed input (Llama's export) stays packed in
    the decoder's graph; the prefill graph, which splits it, has three MatMuls instead."""
    fixture = build(arch, precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda",
                                                prefill_attention="onnx" if arch == "llama" else "auto")
    graph_nodes = onnx.load_from_string(model.decoder.graph_bytes).graph.node
    assert not any(n.op_type == "Split" for n in graph_nodes)
    packed_inputs = [n for n in graph_nodes if n.op_type == "GroupQueryAttention" and not n.input[1]]
    assert len(packed_inputs) == (len(model.decoder.spec.layers) if arch == "llama" else 0)
    unpacked = model.decoder.graph_bytes
    if arch == "llama":
        decoder = model.decoder
        assert decoder.causal is not None
        unpacked = extend.extend_graph_bytes(decoder.graph_bytes, decoder.spec.path.stem,
                                             decoder.spec.layers[0].head_size, False, layout="prefill", unpack_qkv=True)
        assert not any(n.op_type == "Split" for n in onnx.load_from_string(unpacked).graph.node)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    runtime.make_session(unpacked, torch.device("cuda"), fixture.package_dir, options)
    optimized = onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node
    assert not any(n.op_type == "Slice" for n in optimized)
    monkeypatch.setattr(projections, "UNPACK_ON", ())
    packed = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda", prefill_attention="package")
    hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    ids, mask = right_padded_batch([40, 17, 6], seed=14)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
    ours = model(ids.cuda(), attention_mask=mask.cuda()).logits
    theirs = packed(ids.cuda(), attention_mask=mask.cuda()).logits
    noise = real_positions_diff(theirs, expected, mask)  # bf16's own distance from fp32
    assert real_positions_diff(ours, theirs, mask) <= 2 * noise + 1e-3
    assert real_positions_diff(ours, expected, mask) <= 1.5 * noise + 1e-3


@pytest.mark.parametrize("layout", ["mask", "cache"])
@pytest.mark.parametrize("precision,options", [("fp16", ()), ("bf16", ()), ("bf16", UNPACKED)],
                         ids=["fp16", "bf16", "bf16-unpacked"])
def test_shared_contexts_extend_on_cuda(build, precision, options, layout, monkeypatch):
    """The extend graph on CUDA (a Qwen3 export, whose GroupQueryAttention applies the query/key
    norms itself; also with its projections unpacked, as `ortmodule export` makes it), in either
    layout (the cache layout: ONNX Runtime's flash attention over the rows' caches): made, and
    lm-eval-shaped groups (a context, several continuations) scored over one run of the contexts
    and one extend give the padded batch's answers."""
    monkeypatch.setitem(extend.EXTEND_LAYOUT, "cuda", layout)
    fixture = build("qwen3", precision=precision, execution_provider="cuda", extra_options=options)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    assert model.decoder.extender() is not None and model.decoder.extender().layout == layout
    rows, groups, starts, targets = grouped_rows((30, 17, 44), (3, 6, 1, 4), seed=41)
    ids, mask = pad_right(rows)
    expected = scoring.answers(scoring.loglikelihood_totals(model, ids, mask, starts, targets))
    got = scoring.answers(scoring.grouped_loglikelihood_totals(model, rows, groups, starts, targets))
    tolerance = {"fp16": 0.05, "bf16": 0.3}[precision]  # per token, the half-precision logits' last digits
    for (lp, _), (ref_lp, _), rest in zip(got, expected, targets, strict=True):
        assert abs(lp - ref_lp) < tolerance * len(rest)


@pytest.mark.parametrize("layout", ["mask", "cache"])
def test_kept_prefixes_on_cuda(build, layout, monkeypatch):
    """`sharing.KeptPrefixes` on CUDA (a Qwen3 bf16 export, either extend layout): calls that start from
    an earlier call's prefixes (the same, longer, shorter) give the padded rows' answers, to bf16's
    rounding, reading nothing back from the device."""
    monkeypatch.setitem(extend.EXTEND_LAYOUT, "cuda", layout)
    fixture = build("qwen3", precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    calls = kept_prefix_calls(seed=53)
    scoring.grouped_loglikelihood_totals(model, *calls[0])  # the extend graph made and checked (host reads)
    kept, reused = sharing.KeptPrefixes(), []
    for rows, groups, starts, targets in calls:
        ids, mask = pad_right(rows)
        expected = scoring.answers(scoring.loglikelihood_totals(model, ids, mask, starts, targets))
        before = kept.reused
        with OwnHostReads() as reads:
            totals = scoring.grouped_loglikelihood_totals(model, rows, groups, starts, targets, kept=kept)
        assert reads.count == 0
        reused.append(kept.reused - before)
        for (lp, _), (ref_lp, _), rest in zip(scoring.answers(totals), expected, targets, strict=True):
            assert abs(lp - ref_lp) < 0.3 * len(rest)  # per token, bf16 logits' last digits
    assert reused == [0, 1, 1, 1, 1, 0, 1]


def test_shared_contexts_extend_sliding_on_cuda(build):
    """The extend graph of a sliding-window package on CUDA (Gemma 3's bf16 export, an 8-token
    window on every other layer; the mask layout, each window its own mask): contexts and
    continuations longer than the window, scored over one run of the contexts and one extend, give
    the padded batch's answers."""
    fixture = build("gemma3", precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    extender = model.decoder.extender()
    assert extender is not None and extender.layout == "mask" and extender.windows == [8]
    rows, groups, starts, targets = grouped_rows((21, 12), (9, 2, 5), seed=47)
    ids, mask = pad_right(rows)
    expected = scoring.answers(scoring.loglikelihood_totals(model, ids, mask, starts, targets))
    got = scoring.answers(scoring.grouped_loglikelihood_totals(model, rows, groups, starts, targets))
    for (lp, _), (ref_lp, _), rest in zip(got, expected, targets, strict=True):
        assert abs(lp - ref_lp) < 0.3 * len(rest)  # per token, bf16 logits' last digits


def check_cache_steps_and_batched_generate(model, hf, lengths, steps, seeds, new_tokens, pad_token_id):
    """A half-precision CUDA model's cache, continued by decode steps (`steps` new tokens a row) from
    a right-padded prefill of rows of `lengths`, gives the logits of each row's whole sequence run at
    once (to bf16's rounding), both within bf16's rounding of transformers fp32 (`hf`); and a
    left-padded batch of two prompts (of `seeds[3]` tokens) generates each row's own greedy tokens,
    as generated alone. Returns that batch, its mask and what it generated."""
    rows = len(lengths)
    ids, mask = right_padded_batch(lengths, seed=seeds[0])
    added = torch.randint(4, 500, (rows, steps), generator=torch.Generator().manual_seed(seeds[1]))
    out = model(ids, attention_mask=mask, use_cache=True)
    cache, seen, got = out.past_key_values, mask, []
    for s in range(steps):
        seen = torch.cat([seen, torch.ones(rows, 1, dtype=mask.dtype)], 1)
        out = model(added[:, s : s + 1], attention_mask=seen, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        got.append(out.logits[:, -1].float().cpu())
    for row in range(rows):
        real = int(mask[row].sum())
        whole = torch.cat([ids[row, :real], added[row]])[None]
        at_once = model(whole).logits[0, real:].float().cpu()
        with torch.no_grad():
            expected = hf(whole).logits[0, real:]
        stepped = torch.stack([g[row] for g in got])
        scale = expected.abs().max().item()
        assert (stepped - at_once).abs().max().item() < 5e-2 * scale
        assert (stepped - expected).abs().max().item() < 1e-1 * scale
    prompts, prompt_mask = left_padded_batch(seeds[3], seed=seeds[2])
    together = model.generate(prompts, attention_mask=prompt_mask, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=pad_token_id)
    for row in range(2):
        alone = prompts[row : row + 1, prompts.shape[1] - int(prompt_mask[row].sum()):]
        own = model.generate(alone, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id)
        assert together[row, -new_tokens:].tolist() == own[0, -new_tokens:].tolist()
    return prompts, prompt_mask, together


def test_sliding_window_cache_on_cuda(build):
    """Gemma 3's bf16 export for CUDA, whose sliding-window layers the builder marks for a KV buffer
    of exactly the window (`sliding_window_cache`, which ONNX Runtime's CUDA kernel enforces; ortmodule
    drops the mark at load): a right-padded prefill into a cache and steps past the window give the
    logits of each whole row run at once (to bf16's rounding) and of transformers fp32; a left-padded
    batch's greedy tokens past the window are each row's own, generated alone."""
    fixture = build("gemma3", precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    assert any(kv.window == 8 for kv in model.decoder.spec.layers)
    hf = reference_class(fixture).from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    check_cache_steps_and_batched_generate(model, hf, [14, 5, 10], 6, (51, 52, 53, [11, 4]), 10, 0)


@pytest.mark.parametrize("layout", ["mask", "cache"])
def test_score_requests_sharing_queries_on_cuda(build, layout, monkeypatch):
    """The score server's call on CUDA: several requests whose items share their query, the queries
    in one prefill and all the items in one extend (either layout), give the scores of every item's
    whole prompt in a padded batch."""
    monkeypatch.setitem(extend.EXTEND_LAYOUT, "cuda", layout)
    fixture = build("qwen3", precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    generator = torch.Generator().manual_seed(43)
    requests = [[query + torch.randint(4, 500, (k,), generator=generator).tolist() for k in items]
                for query, items in ((torch.randint(4, 500, (n,), generator=generator).tolist(), items)
                                     for n, items in ((40, (3, 9, 1)), (25, (5, 2)), (60, (7, 1, 4, 2))))]
    shared = scoring.label_logprobs(model, requests, [5, 6, 7], 4096, True)
    assert model.decoder.extender() is not None and model.decoder.extender().layout == layout
    padded = scoring.label_logprobs(model, requests, [5, 6, 7], 4096, False)
    assert shared.shape == (9, 3) and (shared - padded).abs().max().item() < 0.3  # bf16 logits' last digits


@pytest.mark.parametrize("layout", ["mask", "cache"])
def test_scoring_paths_queue_their_work_without_waiting(build, layout, monkeypatch):
    """lm-eval's padded rows and shared contexts, the score server's calls (each query run once
    and not) and the server's score jobs (queued with their copy to the host, whose `finish` the
    engine calls after queueing the next) queue their work and return before the device catches up:
    queued behind a ~1 s kernel, each returns well within it (no host read, no blocking copy up:
    tests/test_extend.py checks the scoring calls on any machine), and its answers are those of the
    same call with nothing queued before."""
    monkeypatch.setitem(extend.EXTEND_LAYOUT, "cuda", layout)
    fixture = build("qwen3", precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    rows, groups, starts, targets = grouped_rows((30, 17, 44), (3, 6, 1, 4), seed=41)
    ids, mask = pad_right(rows)
    generator = torch.Generator().manual_seed(43)
    requests = [[query + torch.randint(4, 500, (k,), generator=generator).tolist() for k in items]
                for query, items in ((torch.randint(4, 500, (n,), generator=generator).tolist(), items)
                                     for n, items in ((40, (3, 9, 1)), (25, (5, 2))))]
    loop = asyncio.new_event_loop()

    def served(reuse: bool):  # the server's call (its answers copied to the host behind it), not finished
        jobs = [ScoreJob(prompts, [5, 6, 9][: 2 + k], k == 1, loop, 4096, reuse) for k, prompts in enumerate(requests)]
        finish = ScoreJob.start_together(model, jobs)
        return lambda: torch.tensor([x for scores in finish() for item in scores for x in item])

    calls = {"padded rows": lambda: scoring.loglikelihood_totals(model, ids, mask, starts, targets),
             "shared contexts": lambda: scoring.grouped_loglikelihood_totals(model, rows, groups, starts, targets),
             "score, queries once": lambda: scoring.label_logprobs(model, requests, [5, 6], 4096, True),
             "score, whole prompts": lambda: scoring.label_logprobs(model, requests, [5, 6], 4096, False),
             "server's call, queries once": lambda: served(True),
             "server's call, whole prompts": lambda: served(False)}

    def finished(got):  # a server's call is answered by its finish
        return got() if callable(got) else got

    for name, call in calls.items():
        expected = finished(call()).clone()  # the first call also makes and checks the extend graph
        torch.cuda.synchronize()
        got = queued_behind_a_long_kernel(name, call)
        torch.testing.assert_close(finished(got), expected, rtol=1e-5, atol=1e-5)  # index_add_ sums in any order
    loop.close()


@pytest.mark.parametrize("precision,options", [("bf16", ()), ("bf16", UNPACKED)], ids=["bf16", "bf16-unpacked"])
def test_prefill_graph_on_cuda(build, precision, options):
    """`prefill_attention="onnx"` on CUDA (a Qwen3 export: the query/key norms GroupQueryAttention
    applied become nodes; ONNX Runtime's flash attention with grouped heads): made (its load-time
    check passed), and right- and left-padded batches give transformers fp32's logits as the package
    graph does."""
    fixture = build("qwen3", precision=precision, execution_provider="cuda", extra_options=options)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda", prefill_attention="onnx")
    assert model.decoder.causal is not None
    package = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    ids, mask = right_padded_batch([40, 17, 6], seed=12)
    for layout in (mask, mask.flip(1)):
        with torch.no_grad():
            expected = hf(input_ids=ids, attention_mask=layout).logits
        ours = model(ids.cuda(), attention_mask=layout.cuda()).logits
        theirs = package(ids.cuda(), attention_mask=layout.cuda()).logits
        assert real_positions_diff(ours, expected, layout) <= 1.5 * real_positions_diff(theirs, expected, layout) + 1e-3


def test_explicit_prefill_chunks_on_cuda(llama_cuda):
    """Chunking is off on CUDA by default; asked for, a long row's chunks (a prefill, then several
    tokens at a time over the row's cache) give one prefill's logits."""
    fixture, model = llama_cuda
    assert model.decoder.prefill_chunk == 0
    chunked_model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda", prefill_chunk=8)
    ids, mask = right_padded_batch([37, 20], seed=9)
    expected = model(ids.cuda(), attention_mask=mask.cuda()).logits
    logits = chunked_model(ids.cuda(), attention_mask=mask.cuda()).logits
    assert real_positions_diff(logits, expected, mask) < 2e-2 * expected.abs().max().item()


def test_hybrid_crops_on_cuda(build):
    """LFM2's bf16 CUDA export: a crop inside a one-row step of six tokens (two kept, left pending,
    cache.py) and the next step, then a crop back into the prompt (run again), each followed by a
    step whose logits are, to bf16's rounding, those of the kept sequence run whole."""
    fixture = build("lfm2", precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    gen = torch.Generator().manual_seed(61)
    ids, draft = (torch.randint(4, 500, (1, n), generator=gen).cuda() for n in (9, 6))
    step = torch.tensor([[77]], device="cuda")

    def ones(n):
        return torch.ones(1, n, dtype=torch.int64, device="cuda")

    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        model(draft, attention_mask=ones(15), past_key_values=cache, use_cache=True)
        cache.crop(-4)
        assert cache.pending is not None and cache.pending.shape == (1, 2)
        for kept in (torch.cat([ids, draft[:, :2]], 1), ids[:, :5]):
            got = model(step, attention_mask=ones(kept.shape[1] + 1), past_key_values=cache, use_cache=True).logits
            whole = model(torch.cat([kept, step], 1)).logits[:, -1]
            assert (got[:, -1] - whole).abs().max().item() < 2e-2 * whole.abs().max().item()
            cache.crop(5 - cache.get_seq_length())  # the second round: back into the prompt


def test_hybrid_conv_states_on_cuda(build):
    """LFM2's bf16 export for CUDA (ONNX Runtime's CUDA `CausalConvWithState`, ortmodule's rewrite
    taking each row's state at its own last token): a right-padded prefill into a cache, continued
    by three steps, gives the logits of each row's whole sequence run at once (to bf16's rounding),
    and both are within bf16's rounding of transformers fp32; a left-padded batch's greedy tokens are
    each row's own, generated alone."""
    fixture = build("lfm2", precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    assert len(model.decoder.spec.states) == 3
    hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    prompts, prompt_mask, together = check_cache_steps_and_batched_generate(model, hf, [17, 6, 11], 3,
                                                                            (48, 49, 50, [9, 4]), 8, 2)
    # Rows that stop early: the loop reads the stop flag every step when a hybrid's cache is returned
    # (generation.py), rather than cropping it back from steps run past the end.
    stop = int(together[0, -6])
    out = model.generate(prompts, attention_mask=prompt_mask, max_new_tokens=8, do_sample=False, pad_token_id=2,
                         eos_token_id=stop, return_dict_in_generate=True)
    assert out.past_key_values.seen == out.sequences.shape[1] - 1


def test_linear_attention_states_on_cuda(build):
    """Qwen3.5's bf16 export for CUDA (ONNX Runtime's CUDA `LinearAttention` and `CausalConvWithState`,
    ortmodule's rewrite holding each row's states at its padding): a right-padded prefill continued by
    three steps gives the logits of each row's whole sequence (to bf16's rounding), within bf16's
    rounding of transformers fp32; a left-padded batch's greedy tokens are each row's own."""
    fixture = build("qwen3_5", precision="bf16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    assert {state.kind for state in model.decoder.spec.states} == {"conv", "recurrent"}
    hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    check_cache_steps_and_batched_generate(model, hf, [17, 6, 11], 3, (52, 53, 54, [9, 4]), 8, 2)
