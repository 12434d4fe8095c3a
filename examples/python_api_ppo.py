"""GRPO from Python: the same trainer `verl-ds train` runs, with a custom reward function.

.venv/bin/python examples/python_api_ppo.py              # one process, CPU
deepspeed --num_gpus 2 examples/python_api_ppo.py         # or under the launcher
"""

from verl_ds import PPOTrainer, PrecisionConfig
from verl_ds.config import DataConfig, ModelConfig


def exact_sum(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer else 0.0


if __name__ == "__main__":
    trainer = PPOTrainer(
        model_config=ModelConfig(path="tiny"),
        data_config=DataConfig(task="arithmetic"),
        precision_config=PrecisionConfig(actor_dtype="auto", rollout_dtype="fp32", buffer_dtype="fp32"),
        algorithm_config={"estimator": "grpo", "ppo_epochs": 2},
        rollout_config={"engine": "vllm", "n": 16, "max_new_tokens": 3},
        roles_config={"actor": {"lr": 5e-4, "micro_batch_size": 64}, "reference": {"micro_batch_size": 64}},
        trainer_config={"steps": 60, "prompts_per_step": 16, "run_dir": "runs/python_api"},
        reward_fn=exact_sum,
    )
    print(trainer.fit())
