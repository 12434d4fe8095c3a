"""The tool demo's rollouts two ways, in one interleaved run: the in-process tool environment
(`rollout.multi_turn.env: tools`) and the same episode written as an OpenAI-client agent against
the token-recording endpoint (`rollout.multi_turn.agent`). Prints episodes/s of each and the ratio.

    source launch/env.sh && python benchmarks/agent_vs_env.py [--rounds 3] [--config ...] [overrides]

Both sides use one engine (vLLM in this process, SmolLM2-135M-Instruct as the demo prepares it),
the job's prompts, sampling and turn limit; the agent sends the job's few-shot demonstration and
the prompt with `tools=[calculator]`, which the endpoint renders as the environment path renders its
prompt (the tools described in the system message), runs the calculator on each tool call and
stops at the first reply without one, as the tool environment does. Only the rollout is timed
(no training step). Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

CONFIG = "examples/grpo_cpu_smollm2_tools.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from verl_ds.config import load_config
    from verl_ds.data.chat import ChatCodec
    from verl_ds.envs import calculator, parse_hermes_tool_calls, tool_schemas
    from verl_ds.rollout import make_rollout
    from verl_ds.rollout.agents import AgentEpisodes
    from verl_ds.rollout.episodes import Sampling, SeedKey, collect
    from verl_ds.trainer import builder
    from verl_ds.trainer.setup import resolve_setup

    overrides = ["logging.wandb.mode=disabled", "trainer.resume=none", *args.overrides]
    s = resolve_setup(load_config(args.config, overrides, world_size=1))
    cfg, path = s.cfg, s.model_path
    r, mt, d = cfg.rollout, cfg.rollout.multi_turn, cfg.data
    data = builder.build_data(s)  # the job's tokenizer, codec (with data.tools), episodes and prompts
    spec, prompts = data.episode_spec, data.prompts
    engine = make_rollout(r, path, s.precision.rollout, cfg.trainer.seed)
    schema = tool_schemas([calculator])
    few_shot = [dict(m) for m in cfg.data.few_shot]

    async def agent(client, example):
        """The tool environment's episode, as an agent writes it."""
        messages = few_shot + [{"role": "user", "content": example["prompt"]}]
        for _ in range(mt.max_turns):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=schema)
            msg = reply.choices[0].message
            if not msg.tool_calls:
                return 0.0  # the final answer: the task's reward function scores it
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls:
                try:
                    result = str(calculator(**json.loads(call.function.arguments)))
                except Exception as e:  # the tool's failure is the model's feedback, as in the environment
                    result = f"error: {type(e).__name__}: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0

    # the endpoint's codec: the agent sends its own messages and tools (no data.tools system prompt)
    plain = ChatCodec(
        data.tokenizer,
        d.apply_chat_template,
        None,
        d.system_prompt,
        model=path,
        eos_ids=list(data.codec.eos_ids),
        few_shot=d.few_shot,
    )
    agents = AgentEpisodes(agent, engine, plain, r.max_model_len, mt.agent_timeout_s, parse_hermes_tool_calls)
    sampling = Sampling(r.n, r.temperature, r.top_p, r.max_new_tokens)
    k = cfg.trainer.prompts_per_step
    rows = {"env": [], "agent": []}
    try:
        for rnd in range(args.rounds):
            examples = prompts[rnd * k : (rnd + 1) * k]
            for side in ("env", "agent") if rnd % 2 == 0 else ("agent", "env"):
                t = time.perf_counter()
                if side == "env":
                    ro = collect(engine, examples, [e["prompt_ids"] for e in examples], sampling, SeedKey(1, rnd), spec)
                else:
                    ro = agents.collect(examples, sampling, SeedKey(1, rnd))
                dt = time.perf_counter() - t
                eps = len(examples) * r.n
                turns = ro.metrics["multi_turn/turns/mean"]
                rows[side].append((eps / dt, turns, float(ro.batch.loss_mask.sum()) / dt))
                print(
                    f"round {rnd} {side:5s} {dt:6.1f} s  {eps / dt:6.2f} episodes/s  {turns:.2f} turns/episode  "
                    f"{rows[side][-1][2]:7.1f} model tokens/s",
                    flush=True,
                )
    finally:
        agents.close()
        engine.shutdown()
    med = {s: [statistics.median(x[i] for x in v) for i in range(3)] for s, v in rows.items()}
    print(
        f"\nmedian episodes/s: environment {med['env'][0]:.2f}, agent endpoint {med['agent'][0]:.2f} "
        f"(ratio {med['agent'][0] / med['env'][0]:.2f}); turns/episode {med['env'][1]:.2f} vs {med['agent'][1]:.2f}; "
        f"model tokens/s {med['env'][2]:.1f} vs {med['agent'][2]:.1f} (ratio {med['agent'][2] / med['env'][2]:.2f})"
    )


if __name__ == "__main__":
    main()
