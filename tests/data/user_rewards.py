"""Reward functions that break their contract, as a user's module would (tests/data/test_reward_contract.py)."""


def returns_none(response, answer):
    return None


def returns_text(response, answer):
    return "1.0"


def returns_nan(response, answer):
    return float("nan")


def raises(response, answer):
    return {"a": 1}["missing"]


def returns_bool(response, answer):
    return response == answer
