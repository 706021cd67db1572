"""Train the demo's tiny model: a 0.4M-parameter Llama that answers "what is A plus B?" for A, B
in zero..ten, the questions of ortmodule's shipped arithmetic tasks.

It learns the whole addition table (121 sums, the tasks' 40 questions among them) by heart, in
about a minute on two CPU cores; the demo's accuracy therefore shows a model that knows its
answers scored the same way by two backends, not generalisation. The weights ship in
examples/arithmetic_model/ (safetensors, ~1.7 MB); this script rebuilds them bit for bit on the
same torch build.

Run: python examples/train_arithmetic.py [out_dir]
"""

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
OUT = Path(__file__).parent / "arithmetic_model"


def examples() -> list[str]:
    """Every sum in the tasks' prompt format, answered the way their targets are written."""
    return [f"Question: what is {a} plus {b}?\nAnswer: {i + j}\n" for i, a in enumerate(NUMBERS) for j,
            b in enumerate(NUMBERS)]


def main(out: Path = OUT, steps: int = 600) -> None:
    torch.manual_seed(0)
    tokenizer = fixtures.train_tokenizer()
    config = LlamaConfig(
        vocab_size=fixtures.TOKENIZER_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )
    model = LlamaForCausalLM(config)
    batch = tokenizer(examples(), return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    model.train()
    for step in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    model.eval()
    model.save_pretrained(out)
    tokenizer.model_max_length = 256
    tokenizer.save_pretrained(out)
    print(f"saved to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
