"""`python -m mtpjax convert export|import`: Hugging Face export of a run, import of a Llama / Qwen2 / DeepSeek-V3
checkpoint."""

from __future__ import annotations

import json
import sys
import time

from mtpjax.cli.args import Parser, command
from mtpjax.convert import ConvertError


def parser() -> Parser:
    p = Parser(prog="python -m mtpjax convert", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face directory")
    e.add_argument("--run-dir", required=True, help="a run directory written by train.py")
    e.add_argument("--out", required=True, help="the directory to create (must not exist)")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    e.add_argument("--mtp-modules", type=int, default=None,
                   help="MTP modules to write (default 1, or 0 for a run without any): vLLM and SGLang draft every "
                        "step with module 1 of the MiMo layout")
    e.add_argument("--format", default="qwen2", choices=("qwen2", "llama", "deepseek_v3"),
                   help="qwen2: Qwen2 trunk (+ MiMo MTP modules); llama: a plain LlamaForCausalLM trunk; "
                        "deepseek_v3: DeepseekV3ForCausalLM (MLA, dense or MoE) with its MTP layers")
    e.add_argument("--quantize", default=None, choices=("fp8",),
                   help="fp8: DeepSeek-V3's float8 e4m3 linears with 128x128 block scales (weight_scale_inv), the "
                        "embeddings, heads, norms, router and eh_proj as they are (--format deepseek_v3)")
    e.add_argument("--shard-mb", type=float, default=2000.0,
                   help="largest safetensors file in MB before the weights are split into shards (default 2000)")
    i = sub.add_parser("import", help="turn a local Llama / Qwen2 / DeepSeek-V3 safetensors checkpoint into a run "
                                      "directory")
    i.add_argument("--hf", required=True, help="a Hugging Face model directory (config.json, safetensors, tokenizer)")
    i.add_argument("--out", required=True, help="the run directory to create (must not exist)")
    i.add_argument("overrides", nargs="*", help="config overrides, e.g. model.mtp_depth=2 model.mtp_init=last_block")
    return p


@command
def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints a JSON summary, returns the exit status (2 for bad input, with a one-line message)."""
    args = parser().parse_args(argv)
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)  # orbax's notices are not news to a reader
    from mtpjax.convert import export_run, import_hf

    start = time.perf_counter()
    try:
        if args.command == "export":
            if not args.shard_mb > 0:
                raise ConvertError(f"--shard-mb {args.shard_mb} must be > 0")
            summary = export_run(args.run_dir, args.out, step=args.step, mtp_modules=args.mtp_modules,
                                 fmt=args.format, max_shard_bytes=args.shard_mb * 1e6, quantize=args.quantize)
        else:
            summary = import_hf(args.hf, args.out, args.overrides)
    except OSError as e:  # disk full, permissions: the temporary directory is already removed
        raise ConvertError(f"writing {args.out} failed ({e.strerror or e}); nothing was written") from None
    for note in summary.pop("notes", ()):
        print(f"note: {note}", file=sys.stderr)
    summary["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(summary))
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
