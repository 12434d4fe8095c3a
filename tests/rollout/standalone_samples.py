"""A standalone single-process engine sampling the prompts of dist_rollout_script.py with the seeds
the distributed run gives them (global positions). argv: <model dir> <out json>."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(model: str, out: str) -> None:
    from tests.rollout.dist_rollout_script import PROMPTS, SAMPLE
    from verl_ds.rollout import VLLMRollout, prompt_seeds

    engine = VLLMRollout(model, "fp32", kv_cache_gb=0.05, max_model_len=128, seed=0)
    prompts = PROMPTS[0] + PROMPTS[1]
    samples = {
        step: engine.generate(prompts, **SAMPLE, seeds=prompt_seeds(0, step, range(len(prompts)))).to_lists()[
            "responses"
        ]
        for step in (0, 1)
    }
    with open(out, "w") as fh:
        json.dump(samples, fh)
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
