"""The training loop: the only layer that knows every role."""


def train(cfg, reward_fn=None, exiting: bool = False) -> dict:
    """Train to `trainer.steps`, then close; `exiting` (the CLI): the process ends right after."""
    from verl_ds.dist import barrier
    from verl_ds.trainer.rl_trainer import RLTrainer

    if cfg.trainer.rollout_ranks:  # the last ranks only generate (trainer/rollout_rank.py)
        from verl_ds.dist import bridge, init_distributed, is_rollout_rank
        from verl_ds.trainer.rollout_rank import serve

        init_distributed(cfg.trainer.collective_timeout_s, cfg.trainer.rollout_ranks)
        if is_rollout_rank():
            serve(cfg, bridge())
            return {}

    with RLTrainer(cfg, reward_fn=reward_fn) as trainer:
        metrics = trainer.fit()
        trainer.close(exiting=exiting)  # after an error, __exit__ closes in full
    if exiting:
        barrier()  # the ranks end together, so the launcher sees them all done in one look
    return metrics
