"""Trunk + J MTP modules (DeepSeek-V3 sequential, or parallel heads); returns hidden states, never losses.

Convention: module k > 1 consumes the *raw* (pre-final-norm) hidden state of depth k-1; module 1 reads the
trunk's state raw or after the trunk's final norm (`model.mtp_hidden`, `trunk_state`). Each depth's own
final norm is applied only on the way to the shared head. Training and decoding use the same methods
below, so the convention cannot drift between them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from mtpjax.config import Config, ModelConfig
from mtpjax.nn.layers import KV, Block, Dense, RMSNorm, dtype_of, param
from mtpjax.nn.mla import MLAttention
from mtpjax.nn.moe import SAVED as MOE_SAVED, MoE
from mtpjax.nn.placement import Placement, host_placement


@struct.dataclass
class MTPOutput:
    hidden: jax.Array  # hidden_MBTD: index 0 the trunk, k the MTP depth k, each normed for the head
    unrolled: jax.Array | None = None  # unrolled_UBTD: a module's reuses on its own output (MTPTransformer.unroll)
    # model.mlp_kind=moe: per MoE layer (moe_layers' names) {"load": int[E] token-slots per expert (int[L, E] for a
    # scanned trunk), "balance": the sequence-wise balance statistic summed over rows}; {} for a dense model
    routing: dict = struct.field(default_factory=dict)


MTP_SCOPE = "mtp_module"  # the name scope of the MTP modules' ops in a compiled program (jax.named_scope)


def _kernel_outputs(prim, *_, **params) -> bool:
    """Whether remat "save_kernels" keeps a value: what a Pallas kernel with its own gradient computed (attention's
    output and row statistics, the grouped matmuls'). Remat sees such a kernel as one custom_vjp call (Triton's
    attention, ours) or, where its forward rule was traced inline (splash), as the Pallas call itself."""
    return prim.name == "pallas_call" or (prim.name == "custom_vjp_call"
                                          and "pallas_call" in str(params.get("call_jaxpr", "")))


_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "save_kernels": jax.checkpoint_policies.save_from_both_policies(
        _kernel_outputs, jax.checkpoint_policies.save_only_these_names(*MOE_SAVED)),
}


def _run_block(gdef, st, x, pos, seg, kv, remat: str, layer=None):
    """Apply one block (graphdef, state) functionally, rematerialized if configured: (x, cache, routing info). With
    `layer`, st is a stack and the block its layer `layer`, read inside the remat: the backward reads it again rather
    than keeping a copy per use (a circular pipeline's chunk, one per tick; with remat none the copies are kept)."""
    def f(st, x, kv):
        if layer is not None:
            st = jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, layer, 0, False), st)
        return nnx.merge(gdef, st)(x, pos, seg, kv)

    if remat != "none":
        f = jax.checkpoint(f, policy=_REMAT[remat])
    return f(st, x, kv)


def scan_blocks(gdef, st, x_BTD, pos_BT, seg_BT, cache, remat: str, keep_L=None, layers=None):
    """A stacked trunk's blocks (graphdef, state with a leading layer axis) applied in turn by lax.scan: (x, caches,
    routing info stacked over layers); the trunk's and a pipeline stage's share of it. Where `keep_L` is False the
    layer passes x through (a stage's padding): its output, and so its parameters' gradient, is dropped. With
    `layers` (indices into st) only those run, each taken inside its remat (_run_block)."""
    def body(x, xs):
        one, kv_l, keep = xs  # a layer's state, or its index
        st_l, layer = (one, None) if layers is None else (st, one)
        y, kv, aux = _run_block(gdef, st_l, x, pos_BT, seg_BT, kv_l, remat, layer)
        return (y if keep is None else jnp.where(keep, y, x)), (kv, aux)

    x_BTD, (new, aux) = jax.lax.scan(body, x_BTD, (st if layers is None else layers, cache, keep_L))
    return x_BTD, new, aux


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def head_product(h_ID, w, vocab_first: bool = False):
    """h @ w in float32 (logits), w as [D,V] or, tied to the embedding, [V,D] (read in its own layout: no [D,V] copy
    of it); the backward's two products take the cotangent in h's dtype, accumulating in float32: a bf16 model's
    head gradients run at the matrix units' bf16 rate over half the bytes (autodiff would multiply the float32
    cotangent in float32: on an H200 the head's backward took 2.3x its forward)."""
    return jax.lax.dot_general(h_ID, w, (((1,), (int(vocab_first),)), ((), ())), preferred_element_type=jnp.float32)


