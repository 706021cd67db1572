"""Two more ways users score an ONNX GenAI package today, as lm-eval models so that they run the
benchmark's task with lm-eval's own tokenization and bookkeeping (the base of lm-eval's ONNX
backends, `_ONNXLMBase`):

- `genai-stepped`: onnxruntime-genai's Generator fed the context, then stepped one continuation
  token at a time, each step's logits read back with `get_logits()` (the seeds' ortgenai evaluator).
- `ort-numpy`: a raw InferenceSession fed numpy, returning the full `[1, T, vocab]` logits to
  numpy (the seeds' direct-ORT evaluator).

Both count the bytes of logits ONNX Runtime hands back to Python (`host_bytes`): on a GPU, the
device-to-host copy each request pays.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from lm_eval.api.registry import register_model
from lm_eval.models._onnx_base import _log_softmax, _ONNXLMBase
from lm_eval.models.onnxruntime_genai import ONNXRuntimeGenAILM

from ortmodule import read_package, runtime


@register_model("genai-stepped")
class GenaiSteppedLM(ONNXRuntimeGenAILM):
    host_bytes = 0

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        results = []
        for cache_key, context, continuation in requests:
            full = (context + continuation)[-self.max_length :]
            count = min(len(continuation), len(full) - 1)
            split = len(full) - count
            params = self.og.GeneratorParams(self.model)
            params.set_search_options(max_length=len(full), do_sample=False)
            generator = self.og.Generator(self.model, params)
            generator.append_tokens(np.asarray(full[:split], dtype=np.int32))
            total, greedy = 0.0, True
            for i, target in enumerate(full[split:]):
                logits = np.asarray(generator.get_logits(), dtype=np.float32).reshape(-1)
                type(self).host_bytes += logits.nbytes
                log_probs = _log_softmax(logits[None, :])[0]
                total += float(log_probs[target])
                greedy = greedy and int(log_probs.argmax()) == target
                if i + 1 < count:
                    generator.append_tokens(np.asarray([target], dtype=np.int32))
            results.append((total, greedy))
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, (total, greedy))
        return results


@register_model("ort-numpy")
class OrtNumpyLM(_ONNXLMBase):
    host_bytes = 0

    def _load(self) -> None:
        self.package = read_package(self.model_dir)
        providers = ["CPUExecutionProvider"]
        if self.execution_provider == "cuda":
            providers.insert(0, "CUDAExecutionProvider")
        self.session = ort.InferenceSession(str(self.package.decoder.path), providers=providers)

    def _forward_logits(self, tokens: list[int]) -> np.ndarray:
        decoder = self.package.decoder
        kv_dtype = np.dtype(str(runtime.torch_dtype(decoder.kv_type)).removeprefix("torch."))
        feeds = {decoder.input_ids: np.asarray([tokens], dtype=np.int64)}
        if decoder.attention_mask:
            feeds[decoder.attention_mask] = np.ones((1, len(tokens)), dtype=np.int64)
        if decoder.position_ids:
            feeds[decoder.position_ids] = np.arange(len(tokens), dtype=np.int64)[None, :]
        for kv in decoder.layers:
            empty = np.zeros((1, kv.num_kv_heads, 0, kv.head_size), dtype=kv_dtype)
            feeds[kv.past_key] = feeds[kv.past_value] = empty
        logits = self.session.run([decoder.logits], feeds)[0]
        type(self).host_bytes += logits.nbytes
        return logits[0].astype(np.float32)

    def _generate(self, tokens, gen_kwargs):
        raise NotImplementedError("ort-numpy scores only")
