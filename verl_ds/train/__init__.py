"""Entry points users know from other frameworks: `PPOTrainer`, the SFT `Trainer`, `python -m verl_ds.train.ppo`."""