def _head_product_fwd(h_ID, w, vocab_first):
    return head_product(h_ID, w, vocab_first), (h_ID, w)


def head_weight_grad(h_ID, g_IV, vocab_first: bool):
    """The head weight's gradient in float32, in the weight's layout: the rows contracted, [V,D] from (g, h), [D,V]
    from (h, g) (head_product's backward, and the fused head's in nn/head_ce.py)."""
    rows = (((0,), (0,)), ((), ()))
    return jax.lax.dot_general(*((g_IV, h_ID) if vocab_first else (h_ID, g_IV)), rows,
                               preferred_element_type=jnp.float32)


def _head_product_bwd(vocab_first, res, g_IV):
    h_ID, w = res
    g_IV = g_IV.astype(h_ID.dtype)
    dims = (((1,), (1 - int(vocab_first),)), ((), ()))
    dh_ID = jax.lax.dot_general(g_IV, w, dims, preferred_element_type=jnp.float32)
    return dh_ID.astype(h_ID.dtype), head_weight_grad(h_ID, g_IV, vocab_first).astype(w.dtype)


head_product.defvjp(_head_product_fwd, _head_product_bwd)


class MTPModule(nnx.Module):
    """One MTP depth: [enorm(E(x[i+k])); hnorm(h_{k-1}[i])] -> eh_proj -> block (sequential), or block(h0)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, placement: Placement):
        self.sequential = cfg.mtp_kind == "sequential"
        d = cfg.d_model
        if self.sequential:
            self.enorm = RMSNorm(d, cfg, rngs)
            self.hnorm = RMSNorm(d, cfg, rngs)
            self.eh_proj = Dense(2 * d, d, (None, "embed"), cfg, rngs)
        # DeepSeek-V3's module block is of the trunk's kind
        self.block = make_block(cfg, rngs, cfg.mlp_kind == "moe", placement)
        self.norm = RMSNorm(d, cfg, rngs)
        self.placement = placement

    def __call__(self, h_prev_BTD, emb_next_BTD, pos_BT, seg_BT, kv, remat: str):
        x = h_prev_BTD
        if self.sequential:
            on = lambda x: self.placement.constrain(x, "batch", "length", "embed")
            x = on(self.eh_proj(on(jnp.concatenate([self.enorm(emb_next_BTD), self.hnorm(h_prev_BTD)], axis=-1))))
        return _run_block(*nnx.split(self.block), x, pos_BT, seg_BT, kv, remat)


class MTPTransformer(nnx.Module):
    """Decoder-only LM with J multi-token-prediction modules sharing its embedding and head; `placement` (default: one
    device of this host) is where its programs run, told to every module it builds."""

    COMPUTE_WEIGHTS = ("embed", "head")  # read only cast to the compute dtype (as Dense's)

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, placement: Placement | None = None):
        placement = placement or host_placement()
        self.cfg, self.placement = cfg, placement
        V, d, L = cfg.vocab_size, cfg.d_model, cfg.n_layers
        pdt = dtype_of(cfg.param_dtype)
        self.embed = param(rngs, (V, d), cfg.init_std, ("vocab", "embed"), pdt)
        if cfg.scan_layers:
            @nnx.split_rngs(splits=L)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(r):
                return make_block(cfg, r, cfg.mlp_kind == "moe", placement)  # validated: no dense-first when scanned

            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([make_block(cfg, rngs, is_moe_layer(cfg, i), placement) for i in range(L)])
        self.final_norm = RMSNorm(d, cfg, rngs)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (d, V), cfg.init_std, ("embed", "vocab"), pdt)
        self.mtp = nnx.List([MTPModule(cfg, rngs, placement) for _ in range(cfg.mtp_depth)])
        self.unstacked = False  # unstack_layers' copy of a scanned trunk: its layers round their outputs as the scan

    # ------------------------------------------------------------------ pieces shared with decoding

    def embed_tokens(self, tokens_BT):
        """Shared embedding lookup, split by batch rows: the table's model dimension is gathered (its vocabulary
        stays split), so each device looks up its own rows' tokens."""
        on = self.placement.constrain
        with jax.named_scope("embed"):
            x_BTD = jnp.take(on(self.embed[...], "vocab", "embed"), tokens_BT, axis=0).astype(dtype_of(self.cfg.dtype))
            # rows after any leading micro-batch axis (the pipeline embeds [A, B, T] at once)
            return on(x_BTD, *(None,) * (x_BTD.ndim - 3), "batch", "length", "embed")

    def logits(self, h):
        """Shared output head on normed hidden states h ([..., D], any leading axes); float32 logits."""
        lead = h.shape[:-1]
        h_ID = h.reshape(-1, h.shape[-1])
        out_IV = head_product(h_ID, *self.head_weight(h_ID.dtype))
        return out_IV.reshape(*lead, out_IV.shape[-1])

    def head_weight(self, dtype):
        """(the head's weight in `dtype`, whether it is [V,D]: the embedding itself when tied, else [D,V])."""
        tied = self.cfg.tie_embeddings
        return (self.embed if tied else self.head)[...].astype(dtype), tied

    def head_norm(self, k: int, h_raw):
        """Depth k's final norm (k=0: the trunk's), making h ready for the shared head."""
        return self.final_norm(h_raw) if k == 0 else self.mtp[k - 1].norm(h_raw)

    def trunk(self, tokens_BT, pos_BT=None, seg_BT=None, cache=None):
        """Trunk forward; raw hidden states [B,T,D] and the updated cache (per-layer tuple, or stacked if scanned)."""
        return self.trunk_routed(tokens_BT, pos_BT, seg_BT, cache)[:2]

    def trunk_routed(self, tokens_BT, pos_BT=None, seg_BT=None, cache=None):
        """trunk's (hidden, cache) and the MoE layers' routing info (MTPOutput.routing's trunk entries)."""
        pos_BT = _positions(tokens_BT) if pos_BT is None else pos_BT
        x = self.embed_tokens(tokens_BT)
        remat = self.cfg.remat
        if self.cfg.scan_layers:
            x, new, aux = scan_blocks(*nnx.split(self.blocks), x, pos_BT, seg_BT, cache, remat)
            return x, new, {"blocks": aux} if aux else {}
        news, routing = [], {}
        for i, blk in enumerate(self.blocks):
            x, nkv, aux = _run_block(*nnx.split(blk), x, pos_BT, seg_BT, None if cache is None else cache[i], remat)
            if self.unstacked:  # stored, as a scan's step stores it: XLA may not keep it in excess precision
                x = jax.lax.optimization_barrier(x)
            news.append(nkv)
            if aux:
                routing[f"blocks.{i}"] = aux
        return x, None if cache is None else tuple(news), routing

    def trunk_state(self, h_raw_BTD):
        """The trunk's state as the MTP modules read it (h0): raw, or final-normed when model.mtp_hidden=normed."""
        return self.final_norm(h_raw_BTD) if self.cfg.mtp_hidden == "normed" else h_raw_BTD

    def mtp_input(self, h_prev, h0):
        """What MTP module k reads: h_{k-1} (sequential: the chain, starting at h0) or h0 (parallel heads); h0 is
        trunk_state's."""
        return h_prev if self.cfg.mtp_kind == "sequential" else h0

    def mtp_forward(self, k: int, h_prev_BTD, next_tokens_BT, pos_BT=None, seg_BT=None, cache: KV | None = None):
        """MTP depth k (1-based): raw h_{k-1}[i] and token x[i+k] -> raw h_k[i], updated cache."""
        return self.mtp_routed(k, h_prev_BTD, next_tokens_BT, pos_BT, seg_BT, cache)[:2]

    def mtp_routed(self, k: int, h_prev_BTD, next_tokens_BT, pos_BT=None, seg_BT=None, cache: KV | None = None):
        """mtp_forward's (hidden, cache) and its block's routing info ({} when dense)."""
        pos_BT = _positions(next_tokens_BT) if pos_BT is None else pos_BT
        mod = self.mtp[k - 1]
        emb = self.embed_tokens(next_tokens_BT) if mod.sequential else None
        with jax.named_scope(MTP_SCOPE):  # compiled programs name its ops, so their FLOPs can be told apart
            return mod(h_prev_BTD, emb, pos_BT, seg_BT, cache, self.cfg.remat)

    # ------------------------------------------------------------------ training forward

    def __call__(self, tokens_BT, segment_ids_BT=None, unroll: int = 0, unroll_module: int = 1,
                 trunk: tuple | None = None) -> MTPOutput:
        """All depths over a batch; hidden[k] at position i is ready to predict x[i+k+1]. With `unroll` > 0, also
        module `unroll_module`'s reuses (unrolled[u-1] predicts x[i+unroll_module+u+1]). `trunk`: trunk_routed's
        (raw hidden, routing) computed elsewhere (parallel.pipeline's stages), so only the modules run here."""
        if trunk is None:
            h, _, routing = self.trunk_routed(tokens_BT, seg_BT=segment_ids_BT)
        else:
            h, routing = trunk[0], dict(trunk[1])
        hidden, raw = [self.final_norm(h)], [h]
        h = h0 = hidden[0] if self.cfg.mtp_hidden == "normed" else h  # trunk_state's, its norm computed once
        for k in range(1, self.cfg.mtp_depth + 1):
            # Positions past the end read token 0; their targets are masked in the loss and causal
            # attention keeps them from touching earlier positions.
            nxt = shift_left(tokens_BT, k)
            h, _, aux = self.mtp_routed(k, self.mtp_input(h, h0), nxt, seg_BT=segment_ids_BT)
            hidden.append(self.mtp[k - 1].norm(h))
            if aux:
                routing[f"mtp.{k - 1}"] = aux
            raw.append(h)
        unrolled = None
        if unroll:  # the unrolled applications' routing is not collected: their loads do not move the biases
            unrolled = self.unroll(unroll_module, raw[unroll_module], tokens_BT, unroll, segment_ids_BT)
        hidden_MBTD = self.placement.constrain(jnp.stack(hidden), None, "batch", "length", "embed")
        return MTPOutput(hidden=hidden_MBTD, unrolled=unrolled, routing=routing)

    def unroll(self, k: int, h_raw_BTD, tokens_BT, n: int, seg_BT=None):
        """Module k applied n more times after its own depth, each on its previous raw output and the true next
        token (the chain a proposer runs when it reuses module k on accepted drafts): normed [n,B,T,D]."""
        out = []
        for u in range(1, n + 1):
            # Its own output, never mtp_input's trunk state: the proposers' reuse steps feed it back the same way.
            h_raw_BTD, _ = self.mtp_forward(k, h_raw_BTD, shift_left(tokens_BT, k + u), seg_BT=seg_BT)
            out.append(self.mtp[k - 1].norm(h_raw_BTD))
        return self.placement.constrain(jnp.stack(out), None, "batch", "length", "embed")


