"""The training loop: the only layer that knows every role."""


def train(cfg, reward_fn=None, exiting: bool = False) -> dict:
    """Train to `trainer.steps`, then close; `exiting` (the CLI): the process ends right after."""
    from verl_ds.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer(cfg, reward_fn=reward_fn)
    try:
        metrics = trainer.fit()
    except BaseException:
        trainer.close()
        raise
    trainer.close(exiting=exiting)
    return metrics
