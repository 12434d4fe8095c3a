"""`rollout.multi_turn.env: textarena`: a single-player TextArena game (PyPI `textarena`) as it is.

`env_kwargs: {env_id: GuessTheNumber-v0, game_kwargs: {max_number: 8}}` names the game and, optionally,
its constructor's arguments (its difficulty); the game's own code runs each episode.
The game's messages are the conversation: its opening (rules and first prompt) follows the data
row's prompt, and after every model turn the game's answer (a hint, the next board, a complaint
about an invalid move) is the next user message. The reward is the game's own, given at its end;
`invalid_move_reward` replaces it for an episode that ends on an invalid move (TextArena scores
one with the game's partial credit: in GuessTheNumber the closeness of the last valid guess, which
a policy can farm by repeating its first guess).

TextArena's registered ids wrap a game so that each observation repeats the whole history as one
text (for a stateless LLM agent); a chat already holds the history, so the adapter plays the
game's unwrapped `-raw` id and forwards only what is new. Each episode's game is seeded from the
example's `seed` key when the data row has one (held-out game seeds for validation), else from
its prompt.
"""

from __future__ import annotations

from verl_ds.errors import ConfigError

from .base import example_seed

PLAYER = 0  # single-player games: the model is player 0; the game itself writes as player -1


class TextArenaEnv:
    def __init__(self, env_id: str, game_kwargs: dict | None = None, invalid_move_reward: float | None = None):
        import textarena as ta

        self.env_id, self.env = env_id, ta.make(env_id=self.check_kwargs(env_id), **(game_kwargs or {}))
        self.invalid_move_reward = invalid_move_reward

    @staticmethod
    def check_kwargs(env_id: str, game_kwargs: dict | None = None, invalid_move_reward: float | None = None) -> str:
        """At start (`load_env_factory`): the game exists; its unwrapped id."""
        try:
            import textarena as ta
        except ImportError:
            raise ConfigError(
                "rollout.multi_turn.env", "textarena is not installed: pip install 'verl-ds[envs]'"
            ) from None
        registry = ta.envs.registration.ENV_REGISTRY
        raw = env_id if env_id.endswith("-raw") else f"{env_id}-raw"
        if raw not in registry:
            stem = env_id.split("-")[0].lower()
            near = sorted(k for k in registry if k.split("-")[0].lower() == stem and k.endswith("-v0"))
            raise ConfigError(
                "rollout.multi_turn.env_kwargs.env_id",
                f"TextArena has no game '{env_id}'" + (f" (did you mean {', '.join(near[:4])}?)" if near else ""),
            )
        _check_game_kwargs(env_id, registry[raw], game_kwargs or {})
        return raw

    def reset(self, example: dict) -> str:
        seed = example_seed(example)
        self.env.reset(num_players=1, seed=seed)
        return self._news()

    def step(self, action: str):
        done, _ = self.env.step(action=action)
        if not done:
            return self._news(), 0.0, False, {}
        rewards, info = self.env.close()
        invalid = bool((info or {}).get(PLAYER, {}).get("invalid_move"))
        reward = float((rewards or {}).get(PLAYER, 0.0))
        if invalid and self.invalid_move_reward is not None:
            reward = float(self.invalid_move_reward)
        return None, reward, True, {"invalid_move": float(invalid)}

    def _news(self) -> str:
        """The game's messages since the model's last action (the model's own echo left out)."""
        _, observations = self.env.get_observation()
        return "\n".join(str(msg) for sender, msg, *_ in observations if sender != PLAYER).strip()


def _check_game_kwargs(env_id: str, spec, game_kwargs: dict) -> None:
    """`game_kwargs` against the game's constructor (its registry entry's defaults merged in, as
    `ta.make` does), so an argument the game does not take is a start-up line, not a traceback."""
    import importlib
    import inspect

    entry = spec.entry_point
    if isinstance(entry, str):
        mod, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(mod), name)
    try:
        inspect.signature(entry).bind(**{**(spec.kwargs or {}), **game_kwargs})
    except TypeError as e:
        raise ConfigError("rollout.multi_turn.env_kwargs.game_kwargs", f"{env_id}: {e}") from None
