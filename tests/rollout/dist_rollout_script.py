"""Run by test_e2e_distributed.py under `deepspeed --num_gpus 2`: a ZeRO-3 reference engine streams
its weights into the in-process vLLM engine of every rank (external_launcher, TP = argv tp).

argv: <tp> <model dir (engine weights)> <model dir (vLLM's start checkpoint)> <out dir>.
Each rank writes <out>/rank<r>.json (its samples and measurements); rank 0 prints ROLLOUT_E2E_OK.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PROMPTS = {0: [[1, 5, 6, 17], [1, 9, 8, 17, 4, 4]], 1: [[1, 12, 13, 17], [1, 7, 7, 17]]}
SAMPLE = dict(n=4, temperature=1.0, top_p=1.0, max_new_tokens=8)


def main(tp: int, trained_path: str, start_path: str, out_dir: str) -> None:
    import psutil
    import torch.distributed as dist

    from tests.rollout.helpers import hf_response_logprobs, load_hf, max_logprob_diff
    from verl_ds.config import RolloutConfig, read_ds_json
    from verl_ds.dist import init_distributed, rank, world_size
    from verl_ds.ds_config import render_role
    from verl_ds.precision import Hardware, PrecisionConfig, resolve_precision
    from verl_ds.roles.ds_internals import is_zero3
    from verl_ds.roles.params import iter_full_params
    from verl_ds.roles.policy import Reference, load_causal_lm
    from verl_ds.rollout import generate_distributed, make_rollout, sync_distributed

    init_distributed()
    r, w = rank(), world_size()
    assert w == 2, w
    fp32 = resolve_precision(PrecisionConfig(reference_dtype="fp32"), Hardware("cpu"))
    ds = render_role(
        "reference",
        read_ds_json("ref_zero3.json", "x"),
        "ref_zero3.json",
        fp32,
        micro_batch_size=4,
        train_batch_size=4 * w,
        world_size=w,
        max_grad_norm=1.0,
        optimizer_params=None,
    )
    ref = Reference(load_causal_lm(trained_path), ds)
    assert is_zero3(ref.engine.module), "not ZeRO-3"

    cfg = RolloutConfig(engine="vllm", tensor_parallel_size=tp, kv_cache_gb=0.05, max_model_len=128)
    rollout = make_rollout(cfg, start_path, "fp32", seed=0)
    report = {"start_s": rollout.start_s}
    hf_new, hf_old = load_hf(trained_path), load_hf(start_path)
    # several syncs from ZeRO-3, each checked against HF holding the same weights
    diffs = []
    for _ in range(3):
        sync_distributed(rollout, iter_full_params(ref.engine))
        greedy = generate_distributed(
            rollout, PROMPTS[r], n=2, temperature=0.0, top_p=1.0, max_new_tokens=8, run_seed=0, step=0
        )
        assert greedy.to_lists()["prompts"][::2] == PROMPTS[r], (r, greedy.to_lists()["prompts"])
        diffs.append(max_logprob_diff(hf_new, greedy, temperature=0.0))
    report["max_dlogprob"] = max(diffs)
    report["stale_dlogprob"] = max_logprob_diff(hf_old, greedy, temperature=0.0)
    # sampled: two steps of this rank's prompts (compared with a standalone engine by the test)
    report["samples"] = {
        step: generate_distributed(rollout, PROMPTS[r], **SAMPLE, run_seed=0, step=step).to_lists()["responses"]
        for step in (0, 1)
    }
    # independence: one prompt repeated 8 times in a step, over two steps
    repeated = [
        generate_distributed(rollout, [PROMPTS[0][0]] * 8, **SAMPLE, run_seed=0, step=step).to_lists()["responses"]
        for step in (2, 3)
    ]
    report["repeated"] = [x for step in repeated for x in step]
    # multi-turn: rank 0's episodes run 3 turns, rank 1's one; under TP=2 rank 1 keeps generating with
    # its group until rank 0 is done. The model's tokens' logprobs match HF on the interleaved rows.
    from tests.rollout.test_episodes import Nag
    from verl_ds.data.chat import ChatCodec
    from verl_ds.data.tiny import load_tokenizer
    from verl_ds.rollout.episodes import EpisodeSpec, Sampling, SeedKey, TurnLimits, collect

    codec = ChatCodec(load_tokenizer(trained_path), False)
    turns = 3 if r == 0 else 1
    ro = collect(
        rollout,
        [{"prompt": "", "answer": ""}] * 2,
        PROMPTS[r],
        Sampling(2, 1.0, 1.0, 4),
        SeedKey(0, 9),
        EpisodeSpec(lambda: Nag("#", turns), codec, TurnLimits(3, 0, 0, 128)),
    )
    worst = 0.0
    for row in range(len(ro.batch)):
        n = int(ro.batch.response_mask[row].sum())
        p = ro.batch.to_lists()["prompts"][row]
        ids = ro.batch.response_ids[row, :n].tolist()
        want = hf_response_logprobs(hf_new, p, ids)
        model = ro.batch.loss_mask[row, :n].bool()
        worst = max(worst, float((want - ro.batch.rollout_logprobs[row, :n])[model].abs().max()))
    report["multi_turn"] = {"turns": ro.metrics["multi_turn/turns/mean"], "max_dlogprob": worst}
    # 500 syncs: memory stays flat (RSS after 50 warm-up syncs vs after 500)
    proc = psutil.Process()
    for i in range(500):
        sync_distributed(rollout, iter_full_params(ref.engine))
        if i == 49:
            report["rss_50"] = proc.memory_info().rss
    report["rss_500"] = proc.memory_info().rss
    final = generate_distributed(
        rollout, PROMPTS[r], n=1, temperature=0.0, top_p=1.0, max_new_tokens=8, run_seed=0, step=0
    )
    report["max_dlogprob_after_500"] = max_logprob_diff(hf_new, final, temperature=0.0)
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as fh:
        json.dump(report, fh)
    dist.barrier()
    if r == 0:
        print("ROLLOUT_E2E_OK", flush=True)
    os._exit(0)  # skip vLLM's teardown of the process group under the launcher


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
    main(int(args[0]), *args[1:])
