"""Benchmark shapes and helpers. `--bench-size cpu` (default) is the CPU set; `smoke` runs tiny
shapes once so CI keeps the suite working (`pytest benchmarks --benchmark-disable --bench-size smoke`)."""

import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

# Qwen3-0.6B's and a Gemma-style 262K-vocabulary config with random weights: throughput does not
# depend on weight values. Exported by the builder for CUDA in bf16. Qwen3's takes SmolLM2's real
# tokenizer (49,152 tokens): the fixtures' own 512-token one splits " B", " C" and " D" into two
# tokens, so that an MMLU question's letters made two distinct rows instead of a real tokenizer's one
# (twice the work of real MMLU; the GPU runs before 2026-11-26's session 31 had it).
QWEN3_0_6B = fixtures.FixtureSpec("qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                                  intermediate_size=3072, vocab_size=151936, context_length=4096, precision="bf16",
                                  initializer_range=0.02, execution_provider="cuda", tokenizer="smollm2")
GEMMA_262K = fixtures.FixtureSpec("gemma3", hidden_size=1152, num_layers=4, num_heads=4, num_kv_heads=1, head_dim=256,
                                  intermediate_size=6912, vocab_size=262144, context_length=4096, precision="bf16",
                                  initializer_range=0.02, execution_provider="cuda")

# Exact configs of real models with random weights, exported for the CPU in fp32: throughput does
# not depend on weight values. Qwen3-0.6B (151,936-token vocabulary, tied embeddings) and
# Gemma-3-270M (262,144 tokens, five 512-token sliding layers to one full layer).
QWEN3_0_6B_CPU = fixtures.FixtureSpec("qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                                      head_dim=128,
                                      intermediate_size=3072, vocab_size=151936, context_length=4096,
                                      initializer_range=0.02, tie_word_embeddings=True)
GEMMA3_270M_CPU = fixtures.FixtureSpec("gemma3", hidden_size=640, num_layers=18, num_heads=4, num_kv_heads=1,
                                       head_dim=256,
                                       intermediate_size=2048, vocab_size=262144, context_length=4096,
                                       initializer_range=0.02, sliding_window=512, tie_word_embeddings=True)
# LFM2-350M's sizes (its layer pattern is the fixtures': 11 convolution and 5 attention layers of 16)
LFM2_350M_CPU = fixtures.FixtureSpec("lfm2", hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=8,
                                     intermediate_size=6656, vocab_size=65536, context_length=4096,
                                     initializer_range=0.02, tie_word_embeddings=True)
# Qwen3.5 at about 0.8B weights' sizes: hidden 1024, 24 layers (three gated-delta linear attention layers to one
# full), 16 linear heads of 128, 8 attention heads of 256 over 2 KV heads, MLP 3584, a 248,320-token vocabulary,
# tied head; random weights (the fixtures' convolution scale and norm epsilon: fixtures.ARCHITECTURES)
QWEN3_5_08B_CPU = fixtures.FixtureSpec("qwen3_5", hidden_size=1024, num_layers=24, num_heads=8, num_kv_heads=2,
                                       intermediate_size=3584, vocab_size=248320, context_length=4096,
                                       initializer_range=0.02, tie_word_embeddings=True, head_dim=256,
                                       text_fields=(("linear_key_head_dim", 128), ("linear_value_head_dim", 128),
                                                    ("linear_num_key_heads", 16), ("linear_num_value_heads", 16)))
TINY = fixtures.FixtureSpec("llama", vocab_size=4096, context_length=256)
# Qwen2-VL-2B's config (its 32-block, 675 M-weight vision tower and 1.5 B text model, tied head) with
# random weights and SmolLM2's tokenizer, exported by mobius-onnx in fp32.
QWEN2_VL_2B_CPU = fixtures.FixtureSpec("qwen2_vl", hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                                       intermediate_size=8960, vocab_size=151936, context_length=32768,
                                       initializer_range=0.02, tie_word_embeddings=True, tokenizer="smollm2",
                                       mrope_section=(16, 24, 24),
                                       vision=(("depth", 32), ("embed_dim", 1280), ("mlp_ratio", 4), ("num_heads", 16),
                                               ("patch_size", 14)))
