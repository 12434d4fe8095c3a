"""Model roles, each its own DeepSpeed engine: actor, critic, reference, reward, teacher."""

from verl_ds.roles.base import Role, align_overflow, model_inputs
from verl_ds.roles.critic import Critic, ValueModel, load_value_model
from verl_ds.roles.ds_internals import forget_destroyed_world
from verl_ds.roles.params import iter_full_params
from verl_ds.roles.policy import Actor, PolicyRole, Reference, Teacher, load_causal_lm
from verl_ds.roles.reward import RewardModel, load_reward_model

__all__ = [
    "Role",
    "Actor",
    "PolicyRole",
    "Critic",
    "Reference",
    "RewardModel",
    "Teacher",
    "ValueModel",
    "align_overflow",
    "forget_destroyed_world",
    "iter_full_params",
    "load_causal_lm",
    "load_value_model",
    "load_reward_model",
    "model_inputs",
]
