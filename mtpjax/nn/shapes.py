"""The shape alphabet, written once: array names carry their axes as a suffix (`x_BTD` is [batch, positions, width]).

One letter, one meaning, in every file and in the docs' API; letters marked (reserved) are held for what is
coming and mean nothing else until then. tests/test_shapes.py checks every suffix in the package against it.
"""

ALPHABET = {
    "A": "micro-batches accumulated into one step",
    "B": "batch rows",
    "C": "positions per loss chunk",
    "D": "model width (d_model)",
    "E": "routed experts",
    "F": "MLP width (d_ff)",
    "G": "drafts per round (gamma)",
    "H": "head dimension",
    "I": "flattened leading axes (rows fed to a dense layer)",
    "J": "MTP depths, modules 1..model.mtp_depth (the main head is not one)",
    "K": "key/value heads",
    "L": "trunk layers",
    "M": "prediction depths: the main head and the MTP depths (J + 1)",
    "N": "query heads",
    "O": "draft-tree nodes (the rows a drafting level adds for them)",
    "P": "padded prompt length",
    "Q": "loss chunks (T / C)",
    "R": "query heads per key/value head (N / K)",
    "S": "cache / key positions (capacity)",
    "T": "positions of this call (window)",
    "U": "unrolled applications of one MTP module (loss.mtp_unroll)",
    "V": "vocabulary",
    "W": "rows an MTP module recomputes per round",
    "X": "experts chosen per token (top-k)",
    "Y": "tokens verified per round (G + 1)",
    "Z": "latent (compressed key/value) rank",
}
