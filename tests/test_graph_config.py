"""`model.config` of a package without its checkpoint's config.json (the model builder writes none): the fields
its graph states (graph_config.py) against transformers' config of the checkpoint it was exported from, and
trl's fused LM head, which reads Granite's `logits_scaling` from the config, on such a package."""

import struct

import pytest
import torch

from ortmodule import OrtModelForCausalLM
from ortmodule.graph_config import transformers_type

# The fields graph_config.py reads, where the config class has them.
FIELDS = ["model_type", "architectures", "intermediate_size", "rms_norm_eps", "layer_norm_eps", "norm_eps",
          "tie_word_embeddings", "sliding_window", "layer_types", "logits_scaling", "final_logit_softcapping",
          "attn_logit_softcapping", "query_pre_attn_scalar", "attention_multiplier", "embedding_multiplier",
          "residual_multiplier", "num_experts_per_tok", "num_local_experts", "num_experts", "moe_intermediate_size",
          "num_dense_layers", "rope_parameters", "hidden_act", "hidden_activation"]
# The fixtures' fields beyond the defaults (tests/test_architectures.py's: Nemotron's partial rotary needs wider heads).
SPECS = {"nemotron": dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)}
# Where the package differs from its checkpoint's config, by what the package computes: the builder's
# Nemotron norms take 1e-6 whatever the checkpoint's `norm_eps`; a 4-bit head beside a float table does not
# tell whether the checkpoint tied them (the class's default stays); the fixture checkpoints have no
# `architectures` where they were written without one.
DIFFERS = {"nemotron": {"norm_eps"}}


def as_float32(value):
    if isinstance(value, float):
        return struct.unpack("f", struct.pack("f", value))[0]
    return value


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "gemma", "gemma2", "gemma3", "phi3", "mistral",
                                  "granite", "lfm2", "lfm2_moe", "gpt_oss", "ernie4_5", "hunyuan", "olmo",
                                  "nemotron", "qwen3_5"])
def test_a_packages_config_states_its_checkpoints_fields(build, arch):
    """Each field of `FIELDS` that transformers' config of the checkpoint has, in the package's config as the
    checkpoint's (norm epsilons as the float32 the graph holds); before graph_config.py most were the config
    class's defaults (Granite's `logits_scaling` 1.0 for 8.0, Gemma 3's every layer sliding, LFM2's every
    layer attention, the MLP widths of the class's largest model) and gpt-oss's config had no model type."""
    from transformers import AutoConfig

    fixture = build(arch, **SPECS.get(arch, {}))
    assert not (fixture.package_dir / "config.json").exists()  # the builder's package, as it wrote it
    ours = OrtModelForCausalLM.from_pretrained(fixture.package_dir).config.get_text_config()
    theirs = AutoConfig.from_pretrained(fixture.hf_dir).get_text_config()
    checked = [name for name in FIELDS if hasattr(theirs, name) and name not in DIFFERS.get(arch, ())]
    if getattr(theirs, "architectures", None) is None:
        checked.remove("architectures")
    if getattr(theirs, "block_auto_adjust_ff_dim", False):  # LFM2: the width its module makes from the field
        from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

        checked.remove("intermediate_size")
        assert Lfm2MLP(ours).w1.out_features == Lfm2MLP(theirs).w1.out_features
    for name in checked:
        assert as_float32(getattr(ours, name)) == as_float32(getattr(theirs, name)), name
    assert len(checked) >= 4


def test_the_builders_model_types_are_transformers():
    """genai_config's `model.type` is the architecture's class name before "For", lower-cased."""
    assert transformers_type("gptoss") == ("gpt_oss", "GptOssForCausalLM")
    assert transformers_type("hunyuandensev1") == ("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM")
    assert transformers_type("gemma3_text") == ("gemma3_text", "Gemma3ForCausalLM")
    assert transformers_type("no_such_model") == ("no_such_model", None)


def test_a_4bit_heads_tie_is_left_to_the_class(build):
    """A 4-bit LM head beside a float embedding table: whether the checkpoint tied them is not in the graph."""
    fixture = build("llama", precision="int4")
    config = OrtModelForCausalLM.from_pretrained(fixture.package_dir).config
    assert config.tie_word_embeddings is type(config)().tie_word_embeddings
    assert config.intermediate_size == fixture.spec.intermediate_size  # MatMulNBits' K


@pytest.mark.parametrize("arch", ["granite", "gemma2", "llama"])
def test_trls_fused_lm_head_on_a_package_equals_transformers(build, arch):
    """trl's fused LM head (DPO's and KTO's reference model, distillation's teacher) projects the backbone's last
    hidden state with `get_output_embeddings()` and scales or caps it as the config says: on Granite's package
    the config's `logits_scaling` had been 1.0 for the checkpoint's 8.0, and every log-probability was
    wrong (by up to 2.7 on this fixture)."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    fixture = build(arch)  # models of their own, not load_pair's shared ones: trl patches their forward
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[0, :3] = -100
    got = []
    for each in (model, hf):
        add_fused_lm_head(each)
        with torch.no_grad():
            got.append(each(input_ids=ids, labels=labels, fused_lm_head=True).log_probs)
    torch.testing.assert_close(got[0], got[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_head_written_apart_from_its_table_is_told_by_their_rows(build, tmp_path, tied):
    """The builder writes a tied checkpoint's table and head apart unless told to share them: the config says
    tied where the table's rows are the head's columns (a few across the vocabulary), untied where one differs."""
    import shutil

    import onnx_ir as ir

    fixture = build("llama", tie_word_embeddings=True)
    package = tmp_path / "package"
    shutil.copytree(fixture.package_dir, package)
    model = ir.load(package / "model.onnx")
    gather = next(n for n in model.graph if n.op_type == "Gather" and n.name == "/model/embed_tokens/Gather")
    transpose = gather.inputs[0].producer()
    assert transpose is not None and transpose.op_type == "Transpose"  # shared, as the fixture's export wrote it
    rows = transpose.inputs[0].const_value.numpy().T.copy()
    if not tied:
        rows[len(rows) // 2, 0] += 1.0
    table = ir.Value(name="model.embed_tokens.weight", const_value=ir.tensor(rows))
    model.graph.initializers.add(table)
    gather.replace_input_with(0, table)
    model.graph.remove(transpose, safe=True)
    ir.save(model, package / "model.onnx", external_data="model.onnx.data")
    assert OrtModelForCausalLM.from_pretrained(package).config.tie_word_embeddings is tied


def test_a_graph_whose_fields_cannot_be_read_keeps_the_class_defaults(build, monkeypatch, caplog):
    """A graph of a form graph_config.py did not foresee: the package loads, with a warning naming why, and the
    config class's defaults where its fields would be."""
    import logging

    from ortmodule import graph_config

    def fails(package, has):
        raise KeyError("epsilon")

    monkeypatch.setattr(graph_config, "graph_fields", fails)
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        config = OrtModelForCausalLM.from_pretrained(build("granite").package_dir).config
    assert config.logits_scaling == 1.0 and "were not read (KeyError: 'epsilon')" in caplog.text


