"""Score sentences with ortmodule beside transformers on the same weights.

Builds (once, then cached) a small random-weight Llama and its GenAI package with
onnxruntime-genai's model builder, then computes each sentence's log-likelihood both ways.
Run: python examples/demo.py [path/to/genai_package path/to/hf_checkpoint]
"""

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM

import ortmodule
from ortmodule import fixtures

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "ONNX Runtime runs machine learning models fast.",
]


def sentence_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of log p(token | prefix) over each row's real tokens after the first."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logprobs.gather(2, ids[:, 1:, None]).squeeze(2)
    return (picked * mask[:, 1:]).sum(1)


def main() -> None:
    if len(sys.argv) == 3:
        package_dir, hf_dir = sys.argv[1], sys.argv[2]
    else:
        print("building the demo model (cached after the first run) ...", flush=True)
        spec = fixtures.FixtureSpec("llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                                    intermediate_size=768, vocab_size=32000, context_length=512)
        fixture = fixtures.build(spec)
        package_dir, hf_dir = fixture.package_dir, fixture.hf_dir

    tokenizer = ortmodule.load_tokenizer(package_dir)
    model = ortmodule.OrtModelForCausalLM.from_pretrained(package_dir, device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)  # right-padded
    ids, mask = batch.input_ids, batch.attention_mask

    start = time.perf_counter()
    ours = sentence_logprobs(model(ids, attention_mask=mask).logits, ids, mask)
    ort_seconds = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        theirs = sentence_logprobs(reference(ids, attention_mask=mask).logits, ids, mask)
    hf_seconds = time.perf_counter() - start

    print(f"\npackage: {package_dir} ({model.num_parameters():,} parameters, {model.config.vocab_size} vocab)")
    print(f"{'sentence':60s} {'ortmodule':>12s} {'transformers':>12s}")
    for text, a, b in zip(SENTENCES, ours.tolist(), theirs.tolist()):
        print(f"{text[:60]:60s} {a:12.5f} {b:12.5f}")
    print(f"max |difference|: {(ours - theirs).abs().max().item():.2e}")
    print(f"one forward over the batch: ortmodule {ort_seconds * 1e3:.1f} ms, transformers {hf_seconds * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
