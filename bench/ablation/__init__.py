"""Does MTP help the main model? `python -m bench.ablation`: train D=0 and each MTP variant from the same
initialization of the shared parts on the same batches, and compare their main heads on the same held-out
tokens, at equal tokens and at equal FLOPs (see grid.py for how the equal-FLOPs D=0 is kept fair).

    python -m bench.ablation --config C [--depths 0,1,2] [--kinds sequential,parallel@2]
        [--lambda constant:0.3 --lambda "piecewise:0.3@N,0.1"] [--steps N] [--seeds 2] [--out DIR]
        [--report DIR] [--timing-rounds 5] [--smoke] [section.key=value ...]
"""
