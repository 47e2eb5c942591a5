"""Hand-written HLO for the estimator's tests (mtpjax.parallel.hlo)."""


def one_call(params: dict[str, str], out: str, target: str, attrs: str) -> str:
    """A module whose one instruction is a custom call of `target` on the parameters (name -> laid-out shape)."""
    sig = ", ".join(f"{n}: {shape.partition('{')[0]}" for n, shape in params.items())
    lines = [f"  %{n} = {shape} parameter({i})" for i, (n, shape) in enumerate(params.items())]
    args = ", ".join(f"%{n}" for n in params)
    return (f"HloModule m\n\nENTRY %main ({sig}) -> {out.partition('{')[0]} {{\n" + "\n".join(lines) + "\n"
            f'  ROOT %k = {out} custom-call({args}), custom_call_target="{target}", {attrs}\n}}\n')