def rotary_tables(parameters: dict, head: int, dtype: torch.dtype, positions: int = 512):
    """The cos and sin tables the model builder writes for a rotary: transformers' own frequencies (and
    attention factor) for `parameters`, as its modules compute them."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=4 * head, num_attention_heads=4, head_dim=head, max_position_embeddings=4096,
                         rope_parameters=parameters)
    kind = parameters["rope_type"]
    if kind == "default":  # (its default function reads the share of the head from the config alone)
        dim = int(head * parameters.get("partial_rotary_factor", 1.0))
        frequencies, factor = 1.0 / parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim), 1.0
    else:
        frequencies, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    angles = torch.outer(torch.arange(positions).float(), frequencies)
    return ((angles.cos() * factor).to(dtype).double(), (angles.sin() * factor).to(dtype).double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_plain_rotarys_base_is_read_from_its_tables_in_every_precision(dtype):
    """A plain rotary's base from its tables, whatever the base and the head: exactly from float32 tables (as the
    builder writes them for float32 packages), within 0.1% from half-precision ones."""
    from ortmodule.graph_config import _plain_rotary, _rounded

    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for base in (10000.0, 12345.0, 75000.0, 500000.0, 1e6, 5e6, 1e9):
        for head in (16, 64, 128, 256):
            found = _plain_rotary(*rotary_tables({"rope_type": "default", "rope_theta": base}, head, dtype), tolerance)
            assert found is not None, (base, head)
            if dtype == torch.float32:
                assert _rounded(found, tolerance / 10) == base, (base, head)
            else:
                assert abs(found - base) <= 1e-3 * base, (base, head, found)


@pytest.mark.parametrize("parameters", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.5] * 32, "long_factor": [2.0] * 32,
     "original_max_position_embeddings": 1024},
], ids=lambda parameters: parameters["rope_type"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scaled_rotarys_tables_are_not_taken_for_a_plain_one(parameters, dtype):
    """Llama 3's, linear, YaRN's and LongRoPE's tables are another curve (or scaled): no base is read from them,
    where a plain rotary's would be a wrong one."""
    from ortmodule.graph_config import _plain_rotary

    assert _plain_rotary(*rotary_tables(parameters, 64, dtype), 1e-5 if dtype == torch.float32 else 1e-2) is None


def test_the_rotary_of_a_package_is_its_checkpoints(build, caplog):
    """A package's `rope_parameters`: the real SmolLM2's base (100,000; Llama's class default is 10,000), a
    fixture's of another base and Gemma 3's, one base for its sliding layers and one for the others, as their
    checkpoints; a Llama 3 rotary's tables (scaled) leave the class's default, and say so in ortmodule's log."""
    import logging

    from transformers import AutoConfig

    from ortmodule_dev import fixtures

    plain = build("llama", rope=(("rope_type", "default"), ("rope_theta", 500000.0)))
    by_kind = build("gemma3", rope=(("sliding_attention", (("rope_type", "default"), ("rope_theta", 20000.0))),
                                    ("full_attention", (("rope_type", "default"), ("rope_theta", 300000.0)))))
    for fixture in (fixtures.build(fixtures.SMOLLM2), plain, by_kind):
        ours = OrtModelForCausalLM.from_pretrained(fixture.package_dir).config
        assert ours.rope_parameters == AutoConfig.from_pretrained(fixture.hf_dir).rope_parameters
        assert ours.rope_parameters != type(ours)().rope_parameters
    scaled = build("llama", rope=(("rope_type", "llama3"), ("rope_theta", 500000.0), ("factor", 8.0),
                                  ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                                  ("original_max_position_embeddings", 64)))
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        ours = OrtModelForCausalLM.from_pretrained(scaled.package_dir).config
    assert ours.rope_parameters == type(ours)().rope_parameters
    assert "rotary" in caplog.text and "rope_parameters" in caplog.text


@pytest.mark.parametrize("activation", ["gelu", "relu", "gelu_pytorch_tanh"])
def test_the_activation_of_a_package_is_its_checkpoints(build, activation):
    """A Llama checkpoint of another activation than Llama's SiLU: the package's config names the checkpoint's."""
    from transformers import AutoConfig

    fixture = build("llama", hidden_act=activation)
    ours = OrtModelForCausalLM.from_pretrained(fixture.package_dir).config
    assert ours.hidden_act == AutoConfig.from_pretrained(fixture.hf_dir).hidden_act == activation
