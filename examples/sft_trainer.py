"""Supervised fine-tuning on DeepSpeed with familiar knobs (fp16 + dynamic loss scaling here).

.venv/bin/python examples/sft_trainer.py
"""

from verl_ds import Trainer
from verl_ds.data.tasks import arithmetic_examples
from verl_ds.data.tiny import build_tiny_llama

if __name__ == "__main__":
    model_dir = build_tiny_llama("runs/sft_example/init")
    data = [{"prompt": e["prompt"], "completion": e["answer"]} for e in arithmetic_examples(512, seed=0)]
    trainer = Trainer(
        str(model_dir),
        strategy="zero2",
        precision="fp16",
        grad_scaler=True,
        max_grad_norm=1.0,
        lr=3e-3,
        micro_batch_size=32,
    )
    losses = trainer.fit(data, epochs=3)
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; skipped steps {trainer.skipped_steps}; "
        f"loss scale {trainer.precision_stats()['loss_scale']:g}"
    )
    trainer.save("runs/sft_example/final")
