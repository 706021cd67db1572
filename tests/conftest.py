import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2_5_VLForConditionalGeneration

from ortmodule import OrtModelForCausalLM
from ortmodule_dev import fixtures

# Architectures every parity test runs on (Gemma 3 alternates sliding-window and full layers;
# the Gemma 4 packages mix KV head sizes per layer, and two of them are multimodal: an embedding
# model feeds the decoder; see ortmodule_dev/fixtures.py).
GEMMA4 = ["gemma4", "gemma4_embeds", "gemma4_mobius"]
ARCHES = ["llama", "qwen3", "gemma3", "phi3", "mistral", "qwen2", *GEMMA4]
# Packages lm-eval's hf backend cannot load as a reference (no AutoModelForCausalLM class):
# Qwen2.5-VL, whose decoder takes 3-D mRoPE position_ids. The model-level tests cover it.
MODEL_ARCHES = [*ARCHES, "qwen2_5_vl"]

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="session")
def build():
    """Build (or fetch from the cache) a fixture package: `build(arch, **spec_fields)`."""
    def _build(arch="llama", **fields):
        return fixtures.build(fixtures.FixtureSpec(arch, **fields))
    return _build


_models = {}


def reference_class(fixture):
    """The transformers class of a fixture's checkpoint (Qwen2.5-VL has no causal-LM auto class)."""
    return Qwen2_5_VLForConditionalGeneration if fixture.spec.arch == "qwen2_5_vl" else AutoModelForCausalLM


def load_pair(fixture, device="cpu"):
    """The ortmodule model and the transformers reference on the same weights (cached per session)."""
    key = (fixture.package_dir, device)
    if key not in _models:
        ort_model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=device)
        hf_model = reference_class(fixture).from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
        _models[key] = (ort_model, hf_model)
    return _models[key]


@pytest.fixture(scope="session", params=MODEL_ARCHES)
def arch_pair(request, build):
    return load_pair(build(request.param))


@pytest.fixture(scope="session")
def llama(build):
    return build("llama")


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


OPENAI_NAME = "tiny-llama"
# A chat template for the fixture's tokenizer (the real SmolLM2 package brings its own).
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def openai_live(build):
    """`ortmodule serve`'s app on the llama fixture, live on 127.0.0.1, with a chat template:
    (server, model, transformers model, tokenizer, fixture)."""
    from test_server import LiveServer

    from ortmodule import load_tokenizer
    from ortmodule.server import create_app

    fixture = build("llama")
    model, hf = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    live = LiveServer(create_app(model, tokenizer, name=OPENAI_NAME, window_ms=20))
    yield live, model, hf, tokenizer, fixture
    live.stop()