def make_block(cfg: ModelConfig, rngs: nnx.Rngs, moe: bool, placement: Placement) -> Block:
    """A transformer block: latent attention when model.attention_kind=mla (else GQA), and a mixture of experts as
    its MLP when `moe` (else the SwiGLU). The one place a block's parts are chosen."""
    attn = MLAttention(cfg, rngs, placement) if cfg.attention_kind == "mla" else None
    return Block(cfg, rngs, placement, attn=attn, mlp=MoE(cfg, rngs, placement) if moe else None)


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    """Whether trunk block i is a mixture of experts (model.mlp_kind=moe past the first_k_dense_replace)."""
    return cfg.mlp_kind == "moe" and i >= cfg.first_k_dense_replace


def moe_layers(model: MTPTransformer) -> dict:
    """The MoE modules by MTPOutput.routing's names: `blocks.i` (`blocks`, stacked, when scanned) and `mtp.k`."""
    out = {}
    if model.cfg.mlp_kind != "moe":
        return out
    if model.cfg.scan_layers:
        out["blocks"] = model.blocks.mlp
    else:
        out.update({f"blocks.{i}": b.mlp for i, b in enumerate(model.blocks) if is_moe_layer(model.cfg, i)})
    out.update({f"mtp.{k}": m.block.mlp for k, m in enumerate(model.mtp)})
    return out


