"""The host's time around image prompts in `--model ortmodule-multimodal`'s `generate_until`, measured
where the model's compute is small, so that what the host does between the device's batches shows on
a CPU: a Qwen2.5-VL-form model with a two-layer, 64-wide text model and a one-block, 32-wide vision
tower with a real model's 14-pixel patches (windowed attention), random weights, fp32; the Qwen2-VL
image processor at its own sizes (an image of `--side` x `--side` pixels: 1,024 gives 1,225 image
tokens), and the test fixtures' tokenizer. The image processor is transformers' PIL one (its fast,
torchvision one is not installed here).

Two ways, in turns within one process after a warm-up, medians of `--rounds`: the batches as session 75
ran them (`EncodedInTheLoop`: hf-multimodal's loop on each batch, which encodes the batch when it comes,
on the model's thread, and ends it with `gc.collect()` and `torch.cuda.empty_cache()`), and as they run
now (encoded on worker threads ahead of the batch that generates, no per-batch collection). For the
earlier way, where its time went: the count pass (each prompt's tokens, before the batches), the
batches' encoding, and the model's runs (`_model_multimodal_generate`); the rest is lm-eval's loop,
its `gc.collect()` included.

    python benchmarks/image_host_time.py [--documents 16] [--side 1024] [--rounds 3] [--device cuda]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import transformers
from lm_eval.api.instance import Instance
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # ortmodule_dev, and the tests' processor

from evaluation import Clock  # noqa: E402
from image_generation_batches import EncodedInTheLoop  # noqa: E402
from test_images import ImageTextProcessor  # noqa: E402

from ortmodule import OrtModelForCausalLM  # noqa: E402
from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM  # noqa: E402
from ortmodule_dev import fixtures  # noqa: E402

SPEC = fixtures.FixtureSpec("qwen2_5_vl", context_length=8192,
                            vision=(("patch_size", 14), ("window_size", 112), ("fullatt_block_indexes", ())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--side", type=int, default=1024)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the model's; the processor runs on the host)")
    args = parser.parse_args()
    fixture = fixtures.build(SPEC)
    processor = ImageTextProcessor(fixture.hf_dir)
    processor.image_processor = transformers.Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2,
                                                                      merge_size=2)
    pictures = [Image.fromarray((np.random.RandomState(i).rand(args.side, args.side, 3) * 255).astype("uint8"))
                for i in range(args.documents)]
    requests = [Instance("generate_until", None, (f"<image> Question {i}: say", {"until": ["\n"], "max_gen_toks":
                                                  args.new}, {"visual": [picture]}), i)
                for i, picture in enumerate(pictures)]
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=args.device)
    lms = {way: cls(model, processor=processor, batch_size="auto", device=args.device)
           for way, cls in (("encoded in the loop", EncodedInTheLoop), ("encoded ahead", OrtModuleMultimodalLM))}
    earlier = lms["encoded in the loop"]
    parts = {name: Clock(pytest.MonkeyPatch(), earlier, name)  # the earlier way's parts
             for name in ("_prompt_widths", "tok_batch_multimodal_encode", "_model_multimodal_generate")}
    for lm in lms.values():
        lm.generate_until(requests[:2], disable_tqdm=True)  # warm-up
    for clock in parts.values():
        clock.seconds = 0.0
    times, answers = {}, {}
    for _ in range(args.rounds):
        for way, lm in lms.items():
            start = time.perf_counter()
            answers[way] = lm.generate_until(requests, disable_tqdm=True)
            times.setdefault(way, []).append(time.perf_counter() - start)
    tokens = earlier._prompt_tokens(requests[0].args[0], requests[0].args[2])
    print(f"{args.documents} prompts of a {args.side} x {args.side} image ({tokens} tokens a prompt), "
          f"{args.new} new tokens at most, batch_size auto; medians of {args.rounds} rounds in turns:")
    for way in lms:
        median = statistics.median(times[way])
        print(f"  {way}: {median:.2f} s, {1e3 * median / args.documents:.0f} ms a prompt "
              f"(rounds: {', '.join(f'{t:.2f}' for t in times[way])})")
    ms = {name: 1e3 * clock.seconds / args.rounds / args.documents for name, clock in parts.items()}
    print(f"  encoded in the loop, ms a prompt: counting {ms['_prompt_widths']:.0f}, encoding "
          f"{ms['tok_batch_multimodal_encode']:.0f}, the model's runs {ms['_model_multimodal_generate']:.0f}")
    print("  the same answers:", answers["encoded in the loop"] == answers["encoded ahead"])


if __name__ == "__main__":
    main()
