"""Hugging Face export and import: seconds per GB and peak memory against the model's size and its largest
tensor, at two model sizes with the same largest tensor (streaming tensor by tensor, memory should track the
tensor, not the model).

    python bench/convert_bench.py [--mb 300 800] [--json out.json]

Each conversion runs in a fresh child process that samples its own anonymous resident memory (RssAnon:
heap, not the page cache of memory-mapped files) every 5 ms; "extra" is the peak minus the level after
imports. The run directory is written directly (a random model-only checkpoint), not trained.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from bench.common import json_path, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _child(kind: str, src: str, dst: str) -> dict:
    """Run one conversion in this process, sampling memory; its summary with seconds and peak memory."""
    import absl.logging

    from mtpjax.convert import export_run, import_hf

    absl.logging.set_verbosity(absl.logging.ERROR)
    base, peak, stop = _anon_mb(), [0.0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _anon_mb())
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    out = export_run(src, dst, mtp_modules=1) if kind == "export" else import_hf(src, dst)
    seconds = time.perf_counter() - t0
    stop.set()
    t.join()
    return {**out, "seconds": seconds, "baseline_anon_mb": base, "peak_anon_mb": peak[0]}


def _config(mb: float) -> list[str]:
    """A Qwen2-like shape (vocab 32000, d 1024, untied, 1 MTP module) with enough layers for ~mb of float32."""
    d, f, v = 1024, 2816, 32000
    per_layer = 4 * (2 * d * d + 2 * d * 256 + 3 * d * f)
    layers = max(1, round((mb * 1e6 - 4 * 2 * v * d) / per_layer) - 1)
    return [f"model.vocab_size={v}", f"model.d_model={d}", f"model.d_ff={f}", f"model.n_layers={layers}",
            "model.n_heads=16", "model.n_kv_heads=4", "model.tie_embeddings=false", "model.mtp_depth=1",
            "model.qkv_bias=true"]


def make_run(run: Path, overrides: list[str]) -> tuple[int, int]:
    """A model-only run directory of random float32 weights; (total bytes, largest tensor bytes)."""
    import jax

    from mtpjax.config import load_config
    from mtpjax.convert.export import param_shapes
    from mtpjax.convert.importer import Lazy, save_model_checkpoint
    from mtpjax.data import ByteTokenizer

    cfg = load_config(None, [*overrides, f"train.run_dir={run}"])
    shapes = param_shapes(cfg)
    rng = np.random.default_rng(0)
    tree = jax.tree.map(lambda s: Lazy(s.shape, s.dtype, lambda s=s: rng.standard_normal(s.shape, np.float32)), shapes)
    run.mkdir(parents=True)
    save_model_checkpoint(run, tree, {"step": 0, "config": cfg.to_dict()})
    (run / "config.yaml").write_text(cfg.to_yaml())
    ByteTokenizer().save(run / "tokenizer")
    sizes = [int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(shapes)]
    return sum(sizes), max(sizes)


def _run_child(kind: str, src: Path, dst: Path) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", kind, str(src), str(dst)], capture_output=True,
                       text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(mb: float) -> dict:
    """Export then import a random model of ~mb MB, each in a child process."""
    from bench.common import load

    with tempfile.TemporaryDirectory(prefix="convert_bench_") as tmp:
        tmp = Path(tmp)
        total, largest = make_run(tmp / "run", _config(mb))
        res = {"model_mb": total / 1e6, "largest_tensor_mb": largest / 1e6, "load": load()}
        for kind, src, dst in (("export", tmp / "run", tmp / "hf"), ("import", tmp / "hf", tmp / "back")):
            r = _run_child(kind, src, dst)
            extra = r["peak_anon_mb"] - r["baseline_anon_mb"]
            res[kind] = {"seconds": round(r["seconds"], 2), "seconds_per_gb": round(r["seconds"] / (total / 1e9), 2),
                         "peak_extra_mb": round(extra, 1), "extra_over_model": round(extra * 1e6 / total, 3),
                         "extra_over_largest_tensor": round(extra * 1e6 / largest, 2)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[300.0, 800.0],
                    help="approximate model sizes in MB (float32)")
    ap.add_argument("--json", type=json_path)
    ap.add_argument("--child", nargs=3, metavar=("KIND", "SRC", "DST"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    results = [measure(mb) for mb in args.mb]
    for res in results:
        print(f"model {res['model_mb']:.0f} MB (largest tensor {res['largest_tensor_mb']:.0f} MB), load {res['load']}")
        for kind in ("export", "import"):
            r = res[kind]
            print(f"  {kind}: {r['seconds']:.1f} s = {r['seconds_per_gb']:.1f} s/GB; peak extra memory "
                  f"{r['peak_extra_mb']:.0f} MB = {r['extra_over_model']:.2f} x model = "
                  f"{r['extra_over_largest_tensor']:.1f} x largest tensor")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