def shift_left(x_BT, k: int, fill=0):
    """x[:, i+k] at position i; positions past the end get `fill` (shapes stay fixed)."""
    if k == 0:
        return x_BT
    pad = jnp.full((x_BT.shape[0], k, *x_BT.shape[2:]), fill, x_BT.dtype)  # trailing axes (a [B,T,D] state) kept
    return jnp.concatenate([x_BT[:, k:], pad], axis=1)


def _positions(tokens_BT):
    return jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)


def build_model(cfg: Config | ModelConfig, *, seed: int = 0, placement: Placement | None = None) -> MTPTransformer:
    """Build the model from a Config (or its model section) with parameters from `seed`, MTP modules as
    model.mtp_init says, for `placement` (default: one device of this host)."""
    mcfg = cfg.model if isinstance(cfg, Config) else cfg
    model = MTPTransformer(mcfg, rngs=nnx.Rngs(params=seed), placement=placement)
    if mcfg.mtp_init == "last_block":
        init_mtp_from_last_block(model)
    return model


def placed(model: MTPTransformer, placement: Placement) -> MTPTransformer:
    """The same model (its state, not a copy of it) rebuilt for another placement: only the static graph differs."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: MTPTransformer(model.cfg, rngs=nnx.Rngs(0), placement=placement)))
    return nnx.merge(graphdef, nnx.state(model))


def for_decoding(model: MTPTransformer) -> MTPTransformer:
    """A copy of `model` as the decode loop runs it, built once per call before the loop: its MoE layers dropless
    whatever `model.moe_buffer_factor` (a decoded token's output depends on no other token), the weights its modules
    read only cast to the compute dtype (their COMPUTE_WEIGHTS) cast to it here, so no round reads the float32 masters
    to cast them again, and its projections' products summed in float32 (Dense.accumulate). The same numbers: each
    matmul made that cast itself, and a bfloat16 dot is its float32 sum rounded once. The model is left as it was."""
    view, dt = nnx.clone(model), dtype_of(model.cfg.dtype)
    for _, m in nnx.iter_modules(view):
        if isinstance(m, MoE):
            m.buffer_factor = 0.0
        if isinstance(m, Dense) and dt.itemsize < 4:
            m.accumulate = jnp.float32
        for name in getattr(m, "COMPUTE_WEIGHTS", ()):
            w = getattr(m, name, None)
            if isinstance(w, nnx.Param) and w.get_value().dtype.itemsize > dt.itemsize:  # narrower only: bf16 of f32
                w.set_value(w.get_value().astype(dt))
    return view


def unstack_layers(model: MTPTransformer) -> MTPTransformer:
    """`model` (in place) with a scanned trunk's stacked blocks made one block per layer, run as an unscanned trunk
    is (a Python loop; its cache one KV per layer). The decode loop's, built before it: inside a scan, XLA's GPU
    compiler copies each layer's MLP weights out of the stacked [L, ...] arrays before its GEMMs, every round (2.4 of
    gpu_1b's 5.4 GB plain decode round); sliced here once, the rounds read them where they lie. Compiled, the layers
    compute the scan's numbers bit for bit, each layer's output stored between them as the scan stores it (op by op,
    eagerly, they would round differently)."""
    if model.cfg.scan_layers:
        model.unstacked = True
        gdef, st = nnx.split(model.blocks)
        model.blocks = nnx.List([nnx.merge(gdef, jax.tree.map(lambda x, i=i: x[i], st))
                                 for i in range(model.cfg.n_layers)])
        model.cfg = model.cfg.model_copy(update={"scan_layers": False})
    return model


def last_block_params(cfg: ModelConfig, params: dict) -> dict:
    """The last trunk block's subtree of a pure-dict parameter tree (its layer axis indexed away when scanned)."""
    if cfg.scan_layers:
        return jax.tree.map(lambda x: x[-1], params["blocks"])
    return params["blocks"][cfg.n_layers - 1]


def mtp_from_last_block(cfg: ModelConfig, params: dict) -> dict:
    """model.mtp_init=last_block on a pure-dict parameter tree: each MTP module's block becomes the last trunk block.

    The modules' norms and eh_proj keep their fresh init. Leaves are used as given (the importer passes lazy ones).
    """
    last = last_block_params(cfg, params)
    mtp = {k: {**m, "block": last} for k, m in params["mtp"].items()}
    return {**params, "mtp": mtp}


def init_mtp_from_last_block(model: MTPTransformer) -> None:
    """Apply model.mtp_init=last_block in place: every MTP module's block becomes a copy of the last trunk block."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    new = mtp_from_last_block(model.cfg, params)["mtp"]
    for k, mod in enumerate(model.mtp):
        block = nnx.state(mod.block, nnx.Param)
        # copies: one buffer held by two parameters cannot be donated to the train step
        nnx.replace_by_pure_dict(block, jax.tree.map(jnp.copy, new[k]["block"]))
        nnx.update(mod.block, block)


def param_counts(model: MTPTransformer) -> dict[str, int]:
    """Parameter counts: total, active (per token), shared embedding/head, trunk blocks+norm, and each MTP module."""
    def count(node) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(nnx.state(node, nnx.Param)))

    shared = int(model.embed.size) + (0 if model.cfg.tie_embeddings else int(model.head.size))
    mtp = [count(m) for m in model.mtp]
    total = count(model)
    # active: what one token reads, the routed experts it does not reach left out (model.mlp_kind=moe)
    unused = sum((int(m.w_gate.size) + int(m.w_up.size) + int(m.w_down.size)) // m.w_gate.shape[-3]
                 * (m.w_gate.shape[-3] - m.k) for m in moe_layers(model).values())
    return {"total": total, "active": total - unused, "shared_embed_head": shared, "trunk": total - shared - sum(mtp),
            "mtp": mtp}
