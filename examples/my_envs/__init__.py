"""Two environments written as a user writes their own (README, "Your own environment"):

- `examples.my_envs.add:AddNumbers`, single turn: add two numbers; a reward function in ~20 lines.
- `examples.my_envs.guess:GuessNumber`, multi-turn: find a hidden number from "higher" / "lower" replies.

Train on them from the repository root (the main job and its environment workers import them from there):

    python -m rl.train --config=configs/grpo.py:test --workdir=runs/mine \
        --config.rl.domains="('examples.my_envs.add:AddNumbers', 'examples.my_envs.guess:GuessNumber')" \
        --config.rl.max_turns=4 --config.rl.quality_gate=True
"""
