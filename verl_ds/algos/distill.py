"""On-policy distillation: the student samples, a frozen teacher scores the same tokens, and the
per-token reverse KL log pi_student - log pi_teacher (its single-sample, k1 estimate on the
student's own samples) is what the student minimises: as a dense reward (each token's advantage)
or as a loss term (`kl_penalty` with the k1/k3 estimators, as for the reference KL).

Shapes: logprobs and masks ``[batch, T]``; masked positions (prompt padding, environment tokens)
count nothing.
"""

from __future__ import annotations

import torch

from .advantages import discounted_returns


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token log pi_s - log pi_t on the student's samples (0 where masked): an unbiased estimate
    of KL(pi_s || pi_t) per token, exactly 0 when the teacher is the student."""
    return (student_logprobs - teacher_logprobs) * mask


def distill_advantages(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    discount: float = 0.0,
) -> torch.Tensor:
    """Token advantages from the dense reward r_t = -coef * (log pi_s - log pi_t): their discounted
    sum from t on (discount 0: each token its own reward, the published recipe). No baseline and no
    whitening: a token the teacher finds likelier than the student does is pushed up, and the
    signal vanishes where the two agree."""
    rewards = -coef * reverse_kl(student_logprobs, teacher_logprobs, mask)
    return discounted_returns(rewards, mask, discount)
