"""The pure model layer: layers and the shape alphabet, model, kernels, loss, FLOPs, speculation arithmetic."""
