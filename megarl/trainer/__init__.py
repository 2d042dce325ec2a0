"""The RL driver: the loop, the run it drives, and what it logs and checkpoints."""
