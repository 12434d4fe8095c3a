"""The GPU memory hand-off's order through real trainer steps with a real in-process vLLM engine.

Run by test_offload.py in a fresh pytest process: an in-process engine destroys the default process
group at shutdown. `sleeps` is set as on a GPU; every call is recorded and then made, to the real
engine: vLLM's own `sleep` / `wake_up` (on CPU its worker frees nothing, but its engine core pauses
the scheduler at sleep and resumes it only once everything is awake again, so a generation or a sync
in the wrong state would show here), generation, the weight sync, and the actor's sleep (forced: a
host-to-host move through DeepSpeed, tests/roles/test_sleep.py).
"""

import itertools

import pytest

from tests.diagnostics.helpers import tiny_overrides
from verl_ds.config import load_config
from verl_ds.trainer.rl_trainer import RLTrainer

VLLM = [
    "rollout.engine=vllm",
    "model.tiny.hidden=64",  # head_dim 32: vLLM's CPU attention rejects 16
    "model.tiny.heads=2",
    "model.tiny.ffn=128",
    "rollout.kv_cache_gb=0.05",
    "data.val_fraction=0.2",  # 5 of the 25 a+b prompts
    "trainer.val_n=2",
    "trainer.val_every=2",
    "roles.actor.zero_stage=3",
    "roles.actor.sleep=true",
]


def record(trainer) -> list[str]:
    """The engine's sleep/wake calls, its generations and sync loads, and the actor's sleeps and wakes
    that moved something, in the order they happen."""
    calls: list[str] = []
    llm, actor = trainer.rollout.llm, trainer.actor
    trainer.rollout.sleeps = True

    def traced(name, fn, note=lambda *a, **k: True):
        def call(*a, **k):
            if note(*a, **k):
                calls.append(name(*a, **k) if callable(name) else name)
            return fn(*a, **k)

        return call

    llm.sleep = traced(lambda level: f"vllm.sleep({level})", llm.sleep)
    llm.wake_up = traced(lambda tags: f"vllm.wake({','.join(tags)})", llm.wake_up)

    llm.generate = traced("generate", llm.generate)
    llm.collective_rpc = traced("load", llm.collective_rpc, lambda method, **k: method == "load_named_tensors")
    actor.sleep = traced("actor.sleep", lambda: type(actor).sleep(actor, force=True))
    actor.wake = traced("actor.wake", actor.wake, lambda: actor.asleep)
    return calls


def test_the_sync_wakes_only_vllms_weights_and_generation_its_kv_cache_after_the_roles_slept(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path) + VLLM)
    with RLTrainer(cfg) as trainer:
        calls = record(trainer)
        trainer.validate()  # as before step 1
        trainer.step()
        trainer.step()  # validates after it (val_every 2)
        order = [k for k, _ in itertools.groupby(calls)]  # a generation or a sync in several calls: one
        assert order == [
            # validation: the next generation comes without a sync, the weights wait on the host
            "generate",
            "vllm.sleep(1)",
            # step 1: the roles have not slept yet
            "vllm.wake(weights)",
            "vllm.wake(kv_cache)",
            "generate",
            "vllm.sleep(2)",  # a sync follows: the weights are discarded
            "vllm.wake(weights)",  # the sync: weights only, the KV cache stays freed
            "load",
            "actor.sleep",
            # step 2: the KV cache comes back after the actor slept
            "vllm.wake(kv_cache)",
            "generate",
            "vllm.sleep(2)",
            "actor.wake",
            "vllm.wake(weights)",
            "load",
            "actor.sleep",
            "vllm.wake(kv_cache)",  # validation
            "generate",
            "vllm.sleep(1)",
        ], order
        # weights discarded at level 2 serve nothing until a sync loads new ones
        trainer.rollout.generate([[1, 4, 5]], max_new_tokens=2)
        trainer.rollout.sleep(level=2)
        with pytest.raises(RuntimeError, match="sync weights before generating"):
            trainer.rollout.generate([[1, 4, 5]], max_new_tokens=2)
