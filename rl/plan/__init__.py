"""The main job's planner (`python -m rl.plan`): rollout, live memory per device and XLA's figures."""
