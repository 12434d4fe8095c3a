"""verl_ds.algos stays pure: it imports only torch, numpy, typing, math and its own submodules."""

import ast
from pathlib import Path

import verl_ds.algos

ALLOWED = {"torch", "numpy", "typing", "math", "__future__"}
ALGOS_DIR = Path(verl_ds.algos.__file__).parent


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield 0, alias.name
        elif isinstance(node, ast.ImportFrom):
            yield node.level, node.module or ""


def test_algos_imports_only_torch_numpy_and_itself():
    files = sorted(ALGOS_DIR.rglob("*.py"))
    assert len(files) >= 5
    for path in files:
        for level, name in _imports(ast.parse(path.read_text(), filename=str(path))):
            if level == 1:  # relative import within verl_ds.algos
                continue
            ok = level == 0 and (
                name.split(".")[0] in ALLOWED or name == "verl_ds.algos" or name.startswith("verl_ds.algos.")
            )
            assert ok, f"{path.name} imports {'.' * level}{name}"


def test_public_api_exported():
    names = {
        "compute_gae",
        "masked_mean",
        "masked_var",
        "masked_whiten",
        "grpo_advantages",
        "rloo_advantages",
        "reinforce_pp_advantages",
        "reinforce_pp_baseline_advantages",
        "kl_penalty",
        "policy_loss",
        "value_loss",
        "agg_loss",
        "logprobs_from_logits",
        "logprobs_and_entropy",
        "entropy_from_logits",
        "tis_weights",
        "mismatch_metrics",
        "RunningMeanStd",
        "normalize_rewards",
        "FixedKLController",
        "AdaptiveKLController",
        "get_advantage_estimator",
        "ESTIMATORS_NEEDING_CRITIC",
        "ADVANTAGE_ESTIMATORS",
    }
    assert names <= set(verl_ds.algos.__all__)
    assert all(hasattr(verl_ds.algos, n) for n in verl_ds.algos.__all__)
