"""benchmarks/attention_rewrite.py, the GPU experiment's graph (GroupQueryAttention rewritten into
norms, rotary and ONNX's `Attention`): on the CPU the rewritten packages give the original
packages' logits at every real position of a right-padded batch, with packed projections (Llama)
and unpacked ones after Qwen3's query/key norms. (A CUDA export's norms fused into the attention
node need CUDA's kernels: graph_options.py checks that variant against transformers on the GPU.)"""

import importlib.util
from pathlib import Path

import onnx
import pytest
from helpers import right_padded_batch

from ortmodule import OrtModelForCausalLM

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "attention_rewrite.py"
spec = importlib.util.spec_from_file_location("attention_rewrite", SCRIPT)
attention_rewrite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(attention_rewrite)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # packed QKV; unpacked with norms before attention
def test_rewritten_prefill_gives_the_same_logits(build, arch, tmp_path):
    fixture = build(arch)
    count = attention_rewrite.rewrite_package(fixture.package_dir, tmp_path / "package")
    graph = onnx.load(str(tmp_path / "package" / "model.onnx"), load_external_data=False).graph
    ops = {node.op_type for node in graph.node}
    assert count > 0 and "GroupQueryAttention" not in ops and "Attention" in ops
    original = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=0)
    rewritten = OrtModelForCausalLM.from_pretrained(tmp_path / "package", prefill_chunk=0)
    ids, mask = right_padded_batch([24, 15, 6], seed=7)
    expected = original(ids, attention_mask=mask).logits
    got = rewritten(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (got - expected)[real].abs().max().item() < 1e-4 * expected.abs().max().item()


def test_sliding_windows_are_refused(tmp_path):
    node = onnx.helper.make_node("GroupQueryAttention", ["q", "k", "v"], ["y", "pk", "pv"], domain="com.microsoft",
                                 num_heads=4, kv_num_heads=2, local_window_size=8)
    with pytest.raises(ValueError, match="sliding windows"):
        attention_rewrite._attention_nodes(node, "/rewrite/0", 16)
    graph = onnx.helper.make_graph([], "g", [], [])
    with pytest.raises(ValueError, match="no GroupQueryAttention"):
        attention_rewrite.rewrite_graph(graph, 16)