# Gemma-3-4B's vision tower and projector (SigLIP so400m: 896 x 896 images, 256 tokens each) with
# Gemma-3-1B's text config (a 4B text model in fp32 would not fit beside transformers' copy in 24 GB),
# exported by `ortmodule export --images` in fp32 (onnxruntime-genai's Gemma 3 vision form).
GEMMA3_VL_CPU = fixtures.FixtureSpec("gemma3_vl", hidden_size=1152, num_layers=26, num_heads=4, num_kv_heads=1,
                                     head_dim=256, intermediate_size=6912, vocab_size=262144, context_length=32768,
                                     initializer_range=0.02, tokenizer="smollm2", sliding_window=512,
                                     vision=(("hidden_size", 1152), ("intermediate_size", 4304),
                                             ("num_hidden_layers", 27), ("num_attention_heads", 16),
                                             ("image_size", 896), ("patch_size", 14), ("mm_tokens_per_image", 256)))

# Mistral Small 3.1's vision tower (Pixtral: 24 layers 1,024 wide, 14-pixel patches, SiLU MLPs, 0.4 B
# weights; the Ministral 3 models have the same) and its 2 x 2 patch merger, with a 0.6 B Mistral text
# config (Ministral-3-3B's heads and vocabulary, fewer and narrower layers: its 3 B text model in fp32
# would not fit beside transformers' copy in 24 GB), tied head; exported by mobius-onnx in fp32.
MISTRAL3_VL_CPU = fixtures.FixtureSpec("mistral3", hidden_size=1536, num_layers=16, num_heads=12, num_kv_heads=4,
                                       head_dim=128, intermediate_size=4608, vocab_size=131072, context_length=32768,
                                       initializer_range=0.02, tie_word_embeddings=True, tokenizer="smollm2",
                                       vision=(("hidden_size", 1024), ("intermediate_size", 4096),
                                               ("num_hidden_layers", 24), ("num_attention_heads", 16),
                                               ("head_dim", 64), ("image_size", 1540), ("patch_size", 14)))

# transformers' default Gemma 4 vision tower (16 layers 768 wide, 16-pixel patches pooled 3 x 3, images of
# up to 280 tokens) with a 0.9 B Gemma 4 text config (Gemma 4 E2B's width, heads, window and vocabulary,
# 12 layers, 2 of them full attention; per-layer inputs 8 wide where E2B's are 256), exported by
# mobius-onnx in fp32.
GEMMA4_VL_CPU = fixtures.FixtureSpec("gemma4_mobius", hidden_size=1536, num_layers=12, num_heads=8, num_kv_heads=1,
                                     head_dim=256, intermediate_size=6144, vocab_size=262144, context_length=32768,
                                     initializer_range=0.02, tokenizer="smollm2", sliding_window=512,
                                     vision=(("hidden_size", 768), ("intermediate_size", 3072),
                                             ("num_hidden_layers", 16), ("num_attention_heads", 12),
                                             ("num_key_value_heads", 12), ("head_dim", 64), ("patch_size", 16),
                                             ("position_embedding_size", 10240)))

