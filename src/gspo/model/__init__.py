"""Model loading, token log-probs and MoE routing capture/replay."""
