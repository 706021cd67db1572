"""lm-eval's tokenizing before the first batch (one wave, the CPU's choice) against wave by wave
beside the model's work (CUDA's choice, `OrtModuleLM._first_wave`), on benchmarks/test_host_time.py's
workload: MMLU-shaped requests on a model of negligible compute with SmolLM2's tokenizer, batch 32,
sharing off. Per run: the time from the `loglikelihood` call to the first prefill (how long a
device would wait for its first batch) and the call's time per request; the two settings alternate.
Each setting with the texts encoded in parts (a question's prompt once for its four letters,
`encoding.encode_pairs_as_tok_encode`, what ortmodule does) and whole (each text of lm-eval's
`_encode_pair` in full, as before). Then the rolling workload's documents (`--documents` of them)
encoded one by one, as HFLM's `loglikelihood_rolling` does, and batched on every core, as
ortmodule's does (best of 3 each, in turns). Last, the encoding alone of the MMLU-, HellaSwag- and
ARC-shaped texts, whole and in parts (medians of 9, in turns).

`--emulated-device-us-per-token X` (synthetic, labelled so in its output): every prefill is a sleep of
X us per token instead of ONNX Runtime's run (its answers meaningless), a device that computes while
the host's cores are free, as beside a GPU, so that the overlap shows on a CPU.

    python benchmarks/tokenize_ahead.py [--questions 250] [--rounds 3] [--documents 50] [--device cpu]
        [--emulated-device-us-per-token 3.6]
"""

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as lm-eval's command line sets it

import lm_eval  # noqa: E402
import torch  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from test_host_time import HOST_PROBE, TASK  # noqa: E402

import ortmodule.lm_eval  # noqa: E402, F401  (registers the backend)
from ortmodule.costs import _best_times  # noqa: E402
from ortmodule.decoder import Decoder  # noqa: E402
from ortmodule.encoding import texts_to_encode  # noqa: E402
from ortmodule_dev import fixtures  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--documents", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--emulated-device-us-per-token", type=float)
    args = parser.parse_args()
    probe = fixtures.build(HOST_PROBE)
    tasks = TaskManager(include_path=str(Path(__file__).parent / "tasks"), include_defaults=False,
                        metadata={"tokenizer": str(probe.hf_dir)})
    lm = get_model("ortmodule")(pretrained=str(probe.package_dir), device=args.device, batch_size=32,
                                share_contexts="false", prefill_chunk=0)
    lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=tasks, limit=2, verbosity="ERROR")  # warm-up

    first_run, prefill, emulated = [], Decoder.prefill, args.emulated_device_us_per_token

    def recording(self, rows, logit_index=None, cache=None):
        first_run.append(time.perf_counter())
        if emulated is None:
            return prefill(self, rows, logit_index, cache)
        time.sleep(emulated * 1e-6 * rows.ids.numel())
        return torch.zeros(len(logit_index), self.vocab_size)

    Decoder.prefill = recording
    call = lm.loglikelihood
    if emulated is not None:
        print(f"synthetic: each prefill a sleep of {emulated} us a token, no ONNX Runtime", flush=True)

    def timed(requests, *a, **k):
        first_run.clear()
        start = time.perf_counter()
        answers = call(requests, *a, **k)
        seconds = time.perf_counter() - start
        print(f"{'one wave' if lm._first_wave is None else f'waves from {lm._first_wave}':>16}, {encoded[0]:>8}: "
              f"first prefill after {1e3 * (first_run[0] - start):5.0f} ms, "
              f"{1e6 * seconds / len(requests):5.0f} us a request ({len(requests)} requests)", flush=True)
        return answers

    lm.loglikelihood = timed
    in_parts = lm._encode_pairs
    encodings = {"in parts": in_parts, "whole": lambda pairs: lm._encode_batched(texts_to_encode(pairs))}
    encoded = ["in parts"]
    for _ in range(args.rounds):
        for first in (None, 256):
            for name, encode in encodings.items():
                lm._first_wave, lm._encode_pairs, encoded[0] = first, encode, name
                lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=tasks, limit=args.questions,
                                        verbosity="ERROR")
    lm._encode_pairs = in_parts

    rolling = next(iter(tasks.load_task_or_group(["ortmodule_bench_rolling"]).values()))
    rolling.build_all_requests(limit=args.documents, rank=0, world_size=1)
    documents = [instance.args[0] for instance in rolling.instances]
    host = torch.device("cpu")  # tokenizing: host work only
    one_by_one, batched = _best_times([lambda: [HFLM.tok_encode(lm, document) for document in documents],
                                       lambda: lm._encode_batched(documents)], host)
    tokens = sum(len(ids) for ids in lm._encode_batched(documents).values())
    print(f"{len(documents)} rolling documents, {tokens} tokens: one by one {one_by_one:.3f} s, "
          f"batched on {len(os.sched_getaffinity(0))} cores {batched:.3f} s")
    encoding_in_parts(lm, tasks)


def encoding_in_parts(lm, tasks, rounds: int = 9) -> None:
    """The encoding alone of the MMLU-, HellaSwag- and ARC-shaped workloads' texts (`_encode_pair`'s),
    whole and in parts (a context's tokens once for all its continuations), in turns: medians."""
    for name, questions in (("ortmodule_bench_mmlu", 250), ("ortmodule_bench_hellaswag", 1000),
                            ("ortmodule_bench_arc", 1000)):
        task = next(iter(tasks.load([name])["tasks"].values()))
        docs = list(task.test_docs() if task.has_test_docs() else task.validation_docs())[:questions]
        pairs = [(task.doc_to_text(doc), task.config.target_delimiter + choice)
                 for doc in docs for choice in task.doc_to_choice(doc)]
        times = {"whole": [], "in parts": []}
        for _ in range(rounds):
            for way in times:
                start = time.perf_counter()
                lm._encode_batched(texts_to_encode(pairs)) if way == "whole" else lm._encode_pairs(pairs)
                times[way].append(time.perf_counter() - start)
        tokens = sum(len(ids) for ids in lm._encode_batched(texts_to_encode(pairs)).values())
        print(f"{name}: {len(pairs)} requests ({tokens} tokens encoded whole): whole "
              f"{sorted(times['whole'])[rounds // 2]:.3f} s, in parts {sorted(times['in parts'])[rounds // 2]:.3f} s "
              f"(medians of {rounds})", flush=True)


if __name__ == "__main__":
    main()