# What each model key means on the page.
MODELS = {
    "smollm2-fp32": "SmolLM2-135M-Instruct, fp32 package (real trained weights)",
    "smollm2-int4": "SmolLM2-135M-Instruct, int4 package (real trained weights; transformers runs fp32)",
    "qwen3-0.6b": "Qwen3-0.6B's config, random weights",
    "gemma3-270m": "Gemma-3-270M's config, random weights",
    "gemma-262k": "a Gemma-style 262K-vocabulary config, random weights (synthetic shape)",
    "qwen3-0.6b-bf16": "Qwen3-0.6B's config, random weights, SmolLM2's tokenizer, bf16 package exported for CUDA",
    "smollm2-bf16": "SmolLM2-135M-Instruct, bf16 package exported for CUDA (real trained weights)",
    "tiny": "tiny Llama (smoke test, synthetic)",
    "qwen2-vl-2b": "Qwen2-VL-2B's config, random weights, SmolLM2's tokenizer, fp32 package exported by mobius-onnx",
    "gemma3-4b-vision": "Gemma-3-4B's vision tower and projector with Gemma-3-1B's text config, random weights, "
                        "SmolLM2's tokenizer, fp32 package exported by `ortmodule export --images`",
    "mistral3-vision": "Mistral-Small-3.1's vision tower (Pixtral) with a 0.6 B Mistral text config, random weights, "
                       "SmolLM2's tokenizer, fp32 package exported by mobius-onnx",
    "gemma4-vision": "Gemma 4's default vision tower with a 0.9 B Gemma 4 text config, random weights, "
                     "SmolLM2's tokenizer, fp32 package exported by mobius-onnx",
    "tiny-vl": "tiny Qwen2-VL (smoke test, synthetic)",
}

