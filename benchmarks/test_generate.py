"""Decoding speed: tokens/s for a batch of prompts of different lengths, ortmodule's generate()
beside transformers' generate on the same weights and onnxruntime-genai's Generator on the same
package. Every backend makes exactly `new_tokens` tokens per row (no early end of sequence)."""

import numpy as np
import onnxruntime_genai as og
import pytest
import torch
from conftest import record_rate, reference_model

from ortmodule import OrtModelForCausalLM, fixtures

PAD = 2


@pytest.fixture(scope="module")
def workload(size):
    fixture = fixtures.build(size["decoder"])
    shape = size["generate"]
    batch, (shortest, longest), new = shape["batch"], shape["prompt_lengths"], shape["new_tokens"]
    lengths = torch.linspace(shortest, longest, batch).long()
    ids = torch.randint(4, fixture.spec.vocab_size, (batch, longest), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(longest)[None, :] >= longest - lengths[:, None]).long()  # left-padded, as HF generates
    device = size["device"]
    return fixture, ids.masked_fill(mask == 0, PAD).to(device), mask.to(device), new


def record(benchmark, fn, tokens, device):
    return record_rate(benchmark, fn, tokens, "tokens", device.type, rounds=5)


@pytest.mark.benchmark(group="generate")
def test_ortmodule_generate(benchmark, workload):
    fixture, ids, mask, new = workload
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=ids.device)
    out = record(benchmark, lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None,
                                                   pad_token_id=PAD), len(ids) * new, ids.device)
    assert out.shape == (ids.shape[0], ids.shape[1] + new)


@pytest.mark.benchmark(group="generate")
def test_transformers_generate(benchmark, workload):
    fixture, ids, mask, new = workload
    model = reference_model(fixture, ids.device)

    def generate():
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=PAD)

    out = record(benchmark, generate, len(ids) * new, ids.device)
    assert out.shape == (ids.shape[0], ids.shape[1] + new)


@pytest.mark.benchmark(group="generate")
def test_genai_generate(benchmark, workload):
    """onnxruntime-genai's Generator, batched: prompts padded with the pad id, as it expects."""
    fixture, ids, _, new = workload
    model = og.Model(str(fixture.package_dir))
    prompts = ids.cpu().numpy().astype(np.int32)
    total = ids.shape[1] + new

    def generate():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=len(prompts))
        generator = og.Generator(model, params)
        generator.append_tokens(prompts)
        while not generator.is_done():
            generator.generate_next_token()
        return np.stack([generator.get_sequence(i) for i in range(len(prompts))])

    out = record(benchmark, generate, len(ids) * new, ids.device)
    assert out.shape == (ids.shape[0], total)
