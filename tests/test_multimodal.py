"""Multimodal and mixed-shape packages: what is read from them, what is loaded, and what is not.

Logits, generation, scoring and lm-eval on these packages are checked against transformers in the
parity tests (the Gemma 4 and Qwen2.5-VL entries of helpers.ARCHES / MODEL_ARCHES)."""

import json
import logging
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import onnxruntime as ort
import pytest
import torch
from helpers import CHAT_TEMPLATE, LiveServer, expected_text, hf_greedy, load_pair, score_reference
from transformers import AutoConfig

from ortmodule import OrtModelForCausalLM, PackageError, load_tokenizer, read_package
from ortmodule.serving import create_app


@pytest.mark.parametrize(
    "arch, feeds, shared",
    [
        ("gemma4_embeds", {("inputs_embeds", "inputs_embeds")}, True),
        ("gemma4_mobius", {("inputs_embeds", "inputs_embeds"), ("per_layer_inputs", "per_layer_inputs")}, False),
        ("qwen2_5_vl", {("inputs_embeds", "inputs_embeds")}, False),
    ],
)
def test_the_embedding_model_feeds_the_decoder_inputs_it_declares(build, arch, feeds, shared):
    package = read_package(build(arch).package_dir)
    assert package.decoder.input_ids is None
    assert set(package.embedding.feeds) == feeds
    # Text runs the embedding model with empty media features of the graph's rank and dtype.
    assert [(name, shape) for name, _, shape in package.embedding.empty_inputs] == [("image_features", (0, 64))]
    assert package.decoder.shares_kv_buffer is shared  # GroupQueryAttention (builder) or Attention (mobius)


@pytest.mark.parametrize("arch", ["gemma4", "gemma4_embeds", "gemma4_mobius"])
def test_kv_shapes_are_read_per_layer(build, arch):
    """Gemma 4: sliding layers have head size 16 (and an 8-token window in the builder's
    packages), full-attention layers 32, as 256 and 512 in the real model."""
    package = read_package(build(arch).package_dir)
    assert [kv.head_size for kv in package.decoder.layers] == [16, 32]
    model, _ = load_pair(build(arch))
    out = model(torch.tensor([[5, 6, 7, 8]]), use_cache=True)
    assert [tuple(k.shape) for k, _ in out.past_key_values] == [(1, 2, 4, 16), (1, 2, 4, 32)]


def test_qwen_vl_decoder_takes_3d_positions(build):
    package = read_package(build("qwen2_5_vl").package_dir)
    assert package.decoder.position_rank == 3


@pytest.mark.parametrize("arch", ["gemma4_embeds", "gemma4_mobius", "qwen2_5_vl"])
def test_text_never_loads_the_vision_model(build, arch, monkeypatch):
    fixture = build(arch)
    genai = json.loads((fixture.package_dir / "genai_config.json").read_text())
    vision = (fixture.package_dir / genai["model"]["vision"]["filename"]).resolve()
    assert vision.is_file()
    opened = []
    original = ort.InferenceSession.__init__

    def spy(self, source, *args, **kwargs):
        opened.append(source if isinstance(source, bytes) else str(source))
        original(self, source, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "__init__", spy)
    monkeypatch.setenv("ORTMODULE_MAP_PACKED_WEIGHTS", "0")  # the sessions as the package's files make them
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3)
    paths = [p for p in opened if isinstance(p, str)]
    assert len(opened) == 2  # the decoder (rewritten, from bytes or its file) and the embedding model
    assert str(vision) not in paths and not any("vision" in p for p in paths)
    assert any(p.endswith(genai["model"]["embedding"]["filename"]) for p in paths)