SIZES = {
    "cpu": dict(
        device="cpu",
        # forward: model key -> (spec, batch, length); logits for every position, or the last `keep`.
        forward={"smollm2-fp32": (fixtures.SMOLLM2, 8, 128), "qwen3-0.6b": (QWEN3_0_6B_CPU, 2, 128),
                 "gemma3-270m": (GEMMA3_270M_CPU, 2, 128)},
        keep=4,
        # lm-eval, generate and score: the real model, fp32 and int4 packages.
        decoders={"smollm2-fp32": fixtures.SMOLLM2, "smollm2-int4": fixtures.SMOLLM2_INT4},
        generate=dict(batches=(1, 8), prompt_lengths=(32, 128), new_tokens=32, fewshot_beginning=512),
        lm_eval=dict(limit=30, batch_size=8),  # 30 questions: 120 loglikelihood requests
        # The shapes of MMLU (5-shot, 300-900 tokens), HellaSwag and wikitext (2k-8k-token documents).
        lm_eval_at_scale=dict(limits={"mmlu": 16, "fewshot": 32, "hellaswag": 16, "arc": 16, "rolling": 2, "gsm8k": 16},
                              batch_size=8),
        # benchmarks/test_host_time.py: MMLU-shaped requests on a model of negligible compute.
        host_time=dict(questions=250, batch_size=32, decode_tokens=256, score_requests=10),
        minicons=dict(sentences=320, batch_size=16),  # minicons' IncrementalLMScorer.sequence_score
        # score(): requests of one query and many short items; the server's load at a steady rate.
        score=dict(requests=2, query_tokens=120, items=16, item_tokens=20, labels=4),
        # The server under open-loop load: requests of `items` items (of 1 to item_tokens tokens,
        # or exactly that many with `exact`) after a query; `reuse`: per `--reuse-prefix` setting, its
        # rates in requests/s.
        server=dict(reuse={"auto": (1.0,)}, duration=20.0, query_tokens=120, items=10, item_tokens=20, labels=4,
                    exact=False),
        # benchmarks/test_images.py: prompts of one image (224 x 224: 256 patches, 64 image tokens)
        # between 40 text tokens; score keeps the last `keep` positions' logits, generate makes `new_tokens`.
        images=dict(key="qwen2-vl-2b", spec=QWEN2_VL_2B_CPU, batch=4, image_side=224, text_tokens=40, keep=8,
                    new_tokens=16, rounds=3),
        # Gemma 3: two prompts of one 896 x 896 image (4,096 patches, 256 image tokens, attended both ways
        # within the image: ortmodule/blocks.py) between 40 text tokens.
        images_gemma3=dict(key="gemma3-4b-vision", spec=GEMMA3_VL_CPU, batch=2, image_side=896, text_tokens=40,
                           keep=8, new_tokens=16, rounds=2),
        # Mistral 3: two prompts of one 448 x 448 image (1,024 patches; 16 rows of 16 image tokens after the
        # 2 x 2 merger, each row ended by a row break) between 40 text tokens.
        images_pixtral=dict(key="mistral3-vision", spec=MISTRAL3_VL_CPU, batch=2, image_side=448, text_tokens=40,
                            keep=8, new_tokens=16, rounds=2),
        # Gemma 4: two prompts of one 768 x 768 image (2,304 patches pooled to 256 image tokens) between 40
        # text tokens.
        images_gemma4=dict(key="gemma4-vision", spec=GEMMA4_VL_CPU, batch=2, image_side=768, text_tokens=40,
                           keep=8, new_tokens=16, rounds=2),
    ),
    "gpu": dict(
        device="cuda",
        # forward: the prefill target is 32 x 512 tokens (logits for all of them: 5 GB of bf16).
        forward={"qwen3-0.6b-bf16": (QWEN3_0_6B, 32, 512), "smollm2-bf16": (fixtures.SMOLLM2_BF16_CUDA, 32, 512),
                 "gemma-262k": (GEMMA_262K, 8, 1024)}, keep=4,
        decoders={"qwen3-0.6b-bf16": QWEN3_0_6B, "smollm2-bf16": fixtures.SMOLLM2_BF16_CUDA},
        generate=dict(batches=(1, 32), prompt_lengths=(128, 512), new_tokens=64, fewshot_beginning=1024),
        lm_eval=dict(limit=100, batch_size=32),  # 100 questions: 400 loglikelihood requests
        # 10,000 MMLU-shaped requests, as many of MMLU as lm-eval runs it 5-shot (ten subjects of 250 questions),
        # 4,000 HellaSwag-shaped, 4,000 ARC-shaped, 50 documents (about 250,000 tokens).
        # Rolling's windows fill the context and every position is scored: 64 rows of 4,096 tokens would be
        # 80 GB of Qwen3's bf16 logits in transformers (and in ortmodule), so they go 8 at a time; the fp32
        # reference of half-precision rows, whose logits and log-softmax take twice the memory, 16 (4 for rolling).
        lm_eval_at_scale=dict(limits={"mmlu": 2500, "fewshot": 2500, "hellaswag": 1000, "arc": 1000, "rolling": 50,
                                      "gsm8k": 256},
                              batch_size=64,
                              rolling_batch_size=8, reference_batch_size=16, reference_rolling_batch_size=4),
        host_time=dict(questions=1000, batch_size=64, decode_tokens=256, score_requests=10),
        minicons=dict(sentences=320, batch_size=64),
        score=dict(requests=8, query_tokens=512, items=64, item_tokens=32, labels=4),
        # SGLang's bench_score shape (a 120-token query, 10 items of 180 tokens, 2 labels), at rates
        # of 400 to 1,600 items/s (100 requests/s since session 58: SGLang's 1,000 items/s, where the
        # H200 saturates just above); with every query run once (--reuse-prefix on) from the target's rate.
        server=dict(reuse={"auto": (40.0, 80.0, 100.0, 120.0, 160.0), "on": (120.0, 160.0)}, duration=15.0,
                    query_tokens=120, items=10, item_tokens=180, labels=2, exact=True),
    ),
    "smoke": dict(
        device="cpu",
        forward={"tiny": (TINY, 2, 32)}, keep=4,
        decoders={"tiny": TINY},
        generate=dict(batches=(1, 2), prompt_lengths=(4, 9), new_tokens=4, fewshot_beginning=100),
        lm_eval=dict(limit=3, batch_size=8),
        lm_eval_at_scale=dict(limits={"mmlu": 2, "fewshot": 3, "hellaswag": 2, "arc": 2, "rolling": 1, "gsm8k": 2},
                              batch_size=4),
        host_time=dict(questions=3, batch_size=4, decode_tokens=4, score_requests=2),
        minicons=dict(sentences=8, batch_size=4),
        score=dict(requests=2, query_tokens=12, items=3, item_tokens=4, labels=2),
        server=dict(reuse={"auto": (4.0,), "on": (4.0,)}, duration=1.0, query_tokens=12, items=2, item_tokens=4,
                    labels=2, exact=False),
        images=dict(key="tiny-vl", spec=fixtures.FixtureSpec("qwen2_vl"), batch=2, image_side=16, text_tokens=10,
                    keep=2, new_tokens=3, rounds=1),
        images_gemma3=dict(key="tiny-gemma3-vl", spec=fixtures.FixtureSpec("gemma3_vl"), batch=2, image_side=32,
                           text_tokens=10, keep=2, new_tokens=3, rounds=1),
        images_pixtral=dict(key="tiny-mistral3-vl", spec=fixtures.FixtureSpec("mistral3"), batch=2, image_side=32,
                            text_tokens=10, keep=2, new_tokens=3, rounds=1),
        images_gemma4=dict(key="tiny-gemma4-vl", spec=fixtures.FixtureSpec("gemma4_mobius"), batch=2, image_side=32,
                           text_tokens=10, keep=2, new_tokens=3, rounds=1),
    ),
}
def at_scale_batch(options: dict, workload: str, reference: bool = False) -> int:
    """An at-scale workload's batch size (`rolling`'s may be its own), or with `reference` that of the
    fp32 transformers run beside half-precision rows (by default the workload's own)."""
    rolling = workload == "rolling"
    own = options.get("rolling_batch_size", options["batch_size"]) if rolling else options["batch_size"]
    return options.get("reference_rolling_batch_size" if rolling else "reference_batch_size", own) if reference else own


