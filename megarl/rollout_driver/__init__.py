"""The driver side of rollout: what asks the engines for batches, keeps them in flight, scores
them and hands them to the trainer (the engine side is ``megarl.rollout``)."""
