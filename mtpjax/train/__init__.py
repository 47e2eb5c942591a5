"""Training: state and step, the loop, its eval hook and report, checkpoints, run directories, post-training."""