# Peers that run batch 1 only take minutes on the real model: measured on its fp32 package only.
SLOW_PEERS_ON = {"smollm2-fp32", "tiny"}


def pytest_generate_tests(metafunc):
    """`forward_key` and `decoder_key` parametrize a workload over the size's models."""
    size = SIZES[metafunc.config.getoption("--bench-size")]
    if "forward_key" in metafunc.fixturenames:
        metafunc.parametrize("forward_key", list(size["forward"]), scope="module")
    if "decoder_key" in metafunc.fixturenames:
        metafunc.parametrize("decoder_key", list(size["decoders"]), scope="module")
    if "server_reuse" in metafunc.fixturenames:  # the server's --reuse-prefix, each at its own rates
        cases = [(reuse, rate) for reuse, rates in size["server"]["reuse"].items() for rate in rates]
        ids = [f"reuse-{reuse}-{rate:g}" for reuse, rate in cases]
        metafunc.parametrize(("server_reuse", "server_rate"), cases, ids=ids)


def pytest_benchmark_update_machine_info(config, machine_info):
    """The CPU's peak: theoretical FMA FLOP/s, and measured fp32 matmul FLOP/s and copy bandwidth."""
    size = config.getoption("--bench-size")
    if size == "gpu":
        machine_info["limits"] = gpu_limits()
    elif size != "smoke":
        machine_info["limits"] = cpu_limits()


# Dense bf16 tensor-core peak (no sparsity) and memory bandwidth from the vendor's data sheets.
GPU_DATASHEET = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12), "A100": (312e12, 2.0e12), "L40S": (362e12,
                                                                                                         0.864e12)}


