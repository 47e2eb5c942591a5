"""Hugging Face export and import (`python -m mtpjax.convert export|import --help`).

export: a run's checkpoint as a Qwen2 model that `transformers` loads with no custom code, with MTP modules
in the MiMo layout that vLLM and SGLang draft with (or a plain Llama), or an MLA (+ MoE) run as DeepSeek-V3 with
its MTP layers. import: a Llama / Qwen2 / DeepSeek-V3 safetensors checkpoint as a model-only run directory that
`load_model` and decode.py read (DeepSeek-V3's float8 block-scaled weights dequantized; export writes them with
`quantize="fp8"`: mtpjax.convert.fp8). Both stream tensor by tensor.
"""

from mtpjax.convert.errors import ConvertError  # noqa: F401  (its own module: submodules import it without a cycle)


def export_run(*args, **kwargs):
    """See mtpjax.convert.export.export_run."""
    from mtpjax.convert.export import export_run as f

    return f(*args, **kwargs)


def import_hf(*args, **kwargs):
    """See mtpjax.convert.importer.import_hf."""
    from mtpjax.convert.importer import import_hf as f

    return f(*args, **kwargs)
