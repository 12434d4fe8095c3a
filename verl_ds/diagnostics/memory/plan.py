"""`verl-ds debug memory --plan`: the placements of every role that fit the GPUs, cheapest first.

Searched per role: ZeRO stage (trained roles 0-3, frozen 0 or 3), offload (optimizer; optimizer +
parameters at ZeRO-3; a frozen role's parameters at ZeRO-3), `sleep` (trained roles at ZeRO >= 1 whose
parameters stay on the device), int8 weights for a reward model or teacher; for the run, activation
checkpointing (and its inputs offloaded to the host), DeepSpeed's TiledMLP for the trained roles, vLLM's
share of the GPU (`rollout.gpu_memory_utilization`) and the sequence-parallel size
(`trainer.sequence_parallel_size`: the sizes that divide a node's GPUs and the model's heads as DeepSpeed's
all-to-all needs; one row a micro-batch). Compute dtypes stay bf16 (the GPU rule); LoRA is not searched
(it changes what is trained).

A plan fits when the analytic estimate (`estimate_memory`: every stage's device bytes, vLLM asleep
while the roles train) is within the GPU at every stage, and the host holds each node's offloaded
and sleeping states (`--host-memory-gb`; unlimited when not given).

The cost model (seconds per step, from bytes moved and work added; constants below, per rank):
- PCIe: an offloaded optimizer sends the 16-bit gradient partition down and the updated 16-bit
  parameters up once per optimizer step, and DeepSpeedCPUAdam touches the 16 bytes/param of masters
  and moments on the host; offloaded parameters come up once per forward and per backward pass; a
  sleeping role's device states go down and come back once per step. vLLM's weights do not cross:
  they are discarded after generation (sleep level 2) and the sync loads them from the actor's.
- Collectives (ring): ZeRO-0 all-reduces the gradients, ZeRO-1/2 reduce-scatter them and all-gather
  the parameters, ZeRO-3 reduce-scatters them and gathers the parameters for every forward and
  backward pass; at the intra-node rate on one node, the inter-node rate across nodes.
- Sequence parallelism: every attention layer all-to-alls its query, keys, values and output, forward and
  backward (and again in a checkpointed layer's recomputation), (SP - 1) / SP of them leaving the rank,
  within a node at the intra-node rate.
- Activation checkpointing recomputes each training forward (2 FLOPs/param/token); TiledMLP its MLPs'
  forward (6 hidden x ffn FLOPs/layer/token); the activation offload sends each checkpointed layer's input
  over PCIe and back.
Ties go to the larger vLLM share (a larger KV pool batches more sequences), then to the simpler
placement (lower ZeRO stages, fewer offloads and sleeps), then the lower peak.

Apart (`trainer.rollout_ranks`, `weigh_apart`): k of the N GPUs each run a rollout engine alone and the
other N - k train. The trainer ranks' placements are searched as above on N - k ranks whose GPUs hold no
engine (the vLLM share they print is a rollout rank's, of its own GPU); the step against the colocated
one, from the share g of the colocated step spent generating (`--generation-share`, a colocated run's
`timing_s/rollout` over `timing_s/step`): the two sides overlap, so about max(g N / k, (1 - g) N / (N - k))
of it, before what splitting saves besides (no engine sleep and wake, no vLLM share beside the roles, the
long tail hidden behind training) and what it costs (rows one step off-policy).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field, replace

from verl_ds.config import active_roles, batch_geometry, offload_stages
from verl_ds.diagnostics.memory.estimate import (
    BYTES,
    GIB,
    HEADS,
    ModelShape,
    estimate_memory,
    model_states,
    role_kwargs,
    roles_memory,
    stage_totals,
    workload,
)
from verl_ds.ds_config import offload_blocks, precision_blocks
from verl_ds.precision import INT8_ROLES, TRAINED_ROLES

PCIE_BYTES_S = 25e9  # host <-> GPU, one direction (PCIe 4 x16, achieved)
INTRA_NODE_BYTES_S = 150e9  # NVLink-class all-gather / reduce-scatter bus bandwidth per GPU
INTER_NODE_BYTES_S = 25e9  # one 200 Gb/s NIC per GPU
HOST_ADAM_BYTES_S = 20e9  # DeepSpeedCPUAdam over masters + moments (AVX-512, one socket's share)
GPU_FLOPS = 400e12  # achieved bf16 FLOP/s for the recomputation
VLLM_SHARES = (0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class RolePlacement:
    stage: int
    offload: str = "none"
    sleep: bool = False
    dtype: str = "bf16"


@dataclass
class Plan:
    roles: dict[str, RolePlacement]
    grad_checkpointing: bool
    vllm_share: float
    sp: int = 1  # trainer.sequence_parallel_size
    tiled_mlp: bool = False  # the trained roles' roles.<role>.tiled_mlp
    offload_activations: bool = False  # the trained roles' roles.<role>.offload_activations
    # one row a micro-batch: SP's rule, and searched without SP too, so a split row is weighed against a
    # whole row alone rather than against the user's larger micro-batches
    one_row: bool = False
    peak: float = 0.0  # device bytes at the peak stage
    peak_stage: str = ""
    dominant: str = ""  # the role and component that dominate the peak
    host: float = 0.0  # host bytes per node
    cost_s: float = 0.0
    costs: dict[str, float] = field(default_factory=dict)
    rollout_ranks: int = 0  # trainer.rollout_ranks: the plan is the trainer ranks' (`weigh_apart`)

    def yaml(self) -> str:
        """A `roles:` / `precision:` / `rollout:` block `config render` accepts."""
        lines = ["roles:"]
        for role, p in self.roles.items():
            keys = [f"zero_stage: {p.stage}"]
            if self.one_row:
                keys += ["micro_batch_size: 1", "max_tokens_per_micro_batch: auto"]
            if role in TRAINED_ROLES:
                keys += ["tiled_mlp: true"] * self.tiled_mlp + ["offload_activations: true"] * self.offload_activations
            if p.offload != "none":
                keys.append(f"offload: {p.offload}")
            if p.sleep:
                keys.append("sleep: true")
            lines.append(f"  {role}: {{{', '.join(keys)}}}")
        dtypes = ", ".join(f"{r}_dtype: {p.dtype}" for r, p in self.roles.items())
        ckpt = str(self.grad_checkpointing).lower()
        lines.append(f"precision: {{{dtypes}, rollout_dtype: bf16, enable_grad_checkpointing: {ckpt}}}")
        sleep = str(not self.rollout_ranks).lower()  # apart, nothing else wants a rollout rank's GPU
        lines.append(f"rollout: {{engine: vllm, sleep: {sleep}, gpu_memory_utilization: {self.vllm_share}}}")
        if self.sp > 1:
            lines.append(f"trainer: {{sequence_parallel_size: {self.sp}}}")
        if self.rollout_ranks:
            lines.append(f"trainer: {{rollout_ranks: {self.rollout_ranks}}}")
            lines.append("algorithm: {tis_cap: 2.0}  # rows one step off-policy")
        return "\n".join(lines)


def role_options(role: str) -> list[RolePlacement]:
    trained = role in TRAINED_ROLES
    out = []
    for offload in ("none", "optimizer", "optimizer+params") if trained else ("none", "params"):
        for stage in offload_stages(offload, trained):
            sleeps = (False, True) if stage in offload_stages(offload, trained, sleep=True) else (False,)
            dtypes = ("bf16", "int8") if role in INT8_ROLES and stage == 0 and offload == "none" else ("bf16",)
            for sleep, dtype in itertools.product(sleeps, dtypes):
                out.append(RolePlacement(stage, offload, sleep, dtype))
    return out


def _ds_for(base: dict, p: RolePlacement) -> dict:
    """The role's rendered DeepSpeed config with this placement's stage, offload and dtype blocks."""
    ds = copy.deepcopy(base)
    zero = ds.setdefault("zero_optimization", {})
    zero["stage"] = p.stage
    zero.pop("offload_optimizer", None)
    zero.pop("offload_param", None)
    zero.update(offload_blocks(p.offload))
    ds.pop("fp16", None)
    ds.pop("bf16", None)
    ds.update(precision_blocks(p.dtype, None))
    return ds


def _resident(states: dict[str, float]) -> float:
    """A role's device states that stay between updates (what `sleep` moves to the host)."""
    return sum(v for k, v in states.items() if not k.endswith("_update"))