def gpu_limits() -> dict:
    """The GPU's data-sheet bf16 peak and memory bandwidth beside what torch measures here: an
    8192^3 bf16 matmul and a 1 GiB device-to-device copy (bytes read + written)."""
    import torch

    name = torch.cuda.get_device_name()
    sheet_flops, sheet_bandwidth = next((v for k, v in GPU_DATASHEET.items() if k in name), (0.0, 0.0))

    def best_rate(fn, work: float, repeats: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        best = 0.0
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = max(best, work / (start.elapsed_time(end) / 1e3))
        return best

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    matmul = best_rate(lambda: a @ b, 2 * n**3)
    big = torch.empty(2**30 // 2, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(big)
    copy = best_rate(lambda: out.copy_(big), 2 * 2**30)
    a = b = big = out = None  # freed before the cache is emptied
    torch.cuda.empty_cache()
    return {"kind": "gpu", "name": name, "datasheet_bf16_flops": sheet_flops, "datasheet_bytes_per_s": sheet_bandwidth,
            "bf16_matmul_flops": matmul, "peak_flops": max(sheet_flops, matmul), "copy_bytes_per_s": copy}


def cpu_limits() -> dict:
    """FMA peak = cores x clock x fp32 FLOP per cycle (two FMA pipes: Zen 4 runs AVX-512 as two
    256-bit halves, 32 FLOP/cycle; Zen 5 and Intel AVX-512 cores 64; AVX2 cores 32), beside what
    torch's fp32 matmul and a large copy reach on this machine."""
    import time

    import torch

    flags, vendor, family, mhz = set(), "", 0, 0.0
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "flags" and not flags:
                flags = set(value.split())
            elif key == "vendor_id":
                vendor = value
            elif key == "cpu family":
                family = int(value)
            elif key == "cpu MHz" and not mhz:
                mhz = float(value)
    if "avx512f" in flags:
        per_cycle = 32 if vendor == "AuthenticAMD" and family < 26 else 64
    else:
        per_cycle = 32 if "fma" in flags else 16
    cores = os.cpu_count() or 1
    nominal = cores * mhz * 1e6 * per_cycle

    def best_rate(fn, work: float, repeats: int = 5) -> float:
        fn()
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = max(best, work / (time.perf_counter() - start))
        return best

    n = 4096
    a, b = torch.randn(n, n), torch.randn(n, n)
    sgemm = best_rate(lambda: torch.mm(a, b), 2 * n**3)
    # ONNX Runtime's MatMul on a square and on a transformer's shape (1024 tokens x 576 x 1536,
    # SmolLM2's MLP: weights that stay in the caches run faster than the square's).
    onnx_sgemm = max(best_rate(_onnxruntime_matmul(n, n, n), 2 * n**3),
                     best_rate(_onnxruntime_matmul(1024, 576, 1536), 2 * 1024 * 576 * 1536, repeats=20))
    big = torch.empty(256 * 2**20 // 4)
    out = torch.empty_like(big)
    bandwidth = best_rate(lambda: out.copy_(big), 2 * big.numel() * 4)
    # A VM reports its nominal clock but may run above it: the peak is the highest of the three.
    return {"cores": cores, "mhz": mhz, "flop_per_cycle": per_cycle, "nominal_fma_flops": nominal,
            "sgemm_flops": sgemm, "onnxruntime_sgemm_flops": onnx_sgemm, "peak_flops": max(nominal, sgemm, onnx_sgemm),
            "copy_bytes_per_s": bandwidth}


def _onnxruntime_matmul(m: int, k: int, n: int):
    """A call of ONNX Runtime's fp32 MatMul, [m, k] x [k, n] (the kernels the packages use)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    shapes = {"a": [m, k], "b": [k, n]}
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in shapes.items()]
    output = helper.make_tensor_value_info("c", TensorProto.FLOAT, [m, n])
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "matmul", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {name: np.random.default_rng(0).standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
    return lambda: session.run(None, feeds)


def model_label(key: str) -> str:
    return MODELS.get(key, key)


def flop_count(fixture, tokens: int, logit_rows: int) -> int:
    """Matmul FLOPs of a forward: 2 x body weights x tokens, plus 2 x hidden x vocabulary for each
    row that reaches the LM head (attention's own products are left out: small at these lengths)."""
    body, head = weight_counts(fixture)
    return 2 * body * tokens + 2 * head * logit_rows


def weight_counts(fixture) -> tuple[int, int]:
    """(weights of the transformer body, weights of the LM head) from the checkpoint; the token
    embedding is a lookup and counts in neither."""
    from safetensors import safe_open

    body = 0
    for shard in fixture.hf_dir.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for key in f.keys():  # noqa: SIM118  a safetensors file, not a dict
                if "embed_tokens" not in key and "lm_head" not in key:
                    shape = f.get_slice(key).get_shape()
                    count = 1
                    for dim in shape:
                        count *= dim
                    body += count
    return body, fixture.spec.hidden_size * fixture.spec.vocab_size


def weight_bytes(fixture) -> int:
    """Bytes of the package's weights: what one decode step streams from memory."""
    return sum(f.stat().st_size for f in fixture.package_dir.glob("*.onnx*"))


def pytest_addoption(parser):
    parser.addoption("--bench-size", default="cpu", choices=sorted(SIZES), help="which set of shapes to run")
    parser.addoption("--server-extend", metavar="LAYOUT,HEADS", default=None,
                     help="the score server's extend graph (benchmarks/serve_with_extend.py: mask|cache, "
                          "repeated|grouped); default: ortmodule's")


@pytest.fixture(scope="session")
def size(request):
    return SIZES[request.config.getoption("--bench-size")]


def reset_peak_rss() -> None:
    """Linux: restart the process's peak resident set size count (VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure_peak(fn) -> float:
    """Peak resident memory (MB) while `fn` runs once."""
    reset_peak_rss()
    fn()
    return peak_rss_mb()


def reference_model(fixture, device: str, precision: str | None = None):
    """transformers on the fixture's weights, in the package's precision (fp32 for int4) or in
    `precision`, on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int4": torch.float32}[
        precision or fixture.spec.precision]
    return AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=dtype).to(device).eval()


def synced(fn, device: str):
    """`fn` followed by a device sync, so that the clock sees the work a CUDA call queued."""
    if device == "cpu":
        return fn
    import torch

    def call():
        out = fn()
        torch.cuda.synchronize()
        return out

    return call


def median_seconds(fn, rounds: int, device: str = "cpu") -> float:
    """The median wall time of `rounds` calls of `fn` after one warm-up, the device synchronized."""
    import time

    fn = synced(fn, device)
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def device_name(device: str) -> str:
    import torch

    return "cpu" if device == "cpu" else torch.cuda.get_device_name(device)


def transformers_scores(hf, request):
    """Score-API scores as a transformers user writes them: the items left-padded in one batch, logits_to_keep=1."""
    import torch

    prompts = [request["query"] + item for item in request["items"]]
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    logits = hf(ids, attention_mask=mask, logits_to_keep=1).logits[:, -1]
    return torch.softmax(torch.log_softmax(logits.float(), -1)[:, request["label_token_ids"]], -1).tolist()


def record_rate(benchmark, fn, units: int, unit: str, device: str, rounds: int):
    """Time `fn` (one warm-up call, then `rounds`), recording `{unit}_per_s` and the peak memory;
    return the warm-up's output for the caller to check."""
    fn = synced(fn, device)
    out = fn()
    reset_peak_rss()
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=0)
    benchmark.extra_info["peak_rss_mb"] = round(peak_rss_mb(), 1)
    if benchmark.stats:  # None under --benchmark-disable
        benchmark.extra_info[f"{unit}_per_s"] = round(units / benchmark.stats.stats.median, 1)
    return out


def _stop_on_terminate(signum, frame):
    """SIGTERM (plain `timeout`, a job runner's stop) ends the run as Ctrl-C does, so that the rows
    that finished are written; a second signal is ignored while they are."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_configure(config):
    signal.signal(signal.SIGTERM, _stop_on_terminate)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """A run stopped by Ctrl-C, SIGTERM or `timeout` (benchmarks/run.py waits for it) keeps the rows
    that finished: the benchmark that was running has no timings yet, on which pytest-benchmark's
    saving of the JSON would fail (before pytest-benchmark's own hook, which saves)."""
    benchmarks = getattr(session.config, "_benchmarksession", None)
    if benchmarks is not None:
        benchmarks.benchmarks[:] = [b for b in benchmarks.benchmarks if b.stats.data]
    yield
