"""The command shell (the top layer): every command's `main` (train, decode, plan, compile, convert, data,
distributed, lm_eval).

`python -m mtpjax COMMAND ...` runs one; `train.py` and `decode.py` at the repository root are the same
train and decode commands.
"""

COMMANDS = ("train", "decode", "plan", "compile", "convert", "data", "distributed", "lm_eval")
