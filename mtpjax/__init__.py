"""mtpjax: multi-token-prediction pretraining in JAX/Flax NNX, with the MTP modules as a speculative decoder."""

__version__ = "0.1.0"
