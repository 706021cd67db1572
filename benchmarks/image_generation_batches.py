"""lm-eval's `generate_until` on prompts with images (`--model ortmodule-multimodal`) in batches by their
work (ortmodule/lm_eval_multimodal.py: `generate_until`, `_model_multimodal_generate`) against
hf-multimodal's loop as ortmodule ran it before 2026-12-02 (batches of `batch_size` rows, lm-eval's
stop criteria), on this CPU, at batch sizes 1 (lm-eval's default), 4 and `auto` (which hf-multimodal
refuses, so it has no earlier row), and the batches by their work as session 75 ran them ("encoded in
the loop": each batch encoded by the processor when it comes, on the model's thread, and ended by
hf-multimodal's `gc.collect()`), where now the batches are encoded on worker threads ahead of the batch
that generates. The model: Qwen2.5-VL's form with Qwen2.5-VL-3B's vision tower
(32 blocks, 1,280 wide, windowed attention, 14-pixel patches) and Qwen2-VL-2B's text model (28 layers,
1,536 wide), random weights, the test fixtures' 512-token vocabulary (their tokenizer, with the image
tokens at its reserved ids; ortmodule_dev/fixtures.py), exported by mobius-onnx in fp32. The task: an
offline task of MMMU's form (tests/helpers.py), `--documents` prompts of one random `--side` x `--side`
image (224: 64 image tokens) and a short text, greedy, at most `--new` tokens or a new line. The ways run in turns
within one process after a warm-up; per setting the median seconds inside the backend's
`generate_until` and how many answers are the same text as the first way's at batch size 1.

    python benchmarks/image_generation_batches.py [--documents 8] [--new 16] [--rounds 2] [--side 224]
    python benchmarks/image_generation_batches.py --without-earlier --side 896
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lm_eval
from lm_eval.models.hf_vlms import HFMultimodalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # ortmodule_dev, and the tests' image task and processor

import helpers  # noqa: E402
import transformers  # noqa: E402
from test_images import ImageTextProcessor  # noqa: E402

from ortmodule import OrtModelForCausalLM  # noqa: E402
from ortmodule.lm_eval import plan_generation, run_in_batches  # noqa: E402
from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM  # noqa: E402
from ortmodule.tasks import task_manager  # noqa: E402
from ortmodule_dev import fixtures  # noqa: E402

SPEC = fixtures.FixtureSpec("qwen2_5_vl", hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                            intermediate_size=8960, vocab_size=512, context_length=4096, initializer_range=0.02,
                            tie_word_embeddings=True, mrope_section=(16, 24, 24),
                            vision=(("depth", 32), ("hidden_size", 1280), ("intermediate_size", 3420),
                                    ("num_heads", 16), ("patch_size", 14), ("window_size", 112),
                                    ("fullatt_block_indexes", (7, 15, 23, 31))))


class EarlierLoop(OrtModuleMultimodalLM):
    """The backend as it ran before 2026-12-02: hf-multimodal's loop and stop criteria as they are."""

    generate_until = HFMultimodalLM.generate_until
    _model_multimodal_generate = HFMultimodalLM._model_multimodal_generate


class EncodedInTheLoop(OrtModuleMultimodalLM):
    """The batches by their work as session 75 ran them: hf-multimodal's loop on each batch, which
    encodes the batch when it comes (the processor on the model's thread) and ends it with `gc.collect()`
    and `torch.cuda.empty_cache()`."""

    def _generate_with_images(self, requests, disable_tqdm: bool) -> list[str]:
        batches = plan_generation(self, requests, self._prompt_widths(requests),
                                  None if self._auto else self.batch_size_per_gpu)
        return run_in_batches(self, HFMultimodalLM.generate_until, requests, batches, disable_tqdm, "batches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--side", type=int, default=224, help="the images' height and width in pixels")
    parser.add_argument("--without-earlier", action="store_true",
                        help="leave out the earlier loop (its rows are the slowest)")
    args = parser.parse_args()
    fixture = fixtures.build(SPEC)
    processor = ImageTextProcessor(fixture.hf_dir)
    processor.image_processor = transformers.Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2,
                                                                      merge_size=2)
    folder = Path(tempfile.mkdtemp())
    name = "ortmodule_image_batches"
    words = "abcdefghijklmnopqrstuvwxyz"[: args.documents]
    generation = {"until": ["\n"], "max_gen_toks": args.new, "do_sample": False}
    (folder / f"{name}.yaml").write_text(helpers._IMAGE_TASK.format(name=name, generation=json.dumps(generation)))
    (folder / f"{name}_utils.py").write_text(helpers._IMAGE_TASK_UTILS.format(height=args.side, width=args.side, step=0,
                                                                                words=words))
    tasks = task_manager([name], folder)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cpu")
    ways = (("earlier", EarlierLoop), ("encoded in the loop", EncodedInTheLoop),
            ("by their work", OrtModuleMultimodalLM))
    lms = {(size, way): cls(model, processor=processor, batch_size=size, device="cpu")
           for size in (1, 4, "auto") for way, cls in ways
           if way != "earlier" or (size != "auto" and not args.without_earlier)}

    clock = [0.0]  # seconds inside the backend's generate_until calls

    def timed(method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                clock[0] += time.perf_counter() - start
        return call

    for lm in lms.values():
        lm.generate_until = timed(lm.generate_until)

    def run(lm, limit=None):
        result = lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=tasks, log_samples=True, limit=limit,
                                         verbosity="ERROR")
        return [s["resps"][0][0] for s in sorted(result["samples"][name], key=lambda s: s["doc_id"])]

    run(lms[1, "by their work"], limit=2)  # warm-up
    times, answers = {}, {}
    for _ in range(args.rounds):
        for key, lm in lms.items():
            clock[0] = 0.0
            answers[key] = run(lm)
            times.setdefault(key, []).append(clock[0])
    first = next(iter(lms))
    one = answers[first]
    print(f"{args.documents} prompts of a {args.side} x {args.side} image, {args.new} new tokens at most; median of "
          f"{args.rounds} rounds (seconds in the backend's generate_until); the answers at batch size 1, "
          f"{first[1]} (random weights): {one}")
    for key in lms:
        print(f"  batch_size {key[0]}, {key[1]}: {statistics.median(times[key]):.2f} s; answers as the first: "
              f"{sum(a == b for a, b in zip(answers[key], one))} of {len(one)}")


if __name__ == "__main__":
    main()
