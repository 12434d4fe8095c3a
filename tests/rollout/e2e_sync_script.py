"""Run by test_e2e_distributed.py under `deepspeed --num_gpus 2`: a ZeRO-3 reference engine streams
its weights into a rank-0 vLLM engine (multiprocess), prompts from both ranks are generated there,
and rank 0 checks vLLM's greedy logprobs against an HF model holding the same weights.

argv: <model dir (engine weights)> <model dir (vLLM's start checkpoint)>. Prints ROLLOUT_E2E_OK.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(trained_path: str, start_path: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.rollout.helpers import load_hf, max_logprob_diff
    from verl_ds.config import RolloutConfig
    from verl_ds.precision import PrecisionConfig, read_ds_json, render_role
    from verl_ds.roles.dist import init_distributed, rank, world_size
    from verl_ds.roles.params import iter_full_params
    from verl_ds.roles.policy import Reference, load_causal_lm
    from verl_ds.rollout import generate_distributed, make_rollout, sync_distributed

    init_distributed()
    r, w = rank(), world_size()
    assert w == 2, w
    ds = render_role("reference", read_ds_json("ref_zero3.json", "x"), "ref_zero3.json",
                     PrecisionConfig(reference_dtype="fp32"), device="cpu", micro_batch_size=4,
                     train_batch_size=4 * w, world_size=w, max_grad_norm=1.0, optimizer_params=None)
    ref = Reference(load_causal_lm(trained_path), ds)
    assert any(hasattr(p, "ds_id") for p in ref.engine.module.parameters()), "not ZeRO-3"

    cfg = RolloutConfig(engine="vllm", per_rank=False, multiprocess=True, kv_cache_gb=0.05, max_model_len=128)
    rollout = make_rollout(cfg, start_path, "fp32", rank=r, world_size=w, seed=0)
    assert (rollout is not None) == (r == 0)
    metrics = sync_distributed(rollout, iter_full_params(ref.engine))
    print(f"[rank {r}] sync metrics {metrics}", flush=True)

    local = [[1, 5 + r, 6, 17], [1, 9, 8 + r, 17, 4, 4]] if r == 0 else [[1, 12, 13, 17]]
    batch = generate_distributed(rollout, local, n=2, temperature=0.0, top_p=1.0, max_new_tokens=8, seed=0)
    assert len(batch) == 2 * len(local), (r, len(batch))
    assert batch.group_ids.tolist() == [i for i in range(len(local)) for _ in range(2)]
    assert batch.to_lists()["prompts"][::2] == local, (r, batch.to_lists()["prompts"])

    # every rank checks its own samples against the trained weights (rank 1's came via scatter)
    diff = max_logprob_diff(load_hf(trained_path), batch, temperature=0.0)
    stale = max_logprob_diff(load_hf(start_path), batch, temperature=0.0)
    print(f"[rank {r}] max |dlogprob| vLLM(synced from ZeRO-3) vs HF = {diff:.2e} (vs start weights {stale:.2e})",
          flush=True)
    assert diff <= 1e-4 and stale > 1e-2, (diff, stale)
    dist.barrier()
    if rollout is not None:
        rollout.shutdown()
    if r == 0:
        print("ROLLOUT_E2E_OK", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(1)


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])   # the launcher adds it