def plan_cost(
    cfg, plan: Plan, shapes: dict[str, ModelShape], states: dict[str, dict], world: int, nodes: int
) -> dict[str, float]:
    """Seconds per step by source (the module docstring's model); `states`: each role's `model_states`."""
    w = workload(cfg, world)
    coll_rate = INTRA_NODE_BYTES_S if nodes == 1 else INTER_NODE_BYTES_S
    ring = (world - 1) / world if world > 1 else 0.0
    out = {"pcie": 0.0, "host_adam": 0.0, "collectives": 0.0, "all_to_all": 0.0, "recompute": 0.0}
    for role, p in plan.roles.items():
        out["all_to_all"] += sp_all_to_all_s(cfg, shapes[role], role, plan.sp, plan.grad_checkpointing, world)
        psi = shapes[role].params(HEADS[role])
        b = BYTES[p.dtype]
        mb = 1 if plan.one_row else getattr(cfg.roles, role).micro_batch_size
        passes = max(1, -(-w.local_batch // mb))  # micro-batches per pass over this rank's rows
        trained = role in TRAINED_ROLES
        fwd_bwd = passes * cfg.algorithm.ppo_epochs * (2 if trained else 0) + passes  # + the scoring pass
        if p.stage >= 3:
            out["collectives"] += fwd_bwd * ring * psi * b / coll_rate
        if trained:
            grads = ring * psi * b
            out["collectives"] += (2 * grads if p.stage in (0, 1, 2) else grads) / coll_rate
            if "optimizer" in p.offload:
                out["pcie"] += 2 * psi * b / world / PCIE_BYTES_S
                out["host_adam"] += 16 * psi / world / HOST_ADAM_BYTES_S
            if p.sleep:
                out["pcie"] += 2 * _resident(states[role]["device"]) / PCIE_BYTES_S
            # this rank's shards; a shared prefix once (`Workload.run_tokens`)
            tokens = w.run_tokens(mb, shapes[role].hidden) * cfg.algorithm.ppo_epochs / plan.sp
            if plan.grad_checkpointing:
                out["recompute"] += 2 * psi * tokens / GPU_FLOPS
            s = shapes[role]
            if plan.tiled_mlp:  # the MLPs' forward again in the backward
                out["recompute"] += 6 * s.hidden * s.ffn * s.layers * tokens / GPU_FLOPS
            if plan.offload_activations:  # each checkpointed layer's input down and back up
                out["pcie"] += 2 * s.layers * tokens * s.hidden * b / PCIE_BYTES_S
        if "params" in p.offload:
            out["pcie"] += fwd_bwd * psi * b / world / PCIE_BYTES_S
    return out


def sp_all_to_all_s(cfg, shape: ModelShape, role: str, sp: int, grad_checkpointing: bool, world: int) -> float:
    """Seconds a step of `role`'s passes spends in sequence parallelism's all-to-alls (the module's model):
    every layer sends (SP - 1) / SP of its shard's query, keys, values (repeated where SP exceeds the
    key/value heads) and attention output, in 16-bit, per forward; a backward twice that."""
    if sp == 1:
        return 0.0
    w = workload(replace(cfg, trainer=replace(cfg.trainer, sequence_parallel_size=sp)), world)
    kv = shape.kv_heads * shape.head_dim * max(1, sp // shape.kv_heads)
    per_forward = w.local_batch * w.seq_len / sp * shape.layers * (2 * shape.hidden + 2 * kv) * 2 * (sp - 1) / sp
    forwards = 1 + (cfg.algorithm.ppo_epochs * (3 + grad_checkpointing) if role in TRAINED_ROLES else 0)
    return forwards * per_forward / INTRA_NODE_BYTES_S


def sp_sizes(cfg, shapes: dict[str, ModelShape], world: int, per_node: int) -> list[int]:
    """The sequence-parallel sizes a run may take: those that divide the world, fit in a node and split
    every model's heads as DeepSpeed does (1 always)."""

    def splits(s: ModelShape, n: int) -> bool:
        return s.heads % n == 0 and (s.kv_heads % n == 0 or n % s.kv_heads == 0)

    return [n for n in (1, 2, 4, 8) if world % n == 0 and n <= per_node and all(splits(s, n) for s in shapes.values())]


def search(
    cfg,
    shapes: dict[str, ModelShape],
    base_ds: dict[str, dict],
    world: int,
    gpu_gib: float,
    host_gib: float | None = None,
    gpus_per_node: int = 8,
) -> list[Plan]:
    """Every placement of the run's roles that fits, cheapest first."""
    roles = active_roles(cfg)
    larger_micro = any(getattr(cfg.roles, r).micro_batch_size > 1 for r in roles)
    per_node = min(world, gpus_per_node)
    nodes = -(-world // per_node)
    sps = sp_sizes(cfg, shapes, world, per_node)
    plans = []
    for combo in itertools.product(*(role_options(r) for r in roles)):
        placement = dict(zip(roles, combo))
        # what depends on the placement alone: the configs, the model states, the host bytes
        placed = replace(
            cfg,
            precision=replace(cfg.precision, **{f"{r}_dtype": p.dtype for r, p in placement.items()}),
            roles=replace(
                cfg.roles, **{r: replace(getattr(cfg.roles, r), sleep=p.sleep) for r, p in placement.items()}
            ),
        )
        ds = {r: _ds_for(base_ds[r], p) for r, p in placement.items()}
        states = {r: model_states(shapes[r], ds[r], **role_kwargs(placed, shapes[r], r), world=world) for r in roles}
        # one rank's host bytes: offloaded states, plus sleeping roles' device states while generating
        host = per_node * sum(
            sum(st["host"].values()) + (_resident(st["device"]) if placement[r].sleep else 0.0)
            for r, st in states.items()
        )
        if host_gib is not None and host > host_gib * GIB:
            continue
        # each run-wide setting's section built once per placement (the search's cost is mostly these)
        precisions = {gc: replace(placed.precision, enable_grad_checkpointing=gc) for gc in (False, True)}
        rollouts = {s: replace(cfg.rollout, engine="vllm", sleep=True, gpu_memory_utilization=s) for s in VLLM_SHARES}
        trainers = {sp: replace(cfg.trainer, sequence_parallel_size=sp) for sp in sps}
        long_rows = {
            (tiled, off): replace(
                placed.roles,
                **{
                    r: replace(getattr(placed.roles, r), tiled_mlp=tiled, offload_activations=off)
                    for r in roles
                    if r in TRAINED_ROLES
                },
            )
            for tiled, off in itertools.product((False, True), repeat=2)
        }
        one_row_ds = {r: {**d, "train_micro_batch_size_per_gpu": 1} for r, d in ds.items()}
        for gc, sp, tiled, off, one in itertools.product(
            (False, True), sps, (False, True), (False, True), (False, True)
        ):
            if off and not gc:
                continue  # the offload moves what checkpointing keeps
            if (sp > 1 and not one) or (sp == 1 and one and not larger_micro):
                continue  # a split row runs alone; a whole one alone where the user's micro-batches are larger
            c = replace(
                placed,
                precision=precisions[gc],
                rollout=rollouts[VLLM_SHARES[0]],
                trainer=trainers[sp],
                roles=long_rows[(tiled, off)],
            )
            split = one_row_ds if one else ds
            # the roles' bytes and the step's cost do not depend on vLLM's share: once for every share
            roles_part = roles_memory(c, shapes["actor"], split, world, gpu_gib, role_shapes=shapes)
            costs = plan_cost(c, Plan(placement, gc, 0.0, sp, tiled, off, one), shapes, states, world, nodes)
            for share in VLLM_SHARES:
                c = replace(c, rollout=rollouts[share])
                est = estimate_memory(
                    c, shapes["actor"], split, world, "bf16", gpu_gib, role_shapes=shapes, roles_part=roles_part
                )
                totals = stage_totals(est)
                peak_stage = max(totals, key=totals.get)
                if totals[peak_stage] > gpu_gib * GIB:
                    continue
                plan = Plan(placement, gc, share, sp, tiled, off, one, totals[peak_stage], peak_stage)
                plan.dominant, plan.host, plan.costs = _dominant(est[peak_stage]), host, costs
                plan.cost_s = sum(costs.values())
                plans.append(plan)
    # ties: the larger vLLM share, then the simpler placement (lower stages, fewer offloads), the lower peak
    plans.sort(key=lambda p: (round(p.cost_s, 4), -p.vllm_share, _complexity(p), p.peak))
    return plans


@dataclass
class Apart:
    """The trainer ranks' cheapest placement with `rollout_ranks` of the world's GPUs generating apart."""

    rollout_ranks: int
    trainers: int
    best: Plan | None  # None: nothing fits the trainer ranks (or `why`)
    step: float  # the step against the colocated one, from `--generation-share`
    why: str = ""  # what keeps this split from running the config's batch


def weigh_apart(
    cfg,
    shapes: dict[str, ModelShape],
    render,
    world: int,
    gpu_gib: float,
    host_gib: float | None,
    generation_share: float,
    gpus_per_node: int = 8,
) -> list[Apart]:
    """Every split of `world` GPUs into k rollout ranks and world - k trainer ranks worth weighing (k about
    1/8 .. 3/4 of them), each with the trainer ranks' cheapest placement (`search` on their world, no engine
    on their GPUs) and the step the module's model gives; `render(cfg, world)`: the roles' DeepSpeed configs."""
    out = []
    for k in sorted({max(1, round(world * f)) for f in (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)} - {world}):
        trainers = world - k
        c = replace(cfg, trainer=replace(cfg.trainer, rollout_ranks=k, sequence_parallel_size=1))
        step = max(generation_share * world / k, (1 - generation_share) * world / trainers)
        errors = batch_geometry(c, trainers)  # the config's batch over the trainer ranks
        if errors:
            out.append(Apart(k, trainers, None, step, f"{errors[0].where}: {errors[0].message}"))
            continue
        ds = render(c, trainers)
        plans = [replace(p, rollout_ranks=k) for p in search(c, shapes, ds, trainers, gpu_gib, host_gib, gpus_per_node)]
        out.append(Apart(k, trainers, plans[0] if plans else None, step, "" if plans else "no placement fits"))
    return out


def render_apart(options: list[Apart], world: int, generation_share: float) -> str:
    """The `--plan` section that weighs rollout ranks apart against the colocated plans above."""
    g = f"generation share {generation_share:g}"
    rows = [
        "| rollout ranks | trainer ranks | the trainer ranks' best placement | peak GiB | s/step "
        f"| step vs colocated ({g}) |",
        "|---|---|---|---|---|---|",
    ]
    for a in options:
        step = f"{a.step:.2f}x"
        if a.best is None:
            rows.append(f"| {a.rollout_ranks} | {a.trainers} | {a.why} | - | - | {step} |")
            continue
        b = a.best
        cells = ", ".join(f"{r} {_short(p)}" for r, p in b.roles.items())
        cells += f", ckpt {'on' if b.grad_checkpointing else 'off'}"
        cells += f", {_long_rows(b)}" if _long_rows(b) != "-" else ""
        rows.append(f"| {a.rollout_ranks} | {a.trainers} | {cells} | {b.peak / GIB:.1f} | {b.cost_s:.2f} | {step} |")
    text = (
        f"## Apart: k of the {world} GPUs generating (`trainer.rollout_ranks`), the others training\n\n"
        + "\n".join(rows)
        + "\n\nA rollout rank holds its engine alone (the block's `gpu_memory_utilization` is of its own GPU); "
        "the step column is the two sides overlapping, max(g N / k, (1 - g) N / (N - k)), before what splitting "
        "saves besides (no sleep and wake, no vLLM share beside the roles) and what it costs (rows one step "
        "off-policy, `algorithm.tis_cap`)."
    )
    ok = [a for a in options if a.best is not None]
    if ok:
        best = min(ok, key=lambda a: (a.step, a.best.cost_s))
        text += f"\n\nThe best split as a run-config block:\n\n```yaml\n{best.best.yaml()}\n```"
    return text


def _complexity(p: Plan) -> int:
    roles = sum(r.stage + 4 * (r.offload != "none") + 2 * r.sleep for r in p.roles.values())
    return roles + 2 * p.grad_checkpointing + 2 * (p.sp > 1) + p.tiled_mlp + p.offload_activations + p.one_row


def _dominant(stage: dict[str, dict[str, float]]) -> str:
    role, comp = max(((r, c) for r, cs in stage.items() for c in cs), key=lambda rc: stage[rc[0]][rc[1]])
    return f"{role} {comp}"


def render_plans(plans: list[Plan], top: int, world: int, gpu_gib: float, host_gib: float | None) -> str:
    """The Markdown `--plan` prints: the best `top` plans and the best one as YAML."""
    host = f"{host_gib:g} GiB host per node" if host_gib else "host memory not bounded"
    head = f"## Plans that fit {world} x {gpu_gib:g} GiB GPUs ({host}), cheapest first\n\n"
    if not plans:
        return head + "No placement fits: more GPUs, a smaller model, shorter sequences or smaller micro-batches."
    rows = [
        "| # | " + " | ".join(plans[0].roles) + " | ckpt | SP | long rows | vLLM | peak GiB (stage: dominant) "
        "| host GiB/node | "
        "s/step (PCIe, host Adam, collectives, all-to-all, recompute) |",
        "|---|" + "---|" * len(plans[0].roles) + "---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(plans[:top], 1):
        cells = [_short(r) for r in p.roles.values()]
        c = p.costs
        rows.append(
            f"| {i} | " + " | ".join(cells) + f" | {'on' if p.grad_checkpointing else 'off'} | {p.sp} | "
            f"{_long_rows(p)} | "
            f"{p.vllm_share:g} | {p.peak / GIB:.1f} ({p.peak_stage}: {p.dominant}) | {p.host / GIB:.0f} | "
            f"{p.cost_s:.2f} ({c['pcie']:.2f}, {c['host_adam']:.2f}, {c['collectives']:.2f}, "
            f"{c['all_to_all']:.2f}, {c['recompute']:.2f}) |"
        )
    return (
        head
        + "\n".join(rows)
        + f"\n\n{len(plans)} plans fit. The best as a run-config block:\n\n```yaml\n{plans[0].yaml()}\n```"
    )


def _long_rows(p: Plan) -> str:
    alone = ["1 row/micro"] * (p.one_row and p.sp == 1)  # a split row always runs alone
    return " + ".join(alone + ["tiled MLP"] * p.tiled_mlp + ["act. offload"] * p.offload_activations) or "-"


def _short(p: RolePlacement) -> str:
    parts = [f"Z{p.stage}", p.dtype]
    if p.offload != "none":
        parts.append(f"off:{p.offload}")
    if p.sleep:
        parts.append("sleep")
    return " ".join(parts)
