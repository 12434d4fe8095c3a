"""Programs that drive the training loop to measure it (`verl-ds bench …`, `verl-ds debug …`): above
the trainer, so they build `RLTrainer` themselves; the library they report with is `diagnostics/`."""
