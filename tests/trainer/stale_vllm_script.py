"""A weight that never reaches the vLLM engine stops the run at the next step's sync check, before it
trains. Run by test_sync_probe.py in a process of its own (an in-process vLLM engine destroys the
default process group at shutdown). Prints one `RESULT {json}` line."""

import json
import sys

import verl_ds.trainer.rl_trainer as rl_trainer
from tests.trainer.test_sync_probe import VLLM_JOB
from verl_ds.config import load_config
from verl_ds.errors import RunFailure


def main(run_dir: str, part: str) -> None:
    cfg = load_config(None, [*VLLM_JOB, "rollout.engine=vllm", "rollout.block_size=32", f"trainer.run_dir={run_dir}"])
    out = {"line": None}
    with rl_trainer.RLTrainer(cfg) as trainer:
        real = rl_trainer.iter_full_params
        initial = {n: t.clone() for n, t in real(trainer.actor.engine) if part in n}
        rl_trainer.iter_full_params = lambda e: ((n, initial.get(n, t)) for n, t in real(e))
        out["engine"], out["check"] = type(trainer.rollout).__name__, trainer.setup.sync_check
        trainer.step()  # its sync sends the stale weight (vLLM's read-back cannot see a fused projection)
        steps = trainer.actor.engine.global_steps
        try:
            trainer.step()
        except RunFailure as e:
            out["line"] = str(e)
        out["optimizer_stepped"] = trainer.actor.engine.global_steps != steps
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
