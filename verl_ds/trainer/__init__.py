"""The training loop: the only layer that knows every role."""


def train(cfg, reward_fn=None) -> dict:
    from verl_ds.trainer.rl_trainer import RLTrainer

    with RLTrainer(cfg, reward_fn=reward_fn) as trainer:
        return trainer.fit()
