"""The GRPO main job (`python -m rl.train`): train step, rollouts, curriculum, run directory, CLIs."""