def test_a_decoder_taking_embeddings_needs_an_embedding_section(build, tmp_path):
    package = tmp_path / "package"
    shutil.copytree(build("gemma4_embeds").package_dir, package)
    config = json.loads((package / "genai_config.json").read_text())
    del config["model"]["embedding"]
    (package / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(PackageError, match="takes inputs_embeds, not input_ids, and there is no 'model.embedding'"):
        read_package(package)


def test_a_missing_embedding_file_is_named(build, tmp_path):
    package = tmp_path / "package"
    shutil.copytree(build("gemma4_embeds").package_dir, package)
    (package / "embedding.onnx").unlink()
    with pytest.raises(PackageError, match="model.embedding.filename is 'embedding.onnx' but .* does not exist"):
        read_package(package)


@pytest.mark.parametrize("arch", ["gemma4_mobius", "qwen2_5_vl", "qwen3_vl", "llama", "gemma4"])
def test_the_context_length_is_what_the_rotary_tables_hold(build, arch, caplog):
    """mobius-onnx writes a context length of at least 4096 whatever the model's own (the fixtures':
    256), and builds its rotary tables for the model's: a longer prompt failed inside ONNX Runtime (a
    Gather past the table). The package's context length is now the tables', with a warning; the
    builder's packages say what they hold and load without one."""
    fixture = build(arch)
    declared = json.loads((fixture.package_dir / "genai_config.json").read_text())["model"]["context_length"]
    limit = AutoConfig.from_pretrained(fixture.hf_dir).get_text_config().max_position_embeddings
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    assert declared >= limit and model.package.context_length == limit
    assert model.config.get_text_config().max_position_embeddings == limit
    assert (f"model.context_length is {declared}, but the rotary position tables" in caplog.text) == (declared > limit)
    _, reference = load_pair(fixture)
    ids = torch.randint(4, 500, (1, limit), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids, logits_to_keep=1).logits[:, -1]
    torch.testing.assert_close(model(ids, logits_to_keep=1).logits[:, -1], expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=f"input length {limit + 1} exceeds the model's context length {limit}"):
        model(torch.randint(4, 500, (1, limit + 1)))


@pytest.mark.parametrize("arch", ["gemma4_embeds", "gemma4_mobius", "qwen2_5_vl"])
def test_the_serving_engine_runs_multimodal_packages_for_text(build, arch):
    """`ortmodule serve` on the multimodal packages: eight greedy completions at once into a decode
    batch of four rows (prompts of 3 to 120 tokens, prefilled in 16-token chunks: an embedding model
    before the decoder, per-layer inputs, concatenating attention, mRoPE positions), each equal to
    transformers' on the request alone, and a score request equal to transformers' forward."""
    fixture = build(arch)
    model, hf = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    rng = random.Random(0)
    prompts, lengths, expected = [], [1, 30, 7, 25, 3, 12, 30, 18], []
    for size, new in zip((3, 120, 17, 64, 5, 90, 33, 9), lengths):
        # Prompts whose continuations hold no media placeholder id (the vocabulary's last ids, which
        # random weights may generate and transformers then reads as a placeholder without its media).
        while True:
            prompt = [rng.randrange(4, 500) for _ in range(size)]
            tokens = hf_greedy(hf, prompt, new)
            if max(tokens) < 500:
                break
        prompts.append(prompt)
        expected.append(tokens)
    server = LiveServer(create_app(model, tokenizer, name="mm", prefill_chunk=16, max_rows=4, max_items=4))
    try:
        def complete(i):
            body = {"model": "mm", "prompt": prompts[i], "temperature": 0, "max_tokens": lengths[i]}
            response = server.client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, range(len(prompts))))
        for tokens, answer in zip(expected, answers):
            assert (answer["text"], answer["finish_reason"]) == expected_text(tokenizer, tokens)
        query, items, labels = [5, 6, 7, 8, 9] * 10, [[10, 11], [12], [13, 14, 15]], [20, 21]
        response = server.client.post("/v1/score", json={"model": "mm", "query": query, "items": items,
                                                         "label_token_ids": labels, "apply_softmax": True})
        assert response.status_code == 200, response.text
        reference = score_reference(hf, tokenizer, query, items, labels, True, False)
        assert torch.allclose(torch.tensor(response.json()["scores"], dtype=torch.float64), reference, atol=1e-4)
        # Without --processor a chat's image part is refused by name, not dropped.
        picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        chat = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, picture]}]
        response = server.client.post("/v1/chat/completions", json={"model": "mm", "messages": chat})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == ("messages[0].content: this server takes no images (a package "
                                                       "that takes them, served with --processor, does)")
    finally:
        server.stop()
